"""The dashboard's reads of rows: runs and their settings, batches, sweeps, jobs, workers, failures.

Read-only SQL, one function per question a page asks, each returning small frozen dataclasses, so the pages
only select, cache and draw, and these are tested without Streamlit. Knows tables, not the lab's verdict
(servelab.lab.runsets builds run sets from these rows) nor Redis (servelab.queue.streams has the depths).
Imports no torch: the dashboard uses it. Does not know how a page draws, nor how runs are made.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Float, Integer, cast, func, select
from sqlalchemy.orm import Session

from servelab.store.models import (
    BatchJobRow,
    BatchRow,
    ComparisonRow,
    RequestMetricsRow,
    RequestRow,
    RequestStatus,
    ResultRow,
    RunRequestRow,
    RunRow,
    SweepRow,
    WorkerRow,
)
from servelab.store.run_settings import describe_settings


@dataclass(frozen=True)
class RunListing:
    """One run as the runs table and the pickers show it: its settings and headline figures."""

    id: str
    serving_config_name: str
    config_hash: str
    workload_name: str
    workload_fingerprint: str
    plan_name: str | None
    repeat_index: int
    started_at: datetime
    settings: dict[str, str]
    hardware: str
    num_requests: int | None
    num_succeeded: int | None
    output_tokens_per_s: float | None
    p95_ttft_ms: float | None
    p95_tpot_ms: float | None
    lambada_accuracy: float | None
    p95_queue_ms: float | None = None
    mean_batch_size: float | None = None
    num_preempted: int | None = None  # None: a run stored before preemptions were summed
    kv_pool_blocks: int | None = None  # the paged pool its worker built; None: not paged, or not recorded


@dataclass(frozen=True)
class BatchPoint:
    """One engine batch of a run: its peak stored KV bytes and the retained tokens at that peak."""

    run_id: str
    serving_config_name: str
    weights: str
    kv_cache_dtype: str
    num_requests: int
    kv_cache_bytes: int
    retained_tokens: int
    weight_bytes: int
    peak_working_bytes: int
    num_prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache, and of those found there
    num_prefix_hit_tokens: int = 0
    kv_block_size: int = 0  # 0: the cache is not paged
    kv_blocks_shared: int = 0  # at the batch's KV peak
    kv_blocks_private: int = 0
    num_preempted: int = 0  # rows taken out unfinished during the batch


@dataclass(frozen=True)
class RequestTokens:
    """One request of a run: the tokens whose keys and values it kept when it finished."""

    run_id: str
    serving_config_name: str
    num_prompt_tokens: int
    num_generated_tokens: int

    @property
    def retained_tokens(self) -> int:
        # NOTE: the last generated token is never fed back, so its keys and values are never stored.
        return self.num_prompt_tokens + max(0, self.num_generated_tokens - 1)


@dataclass(frozen=True)
class SweepListing:
    id: str
    created_at: datetime
    hardware: dict[str, Any]
    report: dict[str, Any]


@dataclass(frozen=True)
class StoredSweepPoint:
    """One (config, batch size) point of a sweep, read defensively from the stored report."""

    config: str
    weights: str
    batch_size: int
    decode_tokens_per_s: float | None
    tpot_ms: float | None
    bandwidth_roofline_tokens_per_s: float | None
    compute_roofline_tokens_per_s: float | None


@dataclass(frozen=True)
class Crossover:
    """Where one precision stops paying against another, or where decoding turns compute bound."""

    label: str
    batch_size: float


@dataclass(frozen=True)
class JobProgress:
    id: str
    tenant: str
    status: str
    created_at: datetime
    num_lines: int
    is_ingested: bool
    counts: dict[str, int]  # request status -> requests

    @property
    def num_total(self) -> int:
        return sum(self.counts.values())

    @property
    def num_finished(self) -> int:
        return sum(n for s, n in self.counts.items() if RequestStatus(s).is_terminal)


@dataclass(frozen=True)
class LiveWorker:
    name: str
    serving_config_name: str
    config_hash: str
    device: str
    hardware: str
    started_at: datetime
    heartbeat_at: datetime
    seconds_since_heartbeat: float
    kernel: str | None = None  # the decoder and kernels serving its weights, as it registered them
    decoder_reason: str | None = None  # why transformers' forward serves its model, and the cost; None: servelab's


@dataclass(frozen=True)
class Failure:
    request_id: str
    serving_config_name: str
    finished_at: datetime | None
    num_attempts: int
    reason: str


# --- runs ---

def list_runs(session: Session, *, workload_fingerprint: str | None = None, limit: int = 1000) -> list[RunListing]:
    """Newest first; the per-passage quality arrays stay in the database (only the accuracy is read)."""
    summary = RunRow.summary
    query = (
        select(RunRow.id, RunRow.serving_config_name, RunRow.config_hash, RunRow.workload_name,
               RunRow.workload_fingerprint, RunRow.plan_name, RunRow.repeat_index, RunRow.started_at, RunRow.config,
               RunRow.hardware, cast(summary["num_requests"].astext, Integer),
               cast(summary["num_succeeded"].astext, Integer), cast(summary["output_tokens_per_s"].astext, Float),
               cast(summary["latency"]["ttft_ms"]["p95"].astext, Float),
               cast(summary["latency"]["tpot_ms"]["p95"].astext, Float),
               cast(RunRow.quality["accuracy"]["value"].astext, Float),
               cast(summary["latency"]["queue_ms"]["p95"].astext, Float),
               cast(summary["mean_batch_size"].astext, Float), cast(summary["num_preempted"].astext, Integer),
               cast(RunRow.hardware["kv_pool_blocks"].astext, Integer))
        .order_by(RunRow.started_at.desc()).limit(limit)
    )
    if workload_fingerprint is not None:
        query = query.where(RunRow.workload_fingerprint == workload_fingerprint)
    return [RunListing(str(r[0]), r[1], r[2], r[3], r[4], r[5], r[6], r[7], describe_settings(r[8], r[9]),
                       hardware_summary(r[9]), *r[10:]) for r in session.execute(query)]


def hardware_summary(hardware: dict[str, Any]) -> str:
    gpu = hardware.get("gpu")
    device = hardware.get("device", "?")
    what = gpu if gpu else f"{hardware.get('cpu', '?')} ({hardware.get('num_cpus', '?')} CPUs)"
    return f"{device}: {what}"


def result_texts(session: Session, *, run_id: str) -> dict[int, str]:
    rows = session.execute(
        select(RunRequestRow.item_index, ResultRow.text)
        .join(ResultRow, ResultRow.request_id == RunRequestRow.request_id)
        .where(RunRequestRow.run_id == uuid.UUID(run_id))
    ).all()
    return dict(rows)


def latest_comparison_runs(session: Session) -> tuple[list[str], list[str]] | None:
    """(baseline run ids, candidate run ids) of the newest stored comparison, for the front page's first view."""
    row = session.execute(select(ComparisonRow.baseline_run_ids, ComparisonRow.candidate_run_ids)
                          .order_by(ComparisonRow.created_at.desc()).limit(1)).first()
    return None if row is None else ([str(i) for i in row[0]], [str(i) for i in row[1]])


