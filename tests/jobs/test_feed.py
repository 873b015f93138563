"""The bulk feed's loop on the real store and Redis: a job whose slice raises, config names kept across tasks,
and the feed lease (a task runs rounds only while the lease holds its token)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import update

from servelab.config import ServingConfig
from servelab.jobs.feed import StepTries, feed_bulk
from servelab.jobs.ingest import MAX_STEP_TRIES, IngestLimits
from servelab.queue.streams import RequestStreams, stream_key
from servelab.request import RequestStatus, SamplingParams
from servelab.store import batch_jobs as jobs
from servelab.store import requests as request_store
from servelab.store.db import session_scope
from servelab.store.models import BatchStatus, FileRow, RequestRow, StreamKind, WorkerRow
from tests.jobs.conftest import REPO, make_job
from tests.jobs.test_fair_share import job_file

LIMITS = IngestLimits(max_prompt_chars=2_000, max_job_in_flight=200, max_line_bytes=64_000)


def feed_once(stack, **overrides) -> int:
    """One feed task that runs one round (then hands over, as a task does after FEED_TASK_S) -> lines read."""
    settings, runtime = stack.settings, stack.runtime
    kwargs = dict(sessions=runtime.sessions, configs_dir=settings.configs_dir, worker_live_s=settings.worker_live_s,
                  limits=LIMITS, max_bulk_queued_batches=4, max_s=0.01,
                  streams_for=lambda name: RequestStreams(runtime.redis, prefix=settings.key_prefix, config_name=name),
                  tries=StepTries(runtime.redis, f"{settings.key_prefix}:feed:step_tries"))
    return feed_bulk(**{**kwargs, **overrides}).num_lines


def bulk_queued(stack, config: str) -> int:
    return stack.runtime.redis.xlen(stream_key(stack.settings.key_prefix, config, StreamKind.BULK))


def test_a_job_whose_slice_raises_fails_after_its_tries_across_tasks_and_never_stalls_the_jobs_after_it(
        make_stack) -> None:
    stack = make_stack(with_worker=False)
    broken = make_job(stack, job_file("fp32", "x-", 3), tenant=f"b-{uuid.uuid4().hex[:6]}")
    good = make_job(stack, job_file("fp32", "g-", 5), tenant=f"g-{uuid.uuid4().hex[:6]}")
    with session_scope(stack.runtime.sessions) as session:  # NOTE: the file says it is longer than its parts:
        session.execute(update(FileRow).where(FileRow.id == broken.input_file_id)  # reading it raises
                        .values(num_bytes=FileRow.num_bytes + 100))
    # NOTE: first come, first served, and the two jobs' order is a tie: the good job is read in the round the broken
    # one raises in, or in the next while the broken one waits to be tried again (a task of 2 s holds both)
    assert feed_once(stack, max_bulk_queued_batches=0, max_s=2.0) == 5, "the job after the broken one is read"
    assert bulk_queued(stack, "fp32") == 5, "its lines go out although a slice raised"
    for _ in range(MAX_STEP_TRIES):  # NOTE: every task starts afresh: the tries are counted across tasks
        with session_scope(stack.runtime.sessions) as session:
            if jobs.get_job(session, job_id=broken.id).status is not BatchStatus.VALIDATING:
                break
        feed_once(stack, max_bulk_queued_batches=0)
    with session_scope(stack.runtime.sessions) as session:
        failed, read = jobs.get_job(session, job_id=broken.id), jobs.get_job(session, job_id=good.id)
    assert failed.status is BatchStatus.FAILED
    assert failed.errors[0]["code"] == "ingest_failed" and f"{MAX_STEP_TRIES} times" in failed.errors[0]["message"]
    assert "AssertionError" in failed.errors[0]["message"] and failed.errors[0]["line"] == 1
    assert read.is_ingested and read.status is BatchStatus.IN_PROGRESS
    assert not stack.runtime.redis.hexists(f"{stack.settings.key_prefix}:feed:step_tries", str(broken.id))


def test_a_task_that_gets_going_after_its_time_is_up_still_runs_a_round(make_stack) -> None:
    """On a loaded host a task can reach its loop after max_s: it reads a round all the same (CI saw a task of 10 ms
    read nothing), else a busy host would stall every job until the feed got a quiet moment."""
    stack = make_stack(with_worker=False)
    job = make_job(stack, job_file("fp32", "z-", 3), tenant=f"z-{uuid.uuid4().hex[:6]}")
    assert feed_once(stack, max_bulk_queued_batches=0, max_s=0.0) == 3
    assert lines_read(stack, job.id) == 3 and bulk_queued(stack, "fp32") == 3


def live_config(stack, *, max_batch_size: int, is_live: bool = True) -> str:
    """A serving config of its own, registered with a worker (live, or with its last heartbeat long ago)."""
    base = ServingConfig.from_yaml(REPO / "configs" / "fp32.yaml")
    config = base.model_copy(update={"name": f"c-{uuid.uuid4().hex[:8]}", "batching": base.batching.model_copy(
        update={"max_batch_size": max_batch_size})})
    worker = f"w-{uuid.uuid4().hex[:8]}"
    with session_scope(stack.runtime.sessions) as session:
        request_store.save_serving_config(session, config=config)
        request_store.register_worker(session, name=worker, serving_config_name=config.name,
                                      config_hash=config.config_hash, hardware={}, software={})
        if not is_live:
            session.execute(update(WorkerRow).where(WorkerRow.name == worker)
                            .values(heartbeat_at=datetime.now(UTC) - timedelta(hours=1)))
    return config.name


def fill(stack, config: str, num_lines: int, *, status: RequestStatus = RequestStatus.QUEUED) -> uuid.UUID:
    """A job whose num_lines stored lines name config (and one more line, unread), in that status."""
    job = make_job(stack, job_file(config, "f-", num_lines + 1), tenant=f"f-{uuid.uuid4().hex[:6]}")
    with session_scope(stack.runtime.sessions) as session:
        jobs.add_requests(session, job=job, requests=[jobs.NewRequest(f"f-{i}", config, "p", None, SamplingParams())
                                                      for i in range(num_lines)])
        jobs.update_job(session, job_id=job.id, num_lines=num_lines,
                        ingest_offset=len(job_file(config, "f-", num_lines)))
        session.execute(update(RequestRow).where(RequestRow.batch_job_id == job.id).values(status=status))
    return job.id


def lines_read(stack, job_id: uuid.UUID) -> int:
    with session_scope(stack.runtime.sessions) as session:
        return jobs.get_job(session, job_id=job_id).num_lines


def test_a_full_queue_holds_back_only_the_jobs_that_named_its_config_across_tasks(make_stack) -> None:
    stack = make_stack(with_worker=False)
    slow, dead, free = (live_config(stack, max_batch_size=1), live_config(stack, max_batch_size=1, is_live=False),
                        live_config(stack, max_batch_size=8))
    fill(stack, slow, 4)  # at its bound (4 batches of 1), a live worker that takes nothing
    on_dead = fill(stack, dead, 9)  # past its bound, and no live worker
    started = fill(stack, slow, 2, status=RequestStatus.RUNNING)  # its lines named slow and all started
    newcomer = make_job(stack, job_file(free, "n-", 3), tenant=f"n-{uuid.uuid4().hex[:6]}")
    to_dead = make_job(stack, job_file(dead, "d-", 3), tenant=f"d-{uuid.uuid4().hex[:6]}")
    # NOTE: tasks of their own: nothing known but what the store holds. A task runs rounds for 10 ms; on a loaded
    # host one round may be all it gets (seen in CI), so up to five tasks run: a job held back stays held in every one
    for _ in range(5):
        feed_once(stack)
        if lines_read(stack, newcomer.id) == 3 and lines_read(stack, to_dead.id) == 3 and \
                lines_read(stack, on_dead) == 10:
            break
    assert lines_read(stack, newcomer.id) == 3, "a full queue must not hold back a job that named no config yet"
    assert lines_read(stack, to_dead.id) == 3
    assert lines_read(stack, on_dead) == 10, "a config no live worker serves is not bounded"
    assert lines_read(stack, started) == 2, "a job whose stored lines named the full config waits for its room"


@pytest.fixture
def bound_worker(make_stack):
    """The jobs-worker's tasks bound to a stack in this process, called directly (no broker: nothing here hands
    over, so nothing is sent)."""
    from worker import jobs as worker_jobs

    stack = make_stack(with_worker=False)
    before = dict(worker_jobs._bound)
    worker_jobs._bound.update(runtime=stack.runtime, settings=stack.settings)
    yield stack, worker_jobs
    worker_jobs._bound.clear()
    worker_jobs._bound.update(before)


def test_only_the_feed_leases_holder_runs_rounds_and_a_stale_holder_never_deletes_anothers_lease(
        bound_worker) -> None:
    stack, worker_jobs = bound_worker
    redis, key = stack.runtime.redis, f"{stack.settings.key_prefix}:lease:feed:bulk"
    job = make_job(stack, job_file("fp32", "l-", 3), tenant=f"l-{uuid.uuid4().hex[:6]}")
    redis.set(key, "new-holder", px=worker_jobs.LEASE_MS)  # NOTE: the sweep started another feed meanwhile
    assert worker_jobs.feed_bulk(token="stale-holder") == 0, "a successor whose lease is gone runs no round"
    assert lines_read(stack, job.id) == 0
    assert redis.get(key) in (b"new-holder", "new-holder"), "and its end leaves the new holder's lease"
    assert worker_jobs.feed_bulk(token="new-holder") == 3, "the holder reads"
    assert lines_read(stack, job.id) == 3
    assert redis.get(key) is None, "its lease ends with it (no lines left, no successor)"
    assert worker_jobs.FeedLease(redis, key, "a").take() and not worker_jobs.FeedLease(redis, key, "b").take()
    assert not worker_jobs.FeedLease(redis, key, "b").hold() and not worker_jobs.FeedLease(redis, key, "b").release()
    assert worker_jobs.FeedLease(redis, key, "a").hold() and worker_jobs.FeedLease(redis, key, "a").release()
    assert redis.get(key) is None
