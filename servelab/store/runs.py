"""Store functions of the lab: runs and the requests they sent, their samples, comparisons and sweeps.

Takes a session, never commits. Reads the per-request measurements a run's figures are computed
from (request timestamps, metrics, results, batches), so every stored figure traces to its requests.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from servelab.lab.metrics import BatchSample, RequestSample
from servelab.store.models import (
    BatchRow,
    ComparisonRow,
    RequestMetricsRow,
    RequestRow,
    RequestStatus,
    ResultRow,
    RunRequestRow,
    RunRow,
    SweepRow,
)


@dataclass(frozen=True)
class StoredRun:
    id: str
    serving_config_name: str
    config: dict[str, Any]
    workload_name: str
    workload_fingerprint: str
    hardware: dict[str, Any]
    plan_name: str | None
    repeat_index: int
    started_at: datetime
    summary: dict[str, Any]
    quality: dict[str, Any] | None


def record_run(session: Session, *, config: dict[str, Any], config_hash: str, workload_name: str,
               workload_fingerprint: str, workload: dict[str, Any], hardware: dict[str, Any],
               software: dict[str, Any], worker_name: str, started_at: datetime, finished_at: datetime,
               summary: dict[str, Any], sent: list[tuple[str, int, float | None]], plan_name: str | None = None,
               repeat_index: int = 0, quality: dict[str, Any] | None = None) -> str:
    """sent: (request id, workload item index, scheduled offset in ms) for every request the run sent."""
    run_id = uuid.uuid4()
    session.add(RunRow(
        id=run_id, serving_config_name=config["name"], config_hash=config_hash, config=config,
        workload_name=workload_name, workload_fingerprint=workload_fingerprint, workload=workload,
        hardware=hardware, software=software, worker_name=worker_name, plan_name=plan_name,
        repeat_index=repeat_index, started_at=started_at, finished_at=finished_at, summary=summary, quality=quality,
    ))
    session.flush()
    session.add_all(RunRequestRow(run_id=run_id, request_id=uuid.UUID(rid), item_index=index, scheduled_offset_ms=offset)
                    for rid, index, offset in sent)
    return str(run_id)


def request_samples(session: Session, *, request_ids: list[str]) -> list[RequestSample]:
    rows = session.execute(
        select(RequestRow, RequestMetricsRow, ResultRow.num_generated_tokens)
        .outerjoin(RequestMetricsRow, RequestMetricsRow.request_id == RequestRow.id)
        .outerjoin(ResultRow, ResultRow.request_id == RequestRow.id)
        .where(RequestRow.id.in_([uuid.UUID(i) for i in request_ids]))
    ).all()
    return [_sample(request, metrics, num_tokens) for request, metrics, num_tokens in rows]


def _sample(request: RequestRow, metrics: RequestMetricsRow | None, num_tokens: int | None) -> RequestSample:
    def since_submit_ms(moment: datetime | None) -> float | None:
        return None if moment is None else (moment - request.enqueued_at).total_seconds() * 1e3

    return RequestSample(
        request_id=str(request.id), is_success=request.status is RequestStatus.SUCCEEDED,
        submitted_at=request.enqueued_at, finished_at=request.finished_at, num_output_tokens=num_tokens or 0,
        queue_ms=metrics.queue_ms if metrics else None, ttft_ms=since_submit_ms(request.first_token_at),
        tpot_ms=metrics.tpot_ms if metrics else None, e2el_ms=since_submit_ms(request.finished_at),
        itl_ms=tuple(metrics.itl_ms) if metrics else (),
    )


def batch_samples(session: Session, *, request_ids: list[str]) -> list[BatchSample]:
    batch_ids = select(RequestMetricsRow.batch_id).where(
        RequestMetricsRow.request_id.in_([uuid.UUID(i) for i in request_ids])).distinct()
    rows = session.scalars(select(BatchRow).where(BatchRow.id.in_(batch_ids))).all()
    return [BatchSample(b.num_requests, b.weight_bytes, b.kv_cache_bytes, b.peak_working_bytes) for b in rows]


def run_request_ids(session: Session, *, run_id: str) -> list[tuple[str, int]]:
    """(request id, workload item index) of every request the run sent, in item order."""
    rows = session.execute(select(RunRequestRow.request_id, RunRequestRow.item_index)
                           .where(RunRequestRow.run_id == uuid.UUID(run_id)).order_by(RunRequestRow.item_index)).all()
    return [(str(r), i) for r, i in rows]


def result_texts(session: Session, *, run_id: str) -> dict[int, str]:
    """Workload item index -> generated text, for comparing greedy outputs across runs."""
    rows = session.execute(
        select(RunRequestRow.item_index, ResultRow.text)
        .join(ResultRow, ResultRow.request_id == RunRequestRow.request_id)
        .where(RunRequestRow.run_id == uuid.UUID(run_id))
    ).all()
    return dict(rows)


def load_runs(session: Session, *, run_ids: list[str]) -> list[StoredRun]:
    rows = session.scalars(select(RunRow).where(RunRow.id.in_([uuid.UUID(i) for i in run_ids]))).all()
    by_id = {str(r.id): r for r in rows}
    missing = [i for i in run_ids if i not in by_id]
    if missing:
        raise LookupError(f"no such run: {', '.join(missing)}")
    return [_stored_run(by_id[i]) for i in run_ids]


def _stored_run(r: RunRow) -> StoredRun:
    return StoredRun(str(r.id), r.serving_config_name, r.config, r.workload_name, r.workload_fingerprint, r.hardware,
                     r.plan_name, r.repeat_index, r.started_at, r.summary, r.quality)


def set_run_quality(session: Session, *, run_id: str, quality: dict[str, Any]) -> None:
    session.get(RunRow, uuid.UUID(run_id)).quality = quality


def save_comparison(session: Session, *, plan_name: str, plan: dict[str, Any], baseline_run_ids: list[str],
                    candidate_run_ids: list[str], report: dict[str, Any]) -> str:
    row = ComparisonRow(id=uuid.uuid4(), plan_name=plan_name, plan=plan, report=json_safe(report),
                        baseline_run_ids=[uuid.UUID(i) for i in baseline_run_ids],
                        candidate_run_ids=[uuid.UUID(i) for i in candidate_run_ids])
    session.add(row)
    session.flush()
    return str(row.id)


def json_safe(value: Any) -> Any:
    """NaN and infinities (a figure that could not be measured) as null: JSONB has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def save_sweep(session: Session, *, report: dict[str, Any], hardware: dict[str, Any]) -> str:
    row = SweepRow(id=uuid.uuid4(), report=json_safe(report), hardware=json_safe(hardware))
    session.add(row)
    session.flush()
    return str(row.id)