# --- the KV cache ---

def batch_points(session: Session, *, run_ids: list[str]) -> list[BatchPoint]:
    """Every batch that served a request of these runs, with the retained tokens at its KV peak.

    NOTE: retained tokens are stored with each batch (kv_cache_tokens); for batches stored before they
    were, they are rebuilt from the batch's shape (peak_retained_tokens).
    """
    served = (select(RunRequestRow.run_id, RequestMetricsRow.batch_id)
              .join(RequestMetricsRow, RequestMetricsRow.request_id == RunRequestRow.request_id)
              .where(RunRequestRow.run_id.in_([uuid.UUID(i) for i in run_ids])).distinct().subquery())
    rows = session.execute(
        select(served.c.run_id, RunRow.serving_config_name, RunRow.config["weights"].astext,
               RunRow.config["kv_cache_dtype"].astext, BatchRow.num_requests, BatchRow.kv_cache_bytes,
               BatchRow.num_rows_per_step, BatchRow.num_prefill_tokens, BatchRow.weight_bytes,
               BatchRow.peak_working_bytes, BatchRow.kv_cache_tokens, BatchRow.num_prefix_query_tokens,
               BatchRow.num_prefix_hit_tokens, BatchRow.kv_block_size, BatchRow.kv_blocks_shared,
               BatchRow.kv_blocks_private, BatchRow.num_preempted)
        .join(BatchRow, BatchRow.id == served.c.batch_id).join(RunRow, RunRow.id == served.c.run_id)
        .order_by(RunRow.serving_config_name, BatchRow.started_at)
    ).all()
    return [BatchPoint(str(run_id), name, weights or "-", kv or "-", num, kv_bytes,
                       tokens if tokens is not None else peak_retained_tokens(steps, prefill), wb, work, *cache)
            for run_id, name, weights, kv, num, kv_bytes, steps, prefill, wb, work, tokens, *cache in rows]


