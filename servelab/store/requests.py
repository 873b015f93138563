"""Store functions of a request's life: create or admit (under its tenant's queue limit), load, claim and
finish it, read it back with its result and timings; record batches and workers.

Every function takes a session and never commits: the caller owns the transaction (it commits, then
enqueues). Claims and finishes are conditional updates and results insert with their unique key, so a
request that is delivered twice is still finished exactly once. Admission under a tenant's queue limit is
store/admission.py's. Knows rows; hands frozen dataclasses on.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from servelab.config import ServingConfig
from servelab.outputs import BatchResult, Completion
from servelab.request import ChatMessage, FinishReason, GenerationRequest, RequestError, SamplingParams
from servelab.store.models import (
    BatchRow,
    RequestMetricsRow,
    RequestRow,
    RequestStatus,
    ResultRow,
    ServingConfigRow,
    StreamKind,
    StreamMetricsRow,
    WorkerRow,
)

UNFINISHED = (RequestStatus.QUEUED, RequestStatus.RUNNING)
CANCELLED_BY_CLIENT = "cancelled: the client disconnected"


@dataclass(frozen=True)
class StoredRequest:
    """What a worker needs of a request row to serve it."""

    id: str
    serving_config_name: str
    status: RequestStatus
    prompt: str | None
    messages: list[dict[str, Any]] | None
    sampling: dict[str, Any]  # as stored: the worker reads it with SamplingParams.from_stored
    num_attempts: int
    enqueued_at: datetime
    priority: int = 0

    def generation_request(self) -> GenerationRequest:
        """The engine's view of the stored request; stored fields it cannot read are a RequestError."""
        try:
            params = SamplingParams.from_stored(self.sampling)
            messages = tuple(ChatMessage(m["role"], m["content"]) for m in self.messages) if self.messages else None
            return GenerationRequest(self.id, prompt=self.prompt, messages=messages, params=params)
        except (TypeError, KeyError, AssertionError) as exc:
            raise RequestError(f"stored request cannot be read: {exc}") from None


def create_request(
    session: Session, *, serving_config_name: str, stream: StreamKind, prompt: str | None = None,
    messages: list[dict[str, Any]] | None = None, sampling: SamplingParams | None = None,
    tenant: str = "default", priority: int = 0, batch_job_id: uuid.UUID | None = None,
    custom_id: str | None = None, request_id: uuid.UUID | None = None, first_choice_id: uuid.UUID | None = None,
    choice_index: int = 0,
) -> str:
    row = RequestRow(
        id=request_id or uuid.uuid4(), serving_config_name=serving_config_name, stream=stream, prompt=prompt,
        messages=messages, sampling=(sampling or SamplingParams()).to_stored(), tenant=tenant, priority=priority,
        batch_job_id=batch_job_id, custom_id=custom_id, first_choice_id=first_choice_id, choice_index=choice_index,
    )
    session.add(row)
    session.flush()
    return str(row.id)


def load_requests(session: Session, ids: list[str]) -> dict[str, StoredRequest]:
    rows = session.scalars(select(RequestRow).where(RequestRow.id.in_(_uuids(ids)))).all()
    return {
        str(r.id): StoredRequest(str(r.id), r.serving_config_name, r.status, r.prompt, r.messages, r.sampling,
                                 r.num_attempts, r.enqueued_at, r.priority)
        for r in rows
    }


def claim_requests(session: Session, *, ids: list[str], now: datetime) -> dict[str, int]:
    """Mark unfinished requests running and count this execution; -> {id: started executions}.

    NOTE: 'running' rows are claimable too: after a crash the stream hands the entry to a new owner,
    and the stream (not this row) says who owns it. Finished rows are left alone and not returned.
    """
    if not ids:
        return {}
    result = session.execute(
        update(RequestRow)
        .where(RequestRow.id.in_(_uuids(ids)), RequestRow.status.in_(UNFINISHED))
        .values(status=RequestStatus.RUNNING, num_attempts=RequestRow.num_attempts + 1, started_at=now)
        .returning(RequestRow.id, RequestRow.num_attempts)
    )
    return {str(request_id): attempts for request_id, attempts in result.all()}


def fail_requests(session: Session, *, ids: list[str], reason: str, now: datetime) -> list[str]:
    """Fail unfinished requests with a reason; -> the ids that were failed now."""
    if not ids:
        return []
    result = session.execute(
        update(RequestRow)
        .where(RequestRow.id.in_(_uuids(ids)), RequestRow.status.in_(UNFINISHED))
        .values(status=RequestStatus.FAILED, finish_reason=FinishReason.ERROR, error=reason, finished_at=now)
        .returning(RequestRow.id)
    )
    return [str(i) for (i,) in result.all()]


