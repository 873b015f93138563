"""Jobs and queues, as they run: batch jobs with progress, queue depth per stream, live workers, recent failures.

Refreshes itself every few seconds (a fragment), reading Postgres for jobs, requests, workers and failures
and Redis for the streams' depth. Reads only: cancelling a job is the API's business.
"""

from __future__ import annotations

import pandas as pd
import redis
import streamlit as st
from sqlalchemy.exc import SQLAlchemyError

from dashboard import hints, reads

LIVE_S = 30.0  # NOTE: the API's default worker_live_s: a worker heard from this recently is live
REFRESH_S = 5


def show_jobs() -> None:
    st.subheader("Batch jobs")
    jobs = reads.jobs()
    if not jobs:
        st.info("No batch jobs yet. Upload a JSONL file in the OpenAI Batch format and create a job through the "
                "API (POST /v1/files, then POST /v1/batches).")
        return
    st.dataframe(pd.DataFrame([{
        "job": j.id, "tenant": j.tenant, "status": j.status, "created": j.created_at, "lines read": j.num_lines,
        "ingested": j.is_ingested, "requests": j.num_total, "finished": j.num_finished,
        "progress": j.num_finished / j.num_total if j.num_total else 0.0,
        **{s: j.counts.get(s, 0) for s in ("queued", "running", "succeeded", "failed", "cancelled")},
    } for j in jobs]), hide_index=True, width="stretch", column_config={
        "progress": st.column_config.ProgressColumn("progress", min_value=0.0, max_value=1.0, format="percent")})


def show_queues() -> None:
    st.subheader("Queues")
    counts = reads.request_status_counts()
    try:
        depths = reads.stream_depths(tuple(sorted(counts)))
    except redis.RedisError as exc:
        st.warning(f"Redis cannot be read ({type(exc).__name__}: {exc}): stream depths are not shown.")
        depths = {}
    if not counts and not depths:
        st.info("No requests yet. Start a worker for a config and send requests (or run a plan):")
        st.code("servelab worker -c configs/fp32.yaml\n" + hints.RUN, language="bash")
        return
    st.dataframe(pd.DataFrame([{
        "config": name, "interactive stream": depths.get(name, {}).get("interactive", 0),
        "bulk stream": depths.get(name, {}).get("bulk", 0),
        **{s: counts.get(name, {}).get(s, 0) for s in ("queued", "running", "succeeded", "failed", "cancelled")},
    } for name in sorted(set(counts) | set(depths))]), hide_index=True, width="stretch")
    st.caption("Stream columns: entries not yet acknowledged (waiting or being served), from Redis. The other "
               "columns count request rows by status, from Postgres.")


def show_workers() -> None:
    st.subheader("Workers")
    workers = reads.workers()
    if not workers:
        st.info("No worker has registered. Start one per device:")
        st.code("servelab worker -c configs/fp32.yaml", language="bash")
        return
    st.dataframe(pd.DataFrame([{
        "live": "●" if w.seconds_since_heartbeat <= LIVE_S else "○", "worker": w.name,
        "config": w.serving_config_name, "config hash": w.config_hash, "device": w.device, "hardware": w.hardware,
        "started": w.started_at, "last heartbeat": w.heartbeat_at,
        "seconds since heartbeat": round(w.seconds_since_heartbeat, 1)} for w in workers]),
        hide_index=True, width="stretch")
    st.caption(f"● heard from within {LIVE_S:.0f} s.")


def show_failures() -> None:
    st.subheader("Recent failures")
    failures = reads.failures()
    if not failures:
        st.success("No failed requests.")
        return
    st.dataframe(pd.DataFrame([{"request": f.request_id, "config": f.serving_config_name, "finished": f.finished_at,
                                "attempts": f.num_attempts, "reason": f.reason} for f in failures]),
                 hide_index=True, width="stretch")


@st.fragment(run_every=REFRESH_S)
def live() -> None:
    try:
        show_queues()
        show_workers()
        show_jobs()
        show_failures()
    except SQLAlchemyError as exc:
        hints.database_unreadable(exc)


st.title("Jobs and queues")
st.caption(f"Refreshed every {REFRESH_S} s.")
live()
