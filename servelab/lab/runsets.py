"""The lab's reading of stored runs: the run set a verdict judges (its samples, quality and texts), the
limits a comparison was stored with (or the defaults a page starts from), and the one place a request row
becomes a RequestSample.

Read-only SQL over the store's tables, torch-free (the dashboard uses it too). Does not know how runs are
made (runner.py) nor how a verdict is reached (servelab/analysis/verdict.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from servelab.analysis.metrics import BatchSample, RequestSample
from servelab.analysis.verdict import GainGoal, LatencyLimit, Limits, QualityOutcome, RunSet
from servelab.request import RequestStatus
from servelab.store import queries
from servelab.store.models import BatchRow, ComparisonRow, RequestMetricsRow, RequestRow, ResultRow, RunRequestRow, RunRow

# NOTE: what a page shows when the runs belong to no stored comparison: said on the page, editable there,
# never written back. One latency limit and one gain goal, the shape of the plans in plans/.
DEFAULT_LIMITS = Limits(
    max_accuracy_drop=0.05,
    latency=(LatencyLimit(metric="tpot_ms", percentile=95, max_ratio=1.2),),
    gains=(GainGoal(metric="output_tokens_per_s", min_ratio=1.1),),
)

@dataclass(frozen=True)
class StoredLimits:
    """The limits a comparison is judged by, and where they came from."""

    limits: Limits
    source: str  # "plan <name> (comparison <id>)" or "defaults"
    plan_name: str | None = None
    rank_by: str | None = None  # the plan's ranking figure (null: its first gain's)
    sequential: dict[str, Any] | None = None  # run until settled: its stored record (looks, each look's criteria)


def load_run_set(session: Session, *, run_ids: list[str]) -> RunSet:
    """The repeats of one config on one workload: what the verdict judges (the lab and the dashboard alike).

    NOTE: torch-free, so the dashboard can use it; the samples are read in one query over run_requests.
    """
    ids = [uuid.UUID(i) for i in run_ids]
    rows = session.execute(
        select(RunRow.id, RunRow.serving_config_name, RunRow.config, RunRow.workload_fingerprint, RunRow.hardware,
               RunRow.summary, RunRow.quality, RunRow.repeat_index).where(RunRow.id.in_(ids))
    ).all()
    by_id = {str(r.id): r for r in rows}
    missing = [i for i in run_ids if i not in by_id]
    if missing:
        raise LookupError(f"no such run: {', '.join(missing)}")
    runs = [by_id[i] for i in run_ids]
    names, prints = {r.serving_config_name for r in runs}, {r.workload_fingerprint for r in runs}
    if len(names) != 1 or len(prints) != 1:
        raise ValueError(f"the runs of one side must share a config and a workload, got {names} / {prints}")
    first = runs[0]
    return RunSet(
        name=first.serving_config_name, run_ids=tuple(run_ids), config=first.config,
        workload_fingerprint=first.workload_fingerprint, hardware=first.hardware,
        summaries=tuple(r.summary for r in runs), samples=samples_by_run(session, run_ids=run_ids),
        repeat_indices=tuple(r.repeat_index for r in runs), quality=quality_outcome(first.quality),
        long_context=(first.quality or {}).get("long_context"),
        texts=queries.result_texts(session, run_id=run_ids[0]),
    )


def quality_outcome(quality: dict[str, Any] | None) -> QualityOutcome | None:
    if not quality or "correct" not in quality:
        return None
    return QualityOutcome(tuple(quality["passage_ids"]), tuple(quality["correct"]), tuple(quality["nll"]),
                          tuple(quality["num_target_tokens"]))


def samples_by_run(session: Session, *, run_ids: list[str]) -> tuple[tuple[RequestSample, ...], ...]:
    """Every request each run sent, timed as the client saw it (from submission), run by run in run_ids' order."""
    ids = [uuid.UUID(i) for i in run_ids]
    run_of = {str(request_id): str(run_id) for run_id, request_id in session.execute(
        select(RunRequestRow.run_id, RunRequestRow.request_id).where(RunRequestRow.run_id.in_(ids))).all()}
    sent = select(RunRequestRow.request_id).where(RunRequestRow.run_id.in_(ids))
    grouped: dict[str, list[RequestSample]] = {i: [] for i in run_ids}
    for sample in samples_where(session, RequestRow.id.in_(sent)):
        grouped[run_of[sample.request_id]].append(sample)
    return tuple(tuple(grouped[i]) for i in run_ids)


def samples_where(session: Session, condition) -> list[RequestSample]:
    """RequestSamples of the requests matching `condition`: the one place a request becomes a sample."""
    r, m = RequestRow, RequestMetricsRow
    rows = session.execute(
        select(r.id, r.status, r.enqueued_at, r.finished_at, ResultRow.num_generated_tokens, m.queue_ms,
               _ms_between(r.enqueued_at, r.first_token_at), m.tpot_ms, _ms_between(r.enqueued_at, r.finished_at),
               m.itl_ms)
        .outerjoin(m, m.request_id == r.id)
        .outerjoin(ResultRow, ResultRow.request_id == r.id)
        .where(condition)
        .order_by(r.enqueued_at, r.id)
    ).all()
    return [RequestSample(str(i), status is RequestStatus.SUCCEEDED, submitted, finished, tokens or 0, queue_ms,
                          None if ttft is None else float(ttft), tpot, None if e2el is None else float(e2el),
                          tuple(itl or ()))
            for i, status, submitted, finished, tokens, queue_ms, ttft, tpot, e2el, itl in rows]


def _ms_between(start, end):
    return func.extract("epoch", end - start) * 1000.0


def request_samples(session: Session, *, request_ids: list[str]) -> list[RequestSample]:
    return samples_where(session, RequestRow.id.in_([uuid.UUID(i) for i in request_ids]))


def batch_samples(session: Session, *, request_ids: list[str]) -> list[BatchSample]:
    batch_ids = select(RequestMetricsRow.batch_id).where(
        RequestMetricsRow.request_id.in_([uuid.UUID(i) for i in request_ids])).distinct()
    rows = session.scalars(select(BatchRow).where(BatchRow.id.in_(batch_ids))).all()
    return [BatchSample(b.num_requests, b.weight_bytes, b.kv_cache_bytes, b.peak_working_bytes,
                        tuple(b.num_rows_per_step), b.num_prefix_query_tokens, b.num_prefix_hit_tokens,
                        b.kv_block_size, b.kv_blocks_shared, b.kv_blocks_private, b.num_preempted) for b in rows]


def stored_limits(session: Session, *, baseline_run_ids: list[str], candidate_run_ids: list[str]) -> StoredLimits:
    """The limits of the newest stored comparison that holds all these runs on the same sides; else the defaults."""
    row = session.execute(
        select(ComparisonRow.id, ComparisonRow.plan_name, ComparisonRow.plan, ComparisonRow.report["sequential"])
        .where(ComparisonRow.baseline_run_ids.contains([uuid.UUID(i) for i in baseline_run_ids]),
               ComparisonRow.candidate_run_ids.contains([uuid.UUID(i) for i in candidate_run_ids]))
        .order_by(ComparisonRow.created_at.desc()).limit(1)
    ).first()
    if row is None or "limits" not in (row.plan or {}):
        return StoredLimits(DEFAULT_LIMITS, "defaults")
    return StoredLimits(Limits.model_validate(row.plan["limits"]), f"plan {row.plan_name} (comparison {row.id})",
                        row.plan_name, row.plan.get("rank_by"), row[3])