def peak_retained_tokens(num_rows_per_step: list[int], num_prefill_tokens: int) -> int:
    """A closed batch stored before retained tokens were: after step s (0 = the prefill) the cache held
    rows_s x (padded prompt length + s) tokens; an upper bound once a finished row's padding was trimmed."""
    if not num_rows_per_step or num_rows_per_step[0] == 0:
        return 0
    prompt_len = num_prefill_tokens // num_rows_per_step[0]
    return max(rows * (prompt_len + step) for step, rows in enumerate(num_rows_per_step))


def kv_bytes_per_token(points: list[BatchPoint]) -> float | None:
    """Least-squares slope through the origin of stored KV bytes against retained tokens (one config)."""
    num = sum(p.kv_cache_bytes * p.retained_tokens for p in points)
    den = sum(p.retained_tokens ** 2 for p in points)
    return num / den if den else None


def request_tokens(session: Session, *, run_ids: list[str]) -> list[RequestTokens]:
    rows = session.execute(
        select(RunRequestRow.run_id, RunRow.serving_config_name, ResultRow.num_prompt_tokens,
               ResultRow.num_generated_tokens)
        .join(ResultRow, ResultRow.request_id == RunRequestRow.request_id)
        .join(RunRow, RunRow.id == RunRequestRow.run_id)
        .where(RunRequestRow.run_id.in_([uuid.UUID(i) for i in run_ids]))
        .order_by(RunRequestRow.run_id, RunRequestRow.item_index)
    ).all()
    return [RequestTokens(str(run_id), name, p, g) for run_id, name, p, g in rows]


# --- sweeps ---

def list_sweeps(session: Session, *, limit: int = 50) -> list[SweepListing]:
    rows = session.execute(select(SweepRow.id, SweepRow.created_at, SweepRow.hardware, SweepRow.report)
                           .order_by(SweepRow.created_at.desc()).limit(limit)).all()
    return [SweepListing(str(i), created, hardware or {}, report or {}) for i, created, hardware, report in rows]


def sweep_points(report: dict[str, Any]) -> list[StoredSweepPoint]:
    """The report's points (servelab/analysis/roofline.py's SweepReport.as_dict()); a figure a point lacks is None."""
    points = [StoredSweepPoint(
        config=str(p.get("config") or "?"), weights=str(p.get("weights") or "?"), batch_size=int(p["batch_size"]),
        decode_tokens_per_s=_number(p.get("decode_tokens_per_s")), tpot_ms=_number(p.get("tpot_ms")),
        bandwidth_roofline_tokens_per_s=_number(p.get("bandwidth_roofline_tokens_per_s")),
        compute_roofline_tokens_per_s=_number(p.get("compute_roofline_tokens_per_s")),
    ) for p in report.get("points") or [] if isinstance(p, dict) and p.get("batch_size") is not None]
    return sorted(points, key=lambda p: (p.config, p.batch_size))


