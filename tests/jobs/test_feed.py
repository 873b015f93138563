"""The bulk feed's loop on the real store and Redis: a job whose slice raises, config names kept across tasks,
and the feed lease (a task runs rounds only while the lease holds its token)."""

from __future__ import annotations

import uuid

from sqlalchemy import update

from servelab.jobs.feed import StepTries, feed_bulk
from servelab.jobs.ingest import MAX_STEP_TRIES, IngestLimits
from servelab.queue.streams import RequestStreams, stream_key
from servelab.store import batch_jobs as jobs
from servelab.store.db import session_scope
from servelab.store.models import BatchStatus, FileRow, StreamKind
from tests.jobs.conftest import make_job
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
    assert feed_once(stack, max_bulk_queued_batches=0) == 5, "the job after the broken one is read in the same round"
    assert bulk_queued(stack, "fp32") == 5, "its lines go out although a slice raised in the round"
    for _ in range(MAX_STEP_TRIES - 1):  # NOTE: every task starts afresh: the tries are counted across tasks
        with session_scope(stack.runtime.sessions) as session:
            assert jobs.get_job(session, job_id=broken.id).status is BatchStatus.VALIDATING
        feed_once(stack, max_bulk_queued_batches=0)
    with session_scope(stack.runtime.sessions) as session:
        failed, read = jobs.get_job(session, job_id=broken.id), jobs.get_job(session, job_id=good.id)
    assert failed.status is BatchStatus.FAILED
    assert failed.errors[0]["code"] == "ingest_failed" and f"{MAX_STEP_TRIES} times" in failed.errors[0]["message"]
    assert "AssertionError" in failed.errors[0]["message"] and failed.errors[0]["line"] == 1
    assert read.is_ingested and read.status is BatchStatus.IN_PROGRESS
    assert not stack.runtime.redis.hexists(f"{stack.settings.key_prefix}:feed:step_tries", str(broken.id))
