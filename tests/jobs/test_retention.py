"""Retention on real PostgreSQL: old finished rows go in slices; recent ones, unfinished ones, what a run or a
comparison needs and what a running batch job needs stay, whatever their age."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from servelab.jobs.retention import Pruned, RetentionPolicy, prune
from servelab.lab.runsets import batch_samples, load_run_set
from servelab.request import FinishReason
from servelab.store import batch_jobs, files, runs
from servelab.store.db import session_factory, session_scope
from servelab.store.models import (BatchJobRow, BatchRow, BatchStatus, ComparisonRow, FilePartRow, FileRow,
                                   RequestMetricsRow, RequestRow, RequestStatus, ResultRow, RunRequestRow, RunRow,
                                   StreamKind, StreamMetricsRow)
from tests.jobs.conftest import fail_active_jobs

NOW = datetime.now(UTC)
OLD, RECENT = timedelta(days=40), timedelta(days=2)
TENANT = "retention-tests"
POLICY = RetentionPolicy(max_age=timedelta(days=30), max_file_age=timedelta(days=30))


@pytest.fixture
def sessions(engine) -> Iterator[sessionmaker[Session]]:
    made = session_factory(engine)
    yield made
    # NOTE: a job of these tests left running (its file's one line unread) was read by the next feed in the process,
    # one line more than that test's own (seen in a whole-suite run)
    fail_active_jobs(made, tenant=TENANT)


def served(sessions, *, age: timedelta, status: RequestStatus = RequestStatus.SUCCEEDED, n: int = 1,
           batch_job_id: uuid.UUID | None = None) -> list[str]:
    """n requests enqueued `age` ago, finished a second later with a result, metrics, streamed figures and a
    batch record of their own (unfinished ones: the row alone)."""
    enqueued_at = NOW - age
    finished = status in (RequestStatus.SUCCEEDED, RequestStatus.FAILED, RequestStatus.CANCELLED)
    with session_scope(sessions) as session:
        batch = BatchRow(id=uuid.uuid4(), worker_name="w", serving_config_name="retained", config_hash="h",
                         num_requests=n, num_rows_per_step=[n], prefill_ms=1.0, decode_ms=1.0, num_prefill_tokens=n,
                         num_decode_tokens=n, device="cpu", weight_bytes=1, kv_cache_bytes=1,
                         kv_cache_allocated_bytes=1, peak_working_bytes=1, peak_process_bytes=1,
                         started_at=enqueued_at, finished_at=enqueued_at + timedelta(seconds=1))
        session.add(batch)
        ids = []
        for i in range(n):
            row = RequestRow(id=uuid.uuid4(), serving_config_name="retained", stream=StreamKind.INTERACTIVE,
                             status=status, prompt=f"p{i}", enqueued_at=enqueued_at, batch_job_id=batch_job_id,
                             custom_id=f"c{i}-{uuid.uuid4().hex[:6]}" if batch_job_id else None,
                             finished_at=enqueued_at + timedelta(seconds=1) if finished else None,
                             finish_reason=FinishReason.STOP if finished else None)
            session.add(row)
            session.flush()
            if finished:
                session.add_all([
                    ResultRow(request_id=row.id, text="t", num_prompt_tokens=1, num_generated_tokens=1, token_ids=[1]),
                    RequestMetricsRow(request_id=row.id, batch_id=batch.id, queue_ms=1.0, ttft_ms=1.0, tpot_ms=None,
                                      e2e_ms=1.0, itl_ms=[]),
                    StreamMetricsRow(request_id=row.id, ttft_ms=1.0, itl_ms=[], num_chunks=1)])
            ids.append(str(row.id))
    return ids


def present(sessions, ids: list[str]) -> dict[str, set[str]]:
    """Which of these requests still have their row, result, metrics and streamed figures."""
    keys = [uuid.UUID(i) for i in ids]
    with session_scope(sessions) as session:
        return {table.__tablename__: {str(k) for k in session.scalars(select(column).where(column.in_(keys)))}
                for table, column in ((RequestRow, RequestRow.id), (ResultRow, ResultRow.request_id),
                                      (RequestMetricsRow, RequestMetricsRow.request_id),
                                      (StreamMetricsRow, StreamMetricsRow.request_id))}


def batch_of(sessions, request_id: str) -> uuid.UUID:
    with session_scope(sessions) as session:
        return session.scalar(select(RequestMetricsRow.batch_id)
                              .where(RequestMetricsRow.request_id == uuid.UUID(request_id)))


def has_batch(sessions, batch_id: uuid.UUID) -> bool:
    with session_scope(sessions) as session:
        return session.get(BatchRow, batch_id) is not None


def test_old_finished_requests_go_with_their_results_metrics_and_batches_and_recent_ones_stay(sessions) -> None:
    old = [i for status in (RequestStatus.SUCCEEDED, RequestStatus.FAILED, RequestStatus.CANCELLED)
           for i in served(sessions, age=OLD, status=status)]
    old_batches = [batch_of(sessions, i) for i in old]
    recent = served(sessions, age=RECENT)
    unfinished = served(sessions, age=OLD, status=RequestStatus.QUEUED) + served(sessions, age=OLD,
                                                                                 status=RequestStatus.RUNNING)
    pruned = prune(sessions=sessions, policy=POLICY, now=NOW)
    assert pruned.is_done and pruned.num_requests >= 3 and pruned.num_batches >= 3
    assert present(sessions, old) == {"requests": set(), "results": set(), "request_metrics": set(),
                                      "stream_metrics": set()}
    assert not any(has_batch(sessions, b) for b in old_batches)
    assert present(sessions, recent) == {table: set(recent) for table in
                                         ("requests", "results", "request_metrics", "stream_metrics")}
    assert has_batch(sessions, batch_of(sessions, recent[0]))
    assert present(sessions, unfinished)["requests"] == set(unfinished)


def test_every_run_and_comparison_keeps_its_requests_and_batches_whatever_their_age(sessions) -> None:
    sent = served(sessions, age=OLD, n=3)
    bystander = served(sessions, age=OLD)
    with session_scope(sessions) as session:
        run_id = runs.record_run(session, config={"name": "retained"}, config_hash="h", workload_name="w",
                                 workload_fingerprint="fp", workload={}, hardware={}, software={}, worker_name="w",
                                 started_at=NOW - OLD, finished_at=NOW - OLD, summary={},
                                 sent=[(rid, i, None) for i, rid in enumerate(sent)])
        comparison_id = runs.save_comparison(session, plan_name="p", plan={}, baseline_run_ids=[run_id],
                                             candidate_run_ids=[run_id], report={})
    prune(sessions=sessions, policy=POLICY, now=NOW)
    assert present(sessions, sent) == {table: set(sent) for table in
                                       ("requests", "results", "request_metrics", "stream_metrics")}
    assert present(sessions, bystander)["requests"] == set()  # the same age, sent by no run: gone
    with session_scope(sessions) as session:
        assert session.get(RunRow, uuid.UUID(run_id)) is not None
        assert session.get(ComparisonRow, uuid.UUID(comparison_id)) is not None
        assert len(session.scalars(select(RunRequestRow).where(RunRequestRow.run_id == uuid.UUID(run_id))).all()) == 3
        assert [len(s) for s in load_run_set(session, run_ids=[run_id]).samples] == [3]
        assert [b.num_requests for b in batch_samples(session, request_ids=sent)] == [3]  # its batch record stayed


def content_of(session: Session, file_id: str) -> bytes:
    """The bytes the file's parts hold, whether or not reads still find it."""
    return b"".join(session.scalars(select(FilePartRow.content).where(FilePartRow.file_id == file_id)
                                    .order_by(FilePartRow.byte_offset)))


