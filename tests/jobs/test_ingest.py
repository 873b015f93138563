"""Batch-file ingest and the job lifecycle as plain functions on real PostgreSQL and Redis (no Celery)."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from servelab.jobs import ingest
from servelab.catalog import Catalog, load_catalog
from servelab.jobs.ingest import IngestLimits, ingest_step
from servelab.jobs.lifecycle import advance_job, cancel_job
from servelab.lab.ingest_bench import answer_every_request
from servelab.queue.streams import RequestStreams, stream_key
from servelab.store import batch_jobs as jobs
from servelab.store import files
from servelab.store.db import session_scope
from servelab.store.models import BatchStatus, FilePartRow, RequestRow, StreamKind
from tests.jobs.conftest import REPO, line, make_job, mixed_file, service_env, wait_until


def step(stack, job, *, max_in_flight: int = 10_000, per_step: int = 500, max_line_bytes: int | None = None,
         catalog=None):
    now = datetime.now(UTC)
    return ingest_step(
        sessions=stack.runtime.sessions, job_id=job.id, configs_dir=stack.settings.configs_dir, now=now,
        streams_for=lambda name: streams_of(stack, name), live_since=now - timedelta(seconds=30), catalog=catalog,
        limits=IngestLimits(max_prompt_chars=stack.settings.max_prompt_chars, max_job_in_flight=max_in_flight,
                            max_line_bytes=max_line_bytes or stack.settings.max_request_bytes,
                            max_lines_per_step=per_step))


def streams_of(stack, name: str = "fp32") -> RequestStreams:
    return RequestStreams(stack.runtime.redis, prefix=stack.settings.key_prefix, config_name=name)


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
                       "body": {"model": "fp32", "prompt": "y" * 2_000_000}})  # NOTE: past a 1 MiB read, too
    unnamed = json.dumps({"method": "POST", "url": "/v1/completions", "custom_id": "late",
                          "body": {"model": "fp32", "prompt": "z" * 1_100_000}})
    job = make_job(stack, f"{line('a', 'fp32')}\n{huge}\n{line('b', 'fp32')}\n{unnamed}".encode())
    ingest_all(stack, job)
    errors = line_errors(stack, job)
    assert {n: e.code for n, e in errors.items()} == {2: "line_too_large", 4: "line_too_large"}
    # the id the line opens with is read from its first bytes, so the user can match the error to the line
    assert errors[2].custom_id == "big" and errors[4].custom_id is None
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


def stream_ids(stack, name: str = "fp32") -> Counter:
    """How many times each request id is in the config's bulk stream."""
    entries = stack.runtime.redis.xrange(stream_key(stack.settings.key_prefix, name, StreamKind.BULK))
    return Counter(fields[b"request_id"].decode() for _, fields in entries)


def assert_every_line_once(stack, job, good: set[str], bad: dict[int, str], *, num_lines: int,
                           may_miss_entries: bool = False) -> None:
    """The good lines are requests, once each; the bad lines are errors, exactly; no request is in the stream
    twice, and one that is not there (committed, then killed before its enqueue) is one the reaper re-adds."""
    with session_scope(stack.runtime.sessions) as session:
        stored = {r.id for r in jobs.iter_job_requests(session, job_id=job.id)}
        custom_ids = sorted(r.custom_id for r in jobs.iter_job_requests(session, job_id=job.id))
        ended = jobs.get_job(session, job_id=job.id)
    assert custom_ids == sorted(good)
    assert {n: e.code for n, e in line_errors(stack, job).items()} == bad
    in_stream = stream_ids(stack)
    assert set(in_stream) <= stored and set(in_stream.values()) <= {1}
    missing = sorted(stored - set(in_stream))
    assert not any(streams_of(stack).is_enqueued(missing)), "the reaper re-adds a queued row not in its set"
    assert may_miss_entries or not missing
    assert ended.is_ingested and ended.num_lines == num_lines


def test_lines_across_slice_chunk_and_part_borders_keep_their_line_numbers(make_stack, monkeypatch) -> None:
    monkeypatch.setattr(ingest, "CHUNK_BYTES", 61)  # lines run across chunks read, and across parts stored
    monkeypatch.setattr(files, "PART_BYTES", 97)
    stack = make_stack(with_worker=False)
    bad = {7: "invalid_json", 8: "invalid_line", 14: "duplicate_custom_id", 15: "model_not_found",
           22: "line_too_large", 28: "invalid_request", 29: "duplicate_custom_id", 36: "invalid_request"}
    special = {7: '{"custom_id": "r-7", "method": ', 8: line(None, "fp32"), 14: line("r-3", "fp32"),
               15: line("r-15", "gpt-9"), 21: "", 22: line("r-22", "fp32", prompt="y" * 400),
               28: line("r-28", "fp32", max_tokens=-1), 29: line("r-27", "fp32"),
               36: line("r-36", "fp32").replace('"temperature": 0', '"temperature": 0, "stream": true')}
    text = "\n".join(special.get(i, line(f"r-{i}", "fp32", prompt=f"story {i}")) for i in range(1, 41))
    job = make_job(stack, text.encode())  # NOTE: the last line has no newline
    for _ in range(6):  # slices of 7 lines: borders after lines 7, 14, 21, 28 and 35
        step(stack, job, per_step=7, max_line_bytes=300)
    good = {f"r-{i}" for i in range(1, 41)} - {f"r-{i}" for i in (*bad, 21)}
    assert_every_line_once(stack, job, good, bad, num_lines=40)
    with session_scope(stack.runtime.sessions) as session:
        prompts = dict(session.execute(select(RequestRow.custom_id, RequestRow.prompt)
                                       .where(RequestRow.batch_job_id == job.id)).all())
    assert prompts == {custom_id: f"story {custom_id[2:]}" for custom_id in good}  # no line cut or glued
    duplicate = line_errors(stack, job)[29]
    assert duplicate.custom_id == "r-27" and "used by an earlier line" in duplicate.message