def record_batch(
    session: Session, *, batch_id: uuid.UUID, worker_name: str, serving_config_name: str, config_hash: str,
    result: BatchResult, enqueued_at: dict[str, datetime],
) -> set[str]:
    """Write the batch record (the engine steps since the last record), every finished request's result
    and metrics, and finish the request rows; -> the ids whose outcome this record wrote (not those that had
    finished elsewhere: a duplicate run, a cancel). Repeating it with the same batch_id changes nothing (a
    retry after a commit whose answer was lost)."""
    t, m = result.timings, result.memory
    started_at, finished_at = _utc(t.started_at_s), _utc(t.finished_at_s)
    session.execute(insert(BatchRow).values(
        id=batch_id, worker_name=worker_name, serving_config_name=serving_config_name, config_hash=config_hash,
        num_requests=len(result.completions), num_rows_per_step=list(t.num_rows_per_step),
        prefill_ms=t.prefill_ms, decode_ms=t.decode_ms, num_prefill_tokens=t.num_prefill_tokens,
        num_decode_tokens=t.num_decode_tokens, device=m.device, weight_bytes=m.weight_bytes,
        kv_cache_bytes=m.kv_cache_bytes, kv_cache_allocated_bytes=m.kv_cache_allocated_bytes,
        peak_working_bytes=m.peak_working_bytes, peak_process_bytes=m.peak_process_bytes,
        kv_cache_tokens=m.kv_cache_tokens, num_preempted=t.num_preempted,
        num_prefix_query_tokens=t.num_prefix_query_tokens, num_prefix_hit_tokens=t.num_prefix_hit_tokens,
        kv_block_size=m.kv_block_size, kv_blocks_shared=m.kv_blocks_shared, kv_blocks_private=m.kv_blocks_private,
        started_at=started_at, finished_at=finished_at,
    ).on_conflict_do_nothing(index_elements=["id"]))
    return {c.request_id for c in result.completions
            if _finish(session, c, batch_id=batch_id, started_at=_utc(c.started_at_s or t.finished_at_s),
                       enqueued_at=enqueued_at[c.request_id])}


def _utc(unix_s: float) -> datetime:
    return datetime.fromtimestamp(unix_s, UTC)


def count_preemptions(session: Session, *, ids: list[str]) -> None:
    """These running requests left their batch unfinished and wait to start over."""
    session.execute(update(RequestRow).where(RequestRow.id.in_(_uuids(ids)))
                    .values(num_preemptions=RequestRow.num_preemptions + 1))


def _finish(session: Session, c: Completion, *, batch_id: uuid.UUID, started_at: datetime,
            enqueued_at: datetime) -> bool:
    finished_at = started_at + timedelta(milliseconds=c.e2e_ms or 0.0)
    is_error = c.finish_reason is FinishReason.ERROR
    first_token_at = None if c.ttft_ms is None else started_at + timedelta(milliseconds=c.ttft_ms)
    if c.finish_reason is FinishReason.CANCELLED:
        # NOTE: its client cancelled it (the row already says so): keep the partial text and the figures
        where = RequestRow.status.in_((RequestStatus.RUNNING, RequestStatus.CANCELLED))
        values = dict(status=RequestStatus.CANCELLED, finish_reason=FinishReason.CANCELLED,
                      error=func.coalesce(RequestRow.error, CANCELLED_BY_CLIENT))
    else:
        where = RequestRow.status == RequestStatus.RUNNING
        values = dict(status=RequestStatus.FAILED if is_error else RequestStatus.SUCCEEDED,
                      finish_reason=c.finish_reason, error=c.error, finished_at=finished_at)
    updated = session.execute(
        update(RequestRow).where(RequestRow.id == uuid.UUID(c.request_id), where)
        .values(**values, first_token_at=first_token_at).returning(RequestRow.id)
    ).first()
    if updated is None and not is_error:  # NOTE: its client left during the last step: cancelled, its text kept
        updated = session.execute(
            update(RequestRow).where(RequestRow.id == uuid.UUID(c.request_id),
                                     RequestRow.status == RequestStatus.CANCELLED,
                                     RequestRow.error == CANCELLED_BY_CLIENT)
            .values(first_token_at=first_token_at).returning(RequestRow.id)
        ).first()
    if updated is None or is_error:
        return updated is not None  # NOTE: finished elsewhere (cancelled, or a duplicate run): the first outcome stands
    session.execute(insert(ResultRow).values(
        request_id=uuid.UUID(c.request_id), text=c.text, num_prompt_tokens=c.num_prompt_tokens,
        num_generated_tokens=c.num_generated_tokens, token_ids=list(c.token_ids),
        logprobs=None if c.logprobs is None else [t.to_stored() for t in c.logprobs],
        num_cached_tokens=c.num_cached_tokens,
    ).on_conflict_do_nothing(index_elements=["request_id"]))
    session.execute(insert(RequestMetricsRow).values(
        request_id=uuid.UUID(c.request_id), batch_id=batch_id,
        queue_ms=max(0.0, (started_at - enqueued_at).total_seconds() * 1e3),
        ttft_ms=c.ttft_ms, tpot_ms=c.tpot_ms, e2e_ms=c.e2e_ms, itl_ms=list(c.itl_ms),
    ).on_conflict_do_nothing(index_elements=["request_id"]))
    return True