def sweep_crossovers(report: dict[str, Any]) -> list[Crossover]:
    """The report's crossovers (candidate config -> the batch size from which it no longer beats the baseline;
    None: it never stops paying in the sizes swept)."""
    baseline = report.get("baseline") or "the baseline"
    return [Crossover(f"{name} stops paying against {baseline}", float(size))
            for name, size in (report.get("crossovers") or {}).items() if _number(size) is not None]


def _number(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


# --- jobs, queues, workers, failures ---

def job_progress(session: Session, *, limit: int = 50) -> list[JobProgress]:
    """The newest batch jobs with their requests counted by status (one grouped query over those jobs)."""
    jobs = session.execute(select(BatchJobRow.id, BatchJobRow.tenant, BatchJobRow.status, BatchJobRow.created_at,
                                  BatchJobRow.num_lines, BatchJobRow.is_ingested)
                           .order_by(BatchJobRow.created_at.desc()).limit(limit)).all()
    counts: dict[uuid.UUID, dict[str, int]] = defaultdict(dict)
    if jobs:
        for job_id, status, n in session.execute(
                select(RequestRow.batch_job_id, RequestRow.status, func.count())
                .where(RequestRow.batch_job_id.in_([j.id for j in jobs]))
                .group_by(RequestRow.batch_job_id, RequestRow.status)):
            counts[job_id][status.value] = n
    return [JobProgress(str(j.id), j.tenant, j.status.value, j.created_at, j.num_lines, j.is_ingested,
                        counts.get(j.id, {})) for j in jobs]


def request_status_counts(session: Session) -> dict[str, dict[str, int]]:
    """serving config name -> request status -> requests, over every request stored."""
    table: dict[str, dict[str, int]] = defaultdict(dict)
    for name, status, n in session.execute(select(RequestRow.serving_config_name, RequestRow.status, func.count())
                                           .group_by(RequestRow.serving_config_name, RequestRow.status)):
        table[name][status.value] = n
    return dict(table)


def unfinished_config_names(session: Session) -> list[str]:
    """Configs with queued or running requests (the index on (status, config) answers this)."""
    return list(session.scalars(select(RequestRow.serving_config_name).distinct().where(
        RequestRow.status.in_([RequestStatus.QUEUED, RequestStatus.RUNNING]))))


def workers(session: Session, *, now: datetime, limit: int = 200) -> list[LiveWorker]:
    rows = session.execute(select(WorkerRow).order_by(WorkerRow.heartbeat_at.desc()).limit(limit)).scalars().all()
    return [LiveWorker(w.name, w.serving_config_name, w.config_hash, str(w.hardware.get("device", "?")),
                       hardware_summary(w.hardware), w.started_at, w.heartbeat_at,
                       (now - w.heartbeat_at).total_seconds(), w.hardware.get("kernel"),
                       w.hardware.get("decoder_reason")) for w in rows]


def recent_failures(session: Session, *, limit: int = 50) -> list[Failure]:
    rows = session.execute(
        select(RequestRow.id, RequestRow.serving_config_name, RequestRow.finished_at, RequestRow.num_attempts,
               RequestRow.error)
        .where(RequestRow.status == RequestStatus.FAILED)
        .order_by(RequestRow.finished_at.desc().nulls_last()).limit(limit)
    ).all()
    return [Failure(str(i), name, at, n, error or "(no reason stored)") for i, name, at, n, error in rows]


def run_configs(session: Session, *, run_ids: list[str]) -> dict[str, tuple[str, str]]:
    """run id -> (config name, workload fingerprint), to group a selection into one RunSet per config."""
    rows = session.execute(select(RunRow.id, RunRow.serving_config_name, RunRow.workload_fingerprint)
                           .where(RunRow.id.in_([uuid.UUID(i) for i in run_ids]))).all()
    return {str(i): (name, fp) for i, name, fp in rows}
