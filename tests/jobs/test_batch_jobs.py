"""Bulk jobs end to end: a real Celery worker and a tiny-model GPU worker on real PostgreSQL and Redis."""

from __future__ import annotations

import json
import threading
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import update

from servelab.scheduler.policy import BatchPolicy
from servelab.serving import FaultPolicy, ServingWorker
from servelab.store import batch_jobs as jobs
from servelab.store import files
from servelab.store.db import session_scope
from servelab.store.models import BatchJobRow, BatchStatus
from tests.jobs.conftest import control_plane, line, make_job, mixed_file, register, wait_until


def job_now(stack, job_id):
    with session_scope(stack.runtime.sessions) as session:
        return jobs.get_job(session, job_id=job_id)


def counts_now(stack, job_id) -> jobs.RequestCounts:
    with session_scope(stack.runtime.sessions) as session:
        return jobs.count_requests(session, job=jobs.get_job(session, job_id=job_id))


def state_of(stack, job_id):
    """What a failed wait reports: the job, its counts, the worker and the streams."""
    def describe() -> str:
        job = job_now(stack, job_id)
        alive = stack.served.thread.is_alive() if stack.served and stack.served.thread else None
        depth = stack.served.streams.depth() if stack.served else None
        return (f"job {job.status.value} ingested={job.is_ingested} lines={job.num_lines} "
                f"counts={counts_now(stack, job_id)} worker_alive={alive} depth={depth}")
    return describe


def wait_for_status(stack, job_id, *, timeout_s: float = 240.0):
    return wait_until(lambda: (j := job_now(stack, job_id)).status.is_terminal and j, timeout_s=timeout_s,
                      state=state_of(stack, job_id))


def read_jsonl(stack, file_id: str | None, tenant: str = "acme") -> list[dict]:
    if file_id is None:
        return []
    with session_scope(stack.runtime.sessions) as session:
        content = files.read_content(session, file_id=file_id, tenant=tenant)
    return [json.loads(x) for x in content.decode().splitlines()]


def assert_every_line_answered_once(output: list[dict], errors: list[dict], num_lines: int) -> None:
    keys = [o["custom_id"] for o in output] + [e["custom_id"] or f"line-{e['line']}" for e in errors]
    assert len(output) + len(errors) == num_lines
    assert len(set(o["custom_id"] for o in output)) == len(output), "an output line appears twice"
    assert len(keys) == num_lines


def test_thousand_line_file_with_bad_lines_completes_with_every_line_answered_once(jobs_worker) -> None:
    stack = jobs_worker
    content, good, bad = mixed_file(stack.model, 1_000)
    job = make_job(stack, content)
    done = wait_for_status(stack, job.id)
    assert done.status is BatchStatus.COMPLETED
    output, errors = read_jsonl(stack, done.output_file_id), read_jsonl(stack, done.error_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(good)
    assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["usage"]["completion_tokens"] >= 1
               for o in output)
    assert {e["line"]: e["error"]["code"] for e in errors} == bad
    assert done.request_counts == {"total": 1_000, "completed": len(good), "failed": len(bad)}
    for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
        assert done.timestamps[stamp] is not None