def find_lost_candidates(session: Session, *, serving_config_name: str, queued_before: datetime,
                         started_before: datetime, limit: int = 1000) -> list[str]:
    """Unfinished requests old enough that their stream entry should long have been read or renewed."""
    rows = session.scalars(
        select(RequestRow.id).where(
            RequestRow.serving_config_name == serving_config_name,
            ((RequestRow.status == RequestStatus.QUEUED) & (RequestRow.enqueued_at < queued_before))
            | ((RequestRow.status == RequestStatus.RUNNING) & (RequestRow.started_at < started_before)),
        ).order_by(RequestRow.enqueued_at).limit(limit)
    ).all()
    return [str(i) for i in rows]


def stream_of(session: Session, ids: list[str]) -> dict[str, StreamKind]:
    rows = session.execute(select(RequestRow.id, RequestRow.stream).where(RequestRow.id.in_(_uuids(ids)))).all()
    return {str(i): kind for i, kind in rows}


def register_worker(session: Session, *, name: str, serving_config_name: str, config_hash: str,
                    hardware: dict[str, Any], software: dict[str, Any]) -> None:
    values = dict(name=name, serving_config_name=serving_config_name, config_hash=config_hash,
                  hardware=hardware, software=software, started_at=func.now(), heartbeat_at=func.now())
    session.execute(insert(WorkerRow).values(**values).on_conflict_do_update(index_elements=["name"], set_=values))


def unregister_worker(session: Session, *, name: str) -> None:
    session.execute(delete(WorkerRow).where(WorkerRow.name == name))


def heartbeat(session: Session, *, name: str) -> None:
    session.execute(update(WorkerRow).where(WorkerRow.name == name).values(heartbeat_at=func.now()))


def _uuids(ids: list[str]) -> list[uuid.UUID]:
    return [uuid.UUID(i) for i in ids]


def save_serving_config(session: Session, *, config: ServingConfig) -> None:
    """Record a served config (name + content hash) once; the full config travels with it."""
    session.execute(insert(ServingConfigRow).values(
        name=config.name, config_hash=config.config_hash, config=config.model_dump(mode="json"),
    ).on_conflict_do_nothing(index_elements=["name", "config_hash"]))


@dataclass(frozen=True)
class Execution:
    """How a request was served: its started executions, its result rows, the worker that finished it."""

    request_id: str
    num_attempts: int
    num_results: int
    num_generated_tokens: int
    worker_name: str | None  # the worker of the batch record that holds its metrics; None if unfinished


def executions(session: Session, *, ids: list[str]) -> list[Execution]:
    rows = session.execute(
        select(RequestRow.id, RequestRow.num_attempts, func.count(ResultRow.request_id),
               func.coalesce(func.sum(ResultRow.num_generated_tokens), 0), func.min(BatchRow.worker_name))
        .outerjoin(ResultRow, ResultRow.request_id == RequestRow.id)
        .outerjoin(RequestMetricsRow, RequestMetricsRow.request_id == RequestRow.id)
        .outerjoin(BatchRow, BatchRow.id == RequestMetricsRow.batch_id)
        .where(RequestRow.id.in_(_uuids(ids))).group_by(RequestRow.id)
    ).all()
    return [Execution(str(i), attempts, results, int(tokens), worker) for i, attempts, results, tokens, worker in rows]


