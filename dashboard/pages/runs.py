"""Runs: every stored run with its settings and headline figures, filterable, each linking into the compare page.

A run's link opens the compare page with its config's repeats as the baseline and every other config served
on the same workload as candidates. Filters live in the URL (?config=..&weights=..&workload=..).
"""

from __future__ import annotations

from collections import defaultdict
from urllib.parse import urlencode

import pandas as pd
import streamlit as st

from dashboard import hints, reads
from servelab.store.queries import RunListing


def compare_link(run: RunListing, listing: list[RunListing]) -> str:
    same = [r for r in listing if r.workload_fingerprint == run.workload_fingerprint]
    mine = [r.id for r in same if (r.serving_config_name, r.config_hash) == (run.serving_config_name, run.config_hash)]
    others = [r.id for r in same if r.id not in mine]
    return "/?" + urlencode({"baseline": ",".join(mine), "candidates": ",".join(others)}, safe=",")


def url_filter(name: str, options: list[str], label: str) -> list[str]:
    chosen = [v for v in st.query_params.get_all(name) if v in options]
    picked = st.multiselect(label, options, default=chosen)
    if picked != chosen:
        st.query_params[name] = picked
    return picked


def main() -> None:
    st.title("Runs")
    listing = hints.runs_or_explain(reads.runs)
    if listing is None:
        return
    columns = st.columns(4)
    with columns[0]:
        configs = url_filter("config", sorted({r.serving_config_name for r in listing}), "config")
    with columns[1]:
        weights = url_filter("weights", sorted({r.settings["weight precision"] for r in listing}), "weight precision")
    with columns[2]:
        workloads = url_filter("workload", sorted({r.workload_name for r in listing}), "workload")
    with columns[3]:
        text = st.text_input("contains", value=st.query_params.get("q", ""), placeholder="plan, model, hardware…")
    if text != st.query_params.get("q", ""):
        st.query_params["q"] = text
    shown = [r for r in listing if (not configs or r.serving_config_name in configs)
             and (not weights or r.settings["weight precision"] in weights)
             and (not workloads or r.workload_name in workloads)
             and (not text or text.lower() in " ".join([r.plan_name or "", r.hardware, *r.settings.values()]).lower())]
    per_workload: dict[str, set[str]] = defaultdict(set)
    for r in listing:
        per_workload[r.workload_fingerprint].add(r.serving_config_name)
    frame = pd.DataFrame([{
        "compare": compare_link(r, listing), "started": r.started_at, "config": r.serving_config_name,
        "repeat": r.repeat_index, "plan": r.plan_name, "workload": r.workload_name, **r.settings,
        "hardware": r.hardware, "requests": r.num_requests, "succeeded": r.num_succeeded,
        "output tokens/s": r.output_tokens_per_s, "p95 TTFT ms": r.p95_ttft_ms, "p95 TPOT ms": r.p95_tpot_ms,
        "p95 queue ms": r.p95_queue_ms, "mean batch": r.mean_batch_size, "rows preempted": r.num_preempted,
        "LAMBADA accuracy": r.lambada_accuracy, "configs on this workload": len(per_workload[r.workload_fingerprint]),
        "run id": r.id} for r in shown])
    st.caption(f"{len(shown)} of {len(listing)} runs. 'open' compares the run's config (all its repeats) against "
               "every other config served on the same workload.")
    if frame.empty:
        st.info("No run matches these filters.")
        return
    st.dataframe(frame, hide_index=True, width="stretch", column_config={
        "compare": st.column_config.LinkColumn("compare", display_text="open"),
        "started": st.column_config.DatetimeColumn("started", format="YYYY-MM-DD HH:mm:ss"),
        "output tokens/s": st.column_config.NumberColumn(format="%.1f"),
        "p95 TTFT ms": st.column_config.NumberColumn(format="%.1f"),
        "p95 TPOT ms": st.column_config.NumberColumn(format="%.2f"),
        "p95 queue ms": st.column_config.NumberColumn(format="%.1f"),
        "mean batch": st.column_config.NumberColumn(format="%.2f"),
        "LAMBADA accuracy": st.column_config.NumberColumn(format="%.3f"),
    })


main()