class HeldEngine:
    """The tiny engine, except that once `hold` is set its runner's next step waits (signalling `held`) until
    `release` is set: a test can land a cancel while the worker is mid-job, however fast the machine serves."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.hold, self.held, self.release = threading.Event(), threading.Event(), threading.Event()
        self.runner = _HeldRunner(self)

    def __getattr__(self, name):
        return getattr(self._engine, name)


class _HeldRunner:
    def __init__(self, held: HeldEngine) -> None:
        self._held = held

    def execute(self, plan):
        held = self._held
        if held.hold.is_set() and not held.release.is_set():
            held.held.set()
            held.release.wait(timeout=120)
        return held._engine.runner.execute(plan)

    def __getattr__(self, name):
        return getattr(self._held._engine.runner, name)


def test_cancel_mid_job_keeps_finished_results_and_ends_cancelled(make_stack, tiny_engine) -> None:
    from servelab.store.db import session_factory
    from tests.queue.conftest import Served

    stack = make_stack(with_worker=False, max_job_in_flight=40)
    held = HeldEngine(tiny_engine)
    streams = stack_streams(stack)
    worker = ServingWorker(engine=held, streams=streams, sessions=session_factory(stack.runtime.db),
                           name=f"w-{uuid.uuid4().hex[:6]}",
                           policy=BatchPolicy(max_batch_size=4, max_wait_ms=5, max_batch_tokens=100_000),
                           faults=FaultPolicy(renew_every_s=0.2))
    stack.served = Served(worker, streams, worker.sessions)
    register(stack.served, tiny_engine)
    stack.served.start()
    try:
        with control_plane(stack):
            job = make_job(stack, "\n".join(line(f"r{i}", stack.model, max_tokens=8) for i in range(240)).encode())
            wait_until(lambda: counts_now(stack, job.id).completed >= 20, state=state_of(stack, job.id))
            held.hold.set()  # NOTE: the worker stops between two steps, so the cancel lands mid-job on any machine
            wait_until(held.held.is_set, timeout_s=60, state=state_of(stack, job.id))
            finished_at_hold = counts_now(stack, job.id).completed
            with session_scope(stack.runtime.sessions) as session:
                from servelab.jobs.lifecycle import cancel_job
                assert cancel_job(session, job_id=job.id, tenant="acme", now=datetime.now(UTC)).status \
                    is BatchStatus.CANCELLING
            held.release.set()
            done = wait_for_status(stack, job.id)
    finally:
        held.release.set()
        worker.stop.set()
        stack.served.thread.join(timeout=10)  # NOTE: gone before the runtime's connections close
    assert done.status is BatchStatus.CANCELLED and done.timestamps["cancelled_at"] is not None
    output, errors = read_jsonl(stack, done.output_file_id), read_jsonl(stack, done.error_file_id)
    # NOTE: at the hold, at most the 40 lines in flight were past the queue; the rest were cancelled unread
    assert finished_at_hold <= len(output) <= finished_at_hold + 40 < 240, \
        "cancelled mid-job: the finished lines, and those already started, kept"
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert_every_line_answered_once(output, errors, 240)


def test_job_past_its_window_ends_expired_with_its_finished_results(make_stack) -> None:
    stack = make_stack(max_job_in_flight=40)
    with control_plane(stack):
        job = make_job(stack, "\n".join(line(f"r{i}", stack.model) for i in range(150)).encode())
        wait_until(lambda: counts_now(stack, job.id).completed >= 10, state=state_of(stack, job.id))
        stack.served.worker.stop.set()  # nothing more is served
        # NOTE: the window ends now, not after a fixed number of seconds, so a slow machine cannot expire
        # the job before it has finished results; beat's expiry is what is tested.
        with session_scope(stack.runtime.sessions) as session:
            session.execute(update(BatchJobRow).where(BatchJobRow.id == job.id)
                            .values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
        done = wait_for_status(stack, job.id)
    assert done.status is BatchStatus.EXPIRED and done.timestamps["expired_at"] is not None
    output, errors = read_jsonl(stack, done.output_file_id), read_jsonl(stack, done.error_file_id)
    assert len(output) >= 10 and all(o["response"]["status_code"] == 200 for o in output)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert_every_line_answered_once(output, errors, 150)


class CrashingEngine:
    """The tiny engine, except that its runner's n-th step kills the serving thread mid-step, as a kill -9 would."""

    def __init__(self, engine, *, crash_on: int) -> None:
        self._engine = engine
        self.runner = _CrashingRunner(engine, crash_on)  # NOTE: the worker runs its plans here

    def __getattr__(self, name):
        return getattr(self._engine, name)


class _CrashingRunner:
    def __init__(self, engine, crash_on: int) -> None:
        self._engine, self._left = engine, crash_on

    def execute(self, plan):
        self._left -= 1
        if self._left == 0:
            self._engine.runner.drop([r.request_id for r in plan.rows])  # NOTE: the batch dies with the process
            self._engine.take_stats()
            raise SystemExit("killed mid-step")
        return self._engine.runner.execute(plan)

    def __getattr__(self, name):
        return getattr(self._engine.runner, name)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the kill is on purpose
def test_worker_killed_during_a_batch_job_still_answers_every_line_once(make_stack, tiny_engine) -> None:
    faults = FaultPolicy(renew_every_s=0.2, claim_idle_ms=1_000)
    stack = make_stack(with_worker=False, max_job_in_flight=60)
    from tests.queue.conftest import Served
    from servelab.store.db import session_factory

    policy = BatchPolicy(max_batch_size=8, max_wait_ms=5, max_batch_tokens=100_000)
    streams = stack_streams(stack)
    first = ServingWorker(engine=CrashingEngine(tiny_engine, crash_on=20), streams=streams,
                          sessions=session_factory(stack.runtime.db), name=f"w-{uuid.uuid4().hex[:6]}",
                          policy=policy, faults=faults)
    stack.served = Served(first, streams, first.sessions)
    register(stack.served, tiny_engine)
    stack.served.start()
    restarted, thread = None, None
    try:
        with control_plane(stack):
            job = make_job(stack, "\n".join(line(f"r{i}", stack.model) for i in range(120)).encode())
            wait_until(lambda: not stack.served.thread.is_alive(), timeout_s=60)
            first.stop.set()  # its claim keeper stops too: the process is gone
            assert job_now(stack, job.id).status is BatchStatus.IN_PROGRESS
            # NOTE: restarted under the same consumer name, it takes back the entries it held first
            restarted = ServingWorker(engine=tiny_engine, streams=streams, sessions=first.sessions, name=first.name,
                                      policy=policy, faults=faults)
            thread = threading.Thread(target=restarted.run, daemon=True)
            thread.start()
            done = wait_for_status(stack, job.id)
    finally:
        first.stop.set()
        if restarted is not None:
            restarted.stop.set()
            thread.join(timeout=10)
    assert done.status is BatchStatus.COMPLETED
    output, errors = read_jsonl(stack, done.output_file_id), read_jsonl(stack, done.error_file_id)
    assert errors == [] and sorted(o["custom_id"] for o in output) == sorted(f"r{i}" for i in range(120))
    with session_scope(stack.runtime.sessions) as session:
        attempts = [r for r in jobs.iter_job_requests(session, job_id=job.id)]
    assert len(attempts) == 120


def stack_streams(stack):
    from servelab.queue.streams import RequestStreams

    return RequestStreams(stack.runtime.redis, prefix=stack.settings.key_prefix,
                          config_name=f"tiny-{uuid.uuid4().hex[:8]}")