def count_generated_tokens(session: Session, *, ids: list[str]) -> int:
    total = session.scalar(select(func.coalesce(func.sum(ResultRow.num_generated_tokens), 0))
                           .where(ResultRow.request_id.in_(_uuids(ids))))
    return int(total or 0)


def count_preempted(session: Session, *, ids: list[str]) -> int:
    total = session.scalar(select(func.coalesce(func.sum(RequestRow.num_preemptions), 0))
                           .where(RequestRow.id.in_(_uuids(ids))))
    return int(total or 0)


def cancel_request(session: Session, *, request_id: str, now: datetime, reason: str = CANCELLED_BY_CLIENT,
                   if_queued: bool = False) -> bool:
    """Cancel an unfinished request (if_queued: only one no worker has started): queued, it will never start;
    running, its worker drops the row (told through Redis) and stores the text made so far.
    -> whether it was cancelled now."""
    result = session.execute(
        update(RequestRow)
        .where(RequestRow.id == uuid.UUID(request_id),
               RequestRow.status == RequestStatus.QUEUED if if_queued else RequestRow.status.in_(UNFINISHED))
        .values(status=RequestStatus.CANCELLED, finish_reason=FinishReason.CANCELLED, error=reason, finished_at=now)
        .returning(RequestRow.id)
    ).first()
    return result is not None


def record_stream(session: Session, *, request_id: str, ttft_ms: float | None, itl_ms: list[float],
                  num_chunks: int, num_restarts: int, disconnected: bool) -> None:
    """What the streaming client saw of a request (once: the first stream that ends records it)."""
    session.execute(insert(StreamMetricsRow).values(
        request_id=uuid.UUID(request_id), ttft_ms=ttft_ms, itl_ms=itl_ms, num_chunks=num_chunks,
        num_restarts=num_restarts, disconnected=disconnected,
    ).on_conflict_do_nothing(index_elements=["request_id"]))


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
    timings_ms: dict[str, float | None] | None  # queue_ms, ttft_ms, tpot_ms, e2e_ms; streamed_ttft_ms, streamed_itl_ms
    logprobs: list[dict[str, Any]] | None = None  # as stored: TokenLogprobs.to_stored per generated token
    num_cached_tokens: int | None = None  # of num_prompt_tokens, served from the prefix cache; None: no result


def choice_ids(session: Session, *, request_id: str, tenant: str) -> list[str]:
    """The ids of a request's choices in order: its own alone, unless it is the first of an n > 1 request."""
    rows = session.scalars(select(RequestRow.id).where(RequestRow.first_choice_id == uuid.UUID(request_id),
                                                       RequestRow.tenant == tenant)
                           .order_by(RequestRow.choice_index)).all()
    return [str(i) for i in rows] or [request_id]


def get_request_view(session: Session, *, request_id: str, tenant: str) -> RequestView | None:
    try:
        key = uuid.UUID(request_id)
    except ValueError:
        return None
    row = session.execute(
        select(RequestRow, ResultRow, RequestMetricsRow, StreamMetricsRow)
        .outerjoin(ResultRow, ResultRow.request_id == RequestRow.id)
        .outerjoin(RequestMetricsRow, RequestMetricsRow.request_id == RequestRow.id)
        .outerjoin(StreamMetricsRow, StreamMetricsRow.request_id == RequestRow.id)
        .where(RequestRow.id == key, RequestRow.tenant == tenant)
    ).first()
    if row is None:
        return None
    r, result, m, streamed = row
    timings = None if m is None else {"queue_ms": m.queue_ms, "ttft_ms": m.ttft_ms, "tpot_ms": m.tpot_ms,
                                      "e2e_ms": m.e2e_ms}
    if streamed is not None:  # NOTE: as its streaming client saw it: TTFT from arrival at the API, mean chunk gap
        timings = {**(timings or {}), "streamed_ttft_ms": streamed.ttft_ms,
                   "streamed_itl_ms": sum(streamed.itl_ms) / len(streamed.itl_ms) if streamed.itl_ms else None}
    return RequestView(
        str(r.id), r.tenant, r.serving_config_name, r.status, r.priority, r.enqueued_at, r.started_at,
        r.first_token_at, r.finished_at, r.finish_reason, r.error, result.text if result else None,
        result.num_prompt_tokens if result else None, result.num_generated_tokens if result else None, timings,
        result.logprobs if result else None, result.num_cached_tokens if result else None,
    )
