"""Batch lines carrying any text, over the whole Unicode range, control characters included: each becomes a request
that reads back exactly, or that line's error (a lone surrogate: `invalid_text`); the ingest never stalls, and one
that keeps failing fails its job with the reason in `errors`. Real PostgreSQL and Redis."""

from __future__ import annotations

import json

from sqlalchemy import delete
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelab.jobs.ingest import IngestLimits, ingest_for
from servelab.queue.streams import RequestStreams
from servelab.request import SamplingParams
from servelab.store import batch_jobs as jobs
from servelab.store import requests as request_store
from servelab.store.db import session_scope
from servelab.store.models import BatchStatus, FilePartRow
from tests.api.test_text import ANY_TEXT, is_text
from tests.jobs.conftest import COMPLETIONS, line, make_job
from tests.jobs.test_batch_jobs import read_jsonl, wait_for_status
from tests.jobs.test_ingest import ingest_all, line_errors


def record(custom_id: str, model: str, prompt: str, stop: list[str]) -> bytes:
    body = {"model": model, "prompt": prompt, "stop": stop, "max_tokens": 2, "temperature": 0}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": body}).encode()


@given(lines=st.lists(st.tuples(ANY_TEXT, ANY_TEXT, st.lists(ANY_TEXT, max_size=2)), min_size=1, max_size=6,
                      unique_by=lambda t: t[0]))
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_every_line_is_a_request_read_back_exactly_or_its_lines_error(make_stack, lines) -> None:
    stack = make_stack(with_worker=False)
    job = make_job(stack, b"\n".join(record(c, "fp32", p, s) for c, p, s in lines) + b"\n")
    ingest_all(stack, job)
    errors = line_errors(stack, job)
    with session_scope(stack.runtime.sessions) as session:
        stored = {r.custom_id: r for r in jobs.iter_job_requests(session, job_id=job.id)}
        loaded = request_store.load_requests(session, [r.id for r in stored.values()])
    for line_no, (custom_id, prompt, stop) in enumerate(lines, start=1):
        if all(is_text(t) for t in (custom_id, prompt, *stop)):
            assert line_no not in errors, errors[line_no]
            row = loaded[stored[custom_id].id]
            assert row.prompt == prompt and SamplingParams.from_stored(row.sampling).stop == tuple(stop)
        else:
            assert errors[line_no].code == "invalid_text" and "lone surrogate" in errors[line_no].message
            assert errors[line_no].custom_id == (custom_id if is_text(custom_id) else None)
    assert len(stored) + len(errors) == len(lines)


def test_a_file_with_such_lines_among_good_ones_completes_every_line_answered_once(jobs_worker) -> None:
    stack = jobs_worker
    model = stack.model
    served = {"nul-prompt": record("nul-prompt", model, "a\x00b", []),
              "nul\x00id": record("nul\x00id", model, "story", []),
              "nul-stop": record("nul-stop", model, "story", ["\x00", "\x00\x00"]),
              "controls": record("controls", model, "".join(map(chr, range(32))) + "\x7f\u2028\ufdd0", [])}
    refused = {"invalid_text": [record("surrogate-prompt", model, "a\ud800", []),
                                record("x\udfff", model, "story", []),
                                record("surrogate-stop", model, "story", ["\udc00"]),
                                line("raw-surrogate", model).replace("once upon", "\udead")
                                .encode("utf-8", "surrogatepass")],
               "invalid_json": [b'{"custom_id": "bad-byte\xff", "method": "POST"}']}
    good = {f"good-{i}": line(f"good-{i}", model).encode() for i in range(6)}
    content = [*good.values(), *served.values(), *(r for records in refused.values() for r in records)]
    job = make_job(stack, b"\n".join(content) + b"\n")
    done = wait_for_status(stack, job.id)
    assert done.status is BatchStatus.COMPLETED, done.errors
    output, errors = read_jsonl(stack, done.output_file_id), read_jsonl(stack, done.error_file_id)
    answered = [o["custom_id"] for o in output]
    assert sorted(answered) == sorted([*good, *served]), "every good line answered, once"
    assert all(o["response"]["status_code"] == 200 for o in output)
    first_bad = len(good) + len(served) + 1
    expected = {first_bad + i: code for i, code in enumerate(c for c, records in refused.items() for _ in records)}
    assert {e["line"]: e["error"]["code"] for e in errors} == expected
    assert done.request_counts == {"total": len(content), "completed": len(good) + len(served),
                                   "failed": len(expected)}


def test_an_ingest_that_keeps_failing_fails_its_job_with_the_reason(make_stack) -> None:
    stack = make_stack(with_worker=False)
    job = make_job(stack, b"\n".join(line(f"r{i}", "fp32").encode() for i in range(3)) + b"\n")
    with session_scope(stack.runtime.sessions) as session:  # NOTE: the file's bytes are lost: every slice fails
        session.execute(delete(FilePartRow).where(FilePartRow.file_id == job.input_file_id))
    lines_read = ingest_for(sessions=stack.runtime.sessions, job_id=job.id, configs_dir=stack.settings.configs_dir,
                            streams_for=lambda name: RequestStreams(stack.runtime.redis, prefix=stack.settings.key_prefix,
                                                                    config_name=name),
                            worker_live_s=30, limits=IngestLimits(max_prompt_chars=1_000, max_job_in_flight=100,
                                                                  max_line_bytes=10_000), max_s=60, max_tries=3)
    assert lines_read == 0
    with session_scope(stack.runtime.sessions) as session:
        failed = jobs.get_job(session, job_id=job.id)
    assert failed.status is BatchStatus.FAILED and failed.timestamps["failed_at"] is not None
    [error] = failed.errors
    assert error["code"] == "ingest_failed" and error["line"] == 1, error
    assert "3 times" in error["message"] and "AssertionError" in error["message"], error
