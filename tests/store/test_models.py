"""The schema's guarantees, on a real PostgreSQL: unique results, ordered status, constraint checks."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from servelab.memory import MemoryBreakdown
from servelab.outputs import BatchTimings, FinishReason
from servelab.store.models import (
    BatchRow,
    RequestMetricsRow,
    RequestRow,
    RequestStatus,
    ResultRow,
    StreamKind,
)


def _request(**overrides: object) -> RequestRow:
    fields: dict[str, object] = dict(serving_config_name="baseline", stream=StreamKind.INTERACTIVE, prompt="Hi")
    fields.update(overrides)
    return RequestRow(**fields)


def test_inserting_a_result_twice_for_one_request_violates_the_unique_key(session: Session) -> None:
    request = _request()
    session.add(request)
    session.flush()
    session.add(ResultRow(request_id=request.id, text="Hello", num_prompt_tokens=3, num_generated_tokens=1, token_ids=[9]))
    session.flush()

    with pytest.raises(IntegrityError, match="pk_results"), session.begin_nested():
        session.add(ResultRow(request_id=request.id, text="again", num_prompt_tokens=3, num_generated_tokens=1, token_ids=[9]))

    texts = session.scalars(select(ResultRow.text).where(ResultRow.request_id == request.id)).all()
    assert texts == ["Hello"]


def test_postgres_orders_status_queued_then_running_then_terminal(session: Session) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    for status in reversed(RequestStatus):
        session.add(_request(tenant=tenant, status=status))
    session.flush()

    ordered = session.scalars(select(RequestRow.status).where(RequestRow.tenant == tenant).order_by(RequestRow.status))
    assert list(ordered) == list(RequestStatus)
    unfinished = session.scalars(
        select(RequestRow.status).where(RequestRow.tenant == tenant, RequestRow.status < RequestStatus.SUCCEEDED)
    )
    assert set(unfinished) == {RequestStatus.QUEUED, RequestStatus.RUNNING}


def test_status_moves_forward_only_and_terminal_states_are_siblings() -> None:
    assert RequestStatus.QUEUED.can_move_to(RequestStatus.RUNNING)
    assert RequestStatus.RUNNING.can_move_to(RequestStatus.SUCCEEDED)
    assert RequestStatus.QUEUED.can_move_to(RequestStatus.CANCELLED)
    assert RequestStatus.RUNNING.can_move_to(RequestStatus.QUEUED)  # a lost worker's request is re-queued
    assert not RequestStatus.SUCCEEDED.can_move_to(RequestStatus.FAILED)
    assert not RequestStatus.FAILED.can_move_to(RequestStatus.RUNNING)
    assert [s for s in RequestStatus if s.is_terminal] == [
        RequestStatus.SUCCEEDED,
        RequestStatus.FAILED,
        RequestStatus.CANCELLED,
    ]


def test_new_request_defaults_to_queued_default_tenant_and_no_attempts(session: Session) -> None:
    request = _request(messages=None)
    session.add(request)
    session.flush()
    session.refresh(request)
    assert (request.status, request.tenant, request.num_attempts) == (RequestStatus.QUEUED, "default", 0)
    assert request.enqueued_at.tzinfo is not None


@pytest.mark.parametrize(
    "prompt, messages",
    [(None, None), ("Hi", [{"role": "user", "content": "Hi"}])],
    ids=["neither", "both"],
)
def test_request_needs_exactly_one_of_prompt_or_messages(
    session: Session, prompt: str | None, messages: list[dict[str, str]] | None
) -> None:
    with pytest.raises(IntegrityError, match="ck_requests_prompt_xor_messages"), session.begin_nested():
        session.add(_request(prompt=prompt, messages=messages))


def test_custom_id_is_unique_within_a_batch_job(session: Session) -> None:
    job_id = uuid.uuid4()
    session.add(_request(batch_job_id=job_id, custom_id="line-1", stream=StreamKind.BULK))
    session.add(_request(batch_job_id=uuid.uuid4(), custom_id="line-1", stream=StreamKind.BULK))
    session.flush()
    with pytest.raises(IntegrityError, match="uq_requests_batch_job_id_custom_id"), session.begin_nested():
        session.add(_request(batch_job_id=job_id, custom_id="line-1", stream=StreamKind.BULK))


def test_batch_and_request_metrics_hold_what_the_engine_reports(session: Session) -> None:
    timings = BatchTimings(
        prefill_ms=12.5, decode_ms=40.0, num_rows_per_step=(2, 2, 1), num_prefill_tokens=16, num_decode_tokens=3
    )
    memory = MemoryBreakdown(
        weight_bytes=538_000_000,
        kv_cache_bytes=92_160,
        kv_cache_allocated_bytes=92_160,
        peak_working_bytes=4_000_000_000,
        peak_process_bytes=6_000_000_000,  # above 2**31: the byte columns are bigint
        device="cpu",
    )
    now = datetime.now(UTC)
    batch = BatchRow(
        worker_name="w0",
        serving_config_name="baseline",
        config_hash="abc",
        num_requests=2,
        num_rows_per_step=list(timings.num_rows_per_step),
        prefill_ms=timings.prefill_ms,
        decode_ms=timings.decode_ms,
        num_prefill_tokens=timings.num_prefill_tokens,
        num_decode_tokens=timings.num_decode_tokens,
        started_at=now,
        finished_at=now,
        **memory.as_dict(),
    )
    request = _request(status=RequestStatus.SUCCEEDED, finish_reason=FinishReason.LENGTH)
    session.add_all([batch, request])
    session.flush()
    metrics = RequestMetricsRow(
        request_id=request.id, batch_id=batch.id, queue_ms=1.0, ttft_ms=12.5, tpot_ms=20.0, e2e_ms=52.5,
        itl_ms=[20.0, 20.0],
    )
    session.add(metrics)
    session.flush()
    session.expire_all()

    stored = session.get(BatchRow, batch.id)
    assert stored is not None
    assert (stored.num_rows_per_step, stored.peak_process_bytes) == ([2, 2, 1], 6_000_000_000)
    stored_metrics = session.get(RequestMetricsRow, request.id)
    assert stored_metrics is not None and stored_metrics.itl_ms == [20.0, 20.0]
    stored_request = session.get(RequestRow, request.id)
    assert stored_request is not None and stored_request.finish_reason is FinishReason.LENGTH
