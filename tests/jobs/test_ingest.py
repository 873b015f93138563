"""Batch-file ingest and the job lifecycle as plain functions on real PostgreSQL and Redis (no Celery)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from servelab.jobs.ingest import IngestLimits, ingest_step
from servelab.jobs.lifecycle import advance_job, cancel_job
from servelab.queue.streams import RequestStreams
from servelab.store import batch_jobs as jobs
from servelab.store import files
from servelab.store.db import session_scope
from servelab.store.models import BatchStatus
from tests.jobs.conftest import line, make_job, mixed_file


def step(stack, job, *, max_in_flight: int = 10_000, per_step: int = 500):
    now = datetime.now(UTC)
    return ingest_step(
        sessions=stack.runtime.sessions, job_id=job.id, configs_dir=stack.settings.configs_dir, now=now,
        streams_for=lambda name: RequestStreams(stack.runtime.redis, prefix=stack.settings.key_prefix, config_name=name),
        live_since=now - timedelta(seconds=30),
        limits=IngestLimits(max_prompt_chars=stack.settings.max_prompt_chars, max_job_in_flight=max_in_flight,
                            max_line_bytes=stack.settings.max_request_bytes, max_lines_per_step=per_step))


def ingest_all(stack, job, **kw) -> None:
    for _ in range(1_000):
        if step(stack, job, **kw).is_done:
            return
    raise AssertionError("ingest did not finish")


def line_errors(stack, job) -> dict[int, jobs.LineError]:
    with session_scope(stack.runtime.sessions) as session:
        return {e.line_no: e for e in jobs.iter_line_errors(session, job_id=job.id)}


def test_every_bad_line_is_refused_with_its_reason_and_good_lines_become_requests(make_stack) -> None:
    stack = make_stack(with_worker=False)
    content, good, bad = mixed_file("fp32", 300)
    job = make_job(stack, content)
    ingest_all(stack, job, per_step=64)  # NOTE: steps smaller than the file: duplicates span steps
    errors = line_errors(stack, job)
    assert {n: e.code for n, e in errors.items()} == bad
    unknown = next(e for e in errors.values() if e.code == "model_not_found")
    assert "no-such-model" in unknown.message and "fp32" in unknown.message  # it names the known models
    with session_scope(stack.runtime.sessions) as session:
        stored = list(jobs.iter_job_requests(session, job_id=job.id))
        reloaded = jobs.get_job(session, job_id=job.id)
    assert {r.custom_id for r in stored} == good and len(stored) == len(good)
    assert reloaded.status is BatchStatus.IN_PROGRESS and reloaded.is_ingested and reloaded.num_lines == 300


def test_back_pressure_stops_ingest_at_the_jobs_in_flight_limit(make_stack) -> None:
    stack = make_stack(with_worker=False)
    job = make_job(stack, "\n".join(line(f"r{i}", "fp32") for i in range(120)).encode())
    first = step(stack, job, max_in_flight=50)
    assert first.num_enqueued == 50 and not first.is_done
    assert step(stack, job, max_in_flight=50).is_throttled
    streams = RequestStreams(stack.runtime.redis, prefix=stack.settings.key_prefix, config_name="fp32")
    assert streams.depth()["bulk"] == 50


def test_a_line_longer_than_the_limit_is_refused_and_the_next_line_still_read(make_stack) -> None:
    stack = make_stack(with_worker=False)
    huge = json.dumps({"custom_id": "big", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "fp32", "prompt": "y" * 2_000_000}})
    job = make_job(stack, f"{line('a', 'fp32')}\n{huge}\n{line('b', 'fp32')}".encode())
    ingest_all(stack, job)
    assert {n: e.code for n, e in line_errors(stack, job).items()} == {2: "line_too_large"}
    with session_scope(stack.runtime.sessions) as session:
        assert {r.custom_id for r in jobs.iter_job_requests(session, job_id=job.id)} == {"a", "b"}


def test_cancel_mid_ingest_answers_unread_lines_in_the_error_file(make_stack) -> None:
    stack = make_stack(with_worker=False)
    job = make_job(stack, "\n".join(line(f"r{i}", "fp32") for i in range(100)).encode())
    step(stack, job, per_step=30)
    with session_scope(stack.runtime.sessions) as session:
        cancel_job(session, job_id=job.id, tenant="acme", now=datetime.now(UTC))
    assert step(stack, job).is_done  # ingest stops at once
    assert advance_job(sessions=stack.runtime.sessions, job_id=job.id, now=datetime.now(UTC)) is BatchStatus.CANCELLED
    with session_scope(stack.runtime.sessions) as session:
        done = jobs.get_job(session, job_id=job.id)
        errors = files.read_content(session, file_id=done.error_file_id, tenant="acme").decode().splitlines()
    answered = [json.loads(e)["custom_id"] for e in errors]
    assert sorted(answered) == sorted(f"r{i}" for i in range(100))
    assert done.output_file_id is None and done.request_counts == {"total": 100, "completed": 0, "failed": 100}


def test_another_tenant_cannot_cancel_a_job(make_stack) -> None:
    stack = make_stack(with_worker=False)
    job = make_job(stack, line("a", "fp32").encode())
    with session_scope(stack.runtime.sessions) as session:
        assert cancel_job(session, job_id=job.id, tenant="someone-else", now=datetime.now(UTC)) is None
        assert jobs.get_job(session, job_id=job.id).status is BatchStatus.VALIDATING


def test_a_line_asking_to_stream_is_refused_on_its_line(make_stack) -> None:
    stack = make_stack(with_worker=False)
    streamed = json.loads(line("s", "fp32"))
    streamed["body"]["stream"] = True
    job = make_job(stack, (json.dumps(streamed) + "\n" + line("ok", "fp32") + "\n").encode())
    ingest_all(stack, job)
    [error] = line_errors(stack, job).values()
    assert (error.line_no, error.code) == (1, "invalid_request") and "cannot stream" in error.message
    with session_scope(stack.runtime.sessions) as session:
        assert [r.custom_id for r in jobs.iter_job_requests(session, job_id=job.id)] == ["ok"]
