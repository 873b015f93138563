"""Store functions of the lab: runs and the requests they sent, comparisons and sweeps (rows only: the lab turns
them into samples, servelab.lab.runsets).

Takes a session, never commits. Reads the per-request measurements a run's figures are computed
from (request timestamps, metrics, results, batches), so every stored figure traces to its requests.
"""

from __future__ import annotations

import math
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from servelab.store.models import ComparisonRow, RunRequestRow, RunRow, SweepRow


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
