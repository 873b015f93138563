"""Store functions the API adds to the data plane's: admit a request under its tenant's queue limit, and
read one request of a tenant with its result and timings.

Knows that admission is serialised per tenant (an advisory lock), so the limit holds under concurrent
posts. Does not know HTTP. Functions take a session and never commit; the caller commits, then enqueues.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from servelab.request import FinishReason, SamplingParams
from servelab.store import keys
from servelab.store.models import RequestMetricsRow, RequestRow, RequestStatus, ResultRow, StreamKind
from servelab.store.requests import create_request


class QueueFull(Exception):
    """The tenant has its limit of queued requests; the message says how many."""


@dataclass(frozen=True)
class RequestView:
    id: str
    tenant: str
    serving_config_name: str
    status: RequestStatus
    priority: int
    enqueued_at: datetime
    started_at: datetime | None
    first_token_at: datetime | None
    finished_at: datetime | None
    finish_reason: FinishReason | None
    error: str | None
    text: str | None
    num_prompt_tokens: int | None
    num_generated_tokens: int | None
    timings_ms: dict[str, float | None] | None  # queue_ms, ttft_ms, tpot_ms, e2e_ms


def admit_request(session: Session, *, tenant: str, max_queued: int, serving_config_name: str, kind: StreamKind,
                  prompt: str | None, messages: list[dict[str, Any]] | None, sampling: SamplingParams,
                  priority: int = 0) -> str:
    keys.lock_tenant(session, tenant)
    num_queued = keys.num_queued_requests(session, tenant)
    if num_queued >= max_queued:
        raise QueueFull(f"tenant {tenant!r} has {num_queued} queued requests, the limit is {max_queued}; "
                        "wait for some to finish, or use the Batch API for bulk work")
    return create_request(session, serving_config_name=serving_config_name, stream=kind, prompt=prompt,
                          messages=messages, sampling=sampling, tenant=tenant, priority=priority)


def get_request_view(session: Session, *, request_id: str, tenant: str) -> RequestView | None:
    try:
        key = uuid.UUID(request_id)
    except ValueError:
        return None
    row = session.execute(
        select(RequestRow, ResultRow, RequestMetricsRow)
        .outerjoin(ResultRow, ResultRow.request_id == RequestRow.id)
        .outerjoin(RequestMetricsRow, RequestMetricsRow.request_id == RequestRow.id)
        .where(RequestRow.id == key, RequestRow.tenant == tenant)
    ).first()
    if row is None:
        return None
    r, result, m = row
    timings = None if m is None else {"queue_ms": m.queue_ms, "ttft_ms": m.ttft_ms, "tpot_ms": m.tpot_ms,
                                      "e2e_ms": m.e2e_ms}
    return RequestView(
        str(r.id), r.tenant, r.serving_config_name, r.status, r.priority, r.enqueued_at, r.started_at,
        r.first_token_at, r.finished_at, r.finish_reason, r.error, result.text if result else None,
        result.num_prompt_tokens if result else None, result.num_generated_tokens if result else None, timings,
    )


@dataclass(frozen=True)
class LatencyHistogram:
    """Cumulative counts at each upper bound (ms), their number and sum, as Prometheus histograms want."""

    name: str
    bucket_counts: tuple[tuple[float, int], ...]
    count: int
    sum_ms: float


@dataclass(frozen=True)
class ServingStats:
    num_requests_by_status: dict[str, int]
    num_generated_tokens: int
    histograms: tuple[LatencyHistogram, ...]


def serving_stats(session: Session, *, bounds_ms: tuple[float, ...]) -> ServingStats:
    """Totals over every request stored: counts by status, tokens generated, TTFT / TPOT / E2E histograms.

    NOTE: computed at scrape time from Postgres, so every API replica reports the same totals.
    """
    from sqlalchemy import func

    by_status = {s.value: 0 for s in RequestStatus}
    for status, n in session.execute(select(RequestRow.status, func.count()).group_by(RequestRow.status)):
        by_status[status.value] = n
    tokens = session.scalar(select(func.coalesce(func.sum(ResultRow.num_generated_tokens), 0)))
    histograms = []
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        column = getattr(RequestMetricsRow, name)
        row = session.execute(select(
            *(func.count().filter(column <= b) for b in bounds_ms), func.count(column), func.coalesce(func.sum(column), 0.0)
        )).one()
        histograms.append(LatencyHistogram(name, tuple(zip(bounds_ms, row[:-2])), row[-2], float(row[-1])))
    return ServingStats(by_status, int(tokens), tuple(histograms))