class DyingCatalog:
    """The serving configs, until the n-th look-up: then the process dies (SystemExit), mid-slice."""

    def __init__(self, catalog: Catalog, *, dies_at: int) -> None:
        self.catalog, self.left = catalog, dies_at

    def get(self, name: str):
        self.left -= 1
        if self.left == 0:
            raise SystemExit("killed mid-slice")
        return self.catalog.get(name)


def test_a_slice_killed_mid_way_leaves_nothing_and_the_resumed_job_has_every_line_once(make_stack) -> None:
    stack = make_stack(with_worker=False)
    content, good, bad = mixed_file("fp32", 300)
    job = make_job(stack, content)
    assert step(stack, job, per_step=100).num_lines == 100
    with session_scope(stack.runtime.sessions) as session:
        catalog = load_catalog(session, configs_dir=stack.settings.configs_dir, live_since=datetime.now(UTC))
    with pytest.raises(SystemExit):  # rows of the second slice are being copied in when it dies
        step(stack, job, per_step=100, catalog=DyingCatalog(catalog, dies_at=60))
    with session_scope(stack.runtime.sessions) as session:
        assert jobs.get_job(session, job_id=job.id).num_lines == 100
        assert len(list(jobs.iter_job_requests(session, job_id=job.id))) == 98  # the first slice's only
    ingest_all(stack, job, per_step=100)
    assert_every_line_once(stack, job, good, bad, num_lines=300)


INGEST_PROCESS = """
import sys, uuid
from servelab.jobs.ingest import IngestLimits, ingest_for
from servelab.queue.streams import RequestStreams
from servelab.runtime import connect
from servelab.settings import ServiceSettings

settings = ServiceSettings()
runtime = connect(settings, migrate=False)
ingest_for(sessions=runtime.sessions, job_id=uuid.UUID(sys.argv[1]), configs_dir=settings.configs_dir,
           streams_for=lambda name: RequestStreams(runtime.redis, prefix=settings.key_prefix, config_name=name),
           worker_live_s=30.0, max_s=600.0,
           limits=IngestLimits(max_prompt_chars=settings.max_prompt_chars, max_job_in_flight=1_000_000,
                               max_line_bytes=settings.max_request_bytes, max_lines_per_step=25))
"""


def test_a_jobs_worker_killed_while_ingesting_resumes_without_duplicates_or_losses(make_stack) -> None:
    stack = make_stack(with_worker=False)
    content, good, bad = mixed_file("fp32", 4_000)
    job = make_job(stack, content)
    process = subprocess.Popen([sys.executable, "-c", INGEST_PROCESS, str(job.id)], cwd=REPO,
                               env=service_env(stack.settings))
    try:
        wait_until(lambda: read_job(stack, job).num_lines >= 500 or process.poll() is not None, timeout_s=120)
        assert process.poll() is None, "the ingest process ended before it was killed"
    finally:
        process.kill()  # SIGKILL: between two slices, or in the middle of one
        process.wait()
    killed = read_job(stack, job)
    assert not killed.is_ingested and killed.num_lines % 25 == 0, "killed mid-ingest, at a slice's end"
    ingest_all(stack, job, per_step=500)
    assert_every_line_once(stack, job, good, bad, num_lines=4_000, may_miss_entries=True)


def read_job(stack, job) -> jobs.StoredJob:
    with session_scope(stack.runtime.sessions) as session:
        return jobs.get_job(session, job_id=job.id)


def finalise_measured(stack, num_lines: int) -> tuple[jobs.StoredJob, int]:
    """A job of num_lines answered requests finalised -> (the job, Python's peak allocations while it was)."""
    job = make_job(stack, "\n".join(line(f"r{i}", "fp32") for i in range(num_lines)).encode())
    ingest_all(stack, job, per_step=2_000)
    answer_every_request(stack.runtime, job.id)
    tracemalloc.start()
    try:
        assert advance_job(sessions=stack.runtime.sessions, job_id=job.id, now=datetime.now(UTC)) \
            is BatchStatus.COMPLETED
        return read_job(stack, job), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_output_file_is_written_a_part_at_a_time_in_memory_that_does_not_grow_with_it(make_stack,
                                                                                          monkeypatch) -> None:
    monkeypatch.setattr(files, "PART_BYTES", 64 * 1024)
    stack = make_stack(with_worker=False)
    _, small_peak = finalise_measured(stack, 1_500)
    job, large_peak = finalise_measured(stack, 6_000)
    with session_scope(stack.runtime.sessions) as session:
        output = files.get_file(session, file_id=job.output_file_id, tenant="acme")
        parts = session.scalars(select(func.octet_length(FilePartRow.content))
                                .where(FilePartRow.file_id == output.id).order_by(FilePartRow.byte_offset)).all()
        content = files.read_content(session, file_id=output.id, tenant="acme")
    # NOTE: what finalise holds is a page of rows and a part, whatever the file's size (built whole, the file
    # would make the peak grow four times with it)
    assert large_peak < 1.5 * small_peak and large_peak < output.num_bytes / 2, (small_peak, large_peak)
    assert max(parts) == files.PART_BYTES and sum(parts) == len(content) == output.num_bytes > 40 * files.PART_BYTES
    assert sorted(json.loads(x)["custom_id"] for x in content.splitlines()) == sorted(f"r{i}" for i in range(6_000))