def make_job(sessions, *, status: BatchStatus, age: timedelta) -> tuple[uuid.UUID, str]:
    with session_scope(sessions) as session:
        f = files.create_file(session, tenant=TENANT, purpose="batch", filename="in.jsonl", content=b"{}\n")
        job = batch_jobs.create_job(session, tenant=TENANT, endpoint="/v1/completions", input_file_id=f.id,
                                    completion_window="24h", metadata=None, expires_at=NOW + timedelta(days=1))
        batch_jobs.update_job(session, job_id=job.id, status=status)
        session.query(FileRow).filter(FileRow.id == f.id).update({"created_at": NOW - age})
    return job.id, f.id


def test_a_running_batch_job_keeps_its_old_requests_and_file_and_a_finished_one_loses_them(sessions) -> None:
    running_job, running_file = make_job(sessions, status=BatchStatus.IN_PROGRESS, age=OLD)
    done_job, done_file = make_job(sessions, status=BatchStatus.COMPLETED, age=OLD)
    of_running = served(sessions, age=OLD, batch_job_id=running_job)
    of_done = served(sessions, age=OLD, batch_job_id=done_job)
    with session_scope(sessions) as session:
        unnamed = files.create_file(session, tenant=TENANT, purpose="batch", filename="x.jsonl", content=b"x").id
        recent = files.create_file(session, tenant=TENANT, purpose="batch", filename="y.jsonl", content=b"y").id
        session.query(FileRow).filter(FileRow.id == unnamed).update({"created_at": NOW - OLD})
    prune(sessions=sessions, policy=POLICY, now=NOW)
    assert present(sessions, of_running)["requests"] == set(of_running)
    assert present(sessions, of_done)["requests"] == set()
    with session_scope(sessions) as session:
        assert session.get(FileRow, unnamed) is None
        kept, erased, fresh = (session.get(FileRow, i) for i in (running_file, done_file, recent))
        assert content_of(session, kept.id) == b"{}\n" and kept.deleted_at is None
        assert content_of(session, erased.id) == b"" and erased.deleted_at is not None  # the finished job names it
        assert content_of(session, fresh.id) == b"y" and fresh.deleted_at is None
        assert session.get(BatchJobRow, done_job) is not None  # jobs are kept


def test_nothing_goes_when_retention_is_off(sessions) -> None:
    old = served(sessions, age=OLD)
    off = RetentionPolicy(max_age=None, max_file_age=None)
    assert prune(sessions=sessions, policy=off, now=NOW) == Pruned(0, 0, 0, True)
    assert present(sessions, old)["requests"] == set(old)


def test_a_backlog_goes_in_slices_and_a_run_out_of_time_stops_and_the_next_goes_on(sessions) -> None:
    old = served(sessions, age=OLD + timedelta(days=365), n=7)  # older than every other test's rows
    ticks = itertools.count()
    one_slice = RetentionPolicy(max_age=timedelta(days=30), max_file_age=None, max_rows_per_slice=3, budget_s=1.5)
    first = prune(sessions=sessions, policy=one_slice, now=NOW, clock=lambda: float(next(ticks)))
    assert (first.num_requests, first.is_done) == (3, False)  # the clock ran out after one slice of 3
    assert len(present(sessions, old)["requests"]) == 4
    rest = prune(sessions=sessions, policy=RetentionPolicy(max_age=timedelta(days=30), max_file_age=None,
                                                           max_rows_per_slice=3), now=NOW)
    assert rest.is_done and present(sessions, old)["requests"] == set()
