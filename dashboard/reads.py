"""The dashboard's connections and cached reads: Settings read once, one engine, one Redis client.

Knows Streamlit's caches (a resource for the connections, data with a TTL for each query) and that the
dashboard only reads: every session runs in a read-only transaction. The SQL is servelab.store.queries';
runs are immutable once stored, so their reads keep longer than the live jobs and queue figures.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import redis
import streamlit as st
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from servelab.embedded import resolve_urls
from servelab.analysis.verdict import ComparisonRefused, Levels, Limits, RunSet, Verdict, compare
from servelab.settings import Settings
from servelab.lab import runsets
from servelab.queue import streams
from servelab.store import queries
from servelab.store.db import make_engine, session_factory

T = TypeVar("T")
RUNS_TTL_S = 30  # new runs appear within this
LIVE_TTL_S = 3  # jobs, queues, workers


@dataclass(frozen=True)
class Connections:
    settings: Settings
    db: Engine
    sessions: sessionmaker[Session]
    redis: redis.Redis


@st.cache_resource
def connections() -> Connections:
    settings = Settings()
    urls = resolve_urls(settings)  # NOTE: no URLs set: start or reuse the embedded servers, as every process does
    # NOTE: read-only transactions: the dashboard never writes, and the database enforces it.
    db = make_engine(urls.database_url).execution_options(postgresql_readonly=True)
    return Connections(settings, db, session_factory(db), redis.Redis.from_url(urls.redis_url, socket_timeout=5))


@contextmanager
def session() -> Iterator[Session]:
    with connections().sessions() as s:
        yield s


def read(query: Callable[..., T], **kwargs: Any) -> T:
    with session() as s:
        return query(s, **kwargs)


@st.cache_data(ttl=RUNS_TTL_S, show_spinner=False)
def runs() -> list[queries.RunListing]:
    return read(queries.list_runs)


@st.cache_data(ttl=600, show_spinner="Loading runs…")
def run_set(run_ids: tuple[str, ...]) -> RunSet:
    return read(runsets.load_run_set, run_ids=list(run_ids))


@st.cache_data(ttl=RUNS_TTL_S, show_spinner=False)
def stored_limits(baseline: tuple[str, ...], candidates: tuple[str, ...]) -> runsets.StoredLimits:
    return read(runsets.stored_limits, baseline_run_ids=list(baseline), candidate_run_ids=list(candidates))


@st.cache_data(ttl=RUNS_TTL_S, show_spinner=False)
def latest_comparison_runs() -> tuple[list[str], list[str]] | None:
    return read(queries.latest_comparison_runs)


@st.cache_data(ttl=600, show_spinner="Judging…")
def verdict(baseline: tuple[str, ...], candidate: tuple[str, ...], limits_json: str) -> Verdict | str:
    """The verdict, or the refusal's message when the runs must not be compared."""
    limits = Limits.model_validate_json(limits_json)
    # NOTE: runs pair by round only when one stored comparison measured them together; groups of runs picked
    # here may come from several plans, whose round numbers say nothing about when the runs ran
    stored = stored_limits(baseline, candidate)
    together = stored.source != "defaults"
    try:
        return compare(run_set(baseline), run_set(candidate), limits, paired_rounds=together,
                       levels=stored_levels(stored))
    except ComparisonRefused as exc:
        return str(exc)


def stored_levels(stored: runsets.StoredLimits) -> Levels:
    """The levels a stored comparison read its intervals at: a comparison run until settled spends its 5 % over its
    looks (each read at 99.x %); the dashboard reads its runs at the same level, never at a fixed 95 %."""
    recorded = (stored.sequential or {}).get("levels")
    return Levels(**recorded) if recorded else Levels()


def limits_json(limits: Limits) -> str:
    return json.dumps(limits.model_dump(mode="json"), sort_keys=True)


@st.cache_data(ttl=600, show_spinner=False)
def batch_points(run_ids: tuple[str, ...]) -> list[queries.BatchPoint]:
    return read(queries.batch_points, run_ids=list(run_ids))


@st.cache_data(ttl=600, show_spinner=False)
def request_tokens(run_ids: tuple[str, ...]) -> list[queries.RequestTokens]:
    return read(queries.request_tokens, run_ids=list(run_ids))


@st.cache_data(ttl=RUNS_TTL_S, show_spinner=False)
def sweeps() -> list[queries.SweepListing]:
    return read(queries.list_sweeps)


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def jobs() -> list[queries.JobProgress]:
    return read(queries.job_progress)


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def request_status_counts() -> dict[str, dict[str, int]]:
    return read(queries.request_status_counts)


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def workers() -> list[queries.LiveWorker]:
    return read(queries.workers, now=datetime.now(UTC))


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def failures() -> list[queries.Failure]:
    return read(queries.recent_failures)


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def stream_depths(config_names: tuple[str, ...]) -> dict[str, dict[str, int]]:
    c = connections()
    return streams.stream_depths(c.redis, prefix=c.settings.key_prefix, config_names=list(config_names))


def query_ids(name: str) -> list[str]:
    """Run ids from the URL (?baseline=a,b&candidates=c,d), in order, without blanks or repeats."""
    raw = st.query_params.get(name, "")
    return list(dict.fromkeys(part.strip() for part in raw.split(",") if part.strip()))
