"""Any text a request may carry (NUL, control characters, the escape's own mark, every plane) is stored and read
back exactly, on every path a request row is written (the API's admission, a batch file's COPY, the ORM) and read;
a row PostgreSQL still refuses becomes its line's error, never the slice's failure."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelab.request import SamplingParams
from servelab.store import batch_jobs as jobs
from servelab.store import files
from servelab.store import requests as request_store
from servelab.store.admission import NewRequest, admit_requests
from servelab.store.models import StreamKind
from servelab.store.pgtext import MARK, from_column, json_from_column, json_to_column, to_column

# Unicode text: every code point but the lone surrogates (which are not text: the edges refuse them), with the
# characters PostgreSQL refuses or the escape uses drawn often.
TEXT_CHARS = st.one_of(st.sampled_from(["\x00", MARK, "0", "\x01", "\x7f", "\u2028", "\U0010ffff"]),
                       st.characters(exclude_categories=("Cs",)))
TEXT = st.text(TEXT_CHARS, max_size=30)
SLOW = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@given(TEXT)
@settings(max_examples=2_000, database=None)
def test_the_escape_reads_back_every_text_and_holds_no_nul(text: str) -> None:
    kept = to_column(text)
    assert "\x00" not in kept
    assert from_column(kept) == text
    assert kept == text or kept.startswith(MARK)
    assert json_from_column(json_to_column({text: [text, 1, None]})) == {text: [text, 1, None]}


def test_text_without_nul_or_the_mark_is_stored_as_it_is() -> None:
    for text in ("", "hello", "tab\tnew\nline", f"a{MARK}", "\\u0000", "€ 😀"):
        assert to_column(text) == text


@given(prompt=TEXT, content=TEXT, stop=st.lists(TEXT.filter(bool), max_size=4))
@SLOW
def test_admitted_requests_read_back_exactly(session, prompt: str, content: str, stop: list[str]) -> None:
    sampling = SamplingParams(max_new_tokens=4, stop=tuple(stop))
    asked = [NewRequest("t", "fp32", StreamKind.INTERACTIVE, prompt, None, sampling),
             NewRequest("t", "fp32", StreamKind.INTERACTIVE, None, [{"role": "user", "content": content}], sampling)]
    assert admit_requests(session, asked, max_queued=1_000_000) == {r.id for r in asked}
    session.expire_all()
    loaded = request_store.load_requests(session, [r.id for r in asked])
    assert loaded[asked[0].id].prompt == prompt
    assert loaded[asked[1].id].messages == [{"role": "user", "content": content}]
    assert all(SamplingParams.from_stored(loaded[r.id].sampling) == sampling for r in asked)


@given(custom_id=TEXT.filter(bool), prompt=TEXT, stop=st.lists(TEXT.filter(bool), max_size=4))
@SLOW
def test_copied_batch_rows_and_line_errors_read_back_exactly(session, custom_id: str, prompt: str,
                                                              stop: list[str]) -> None:
    job = _job(session)
    sampling = SamplingParams(max_new_tokens=4, stop=tuple(stop))
    added = jobs.add_requests(session, job=job, requests=[
        jobs.NewRequest(custom_id, "fp32", prompt, None, sampling),
        jobs.NewRequest(custom_id + "m", "fp32", None, [{"role": "user", "content": prompt}], sampling)])
    jobs.add_line_errors(session, job_id=job.id, errors=[jobs.LineError(9, custom_id, "x", prompt)])
    assert added.unstorable == {} and set(added.created) == {custom_id, custom_id + "m"}
    session.expire_all()
    loaded = request_store.load_requests(session, list(added.created.values()))
    stored = {r.custom_id: r for r in jobs.iter_job_requests(session, job_id=job.id)}
    line_errors = list(jobs.iter_line_errors(session, job_id=job.id))
    first, second = loaded[added.created[custom_id]], loaded[added.created[custom_id + "m"]]
    assert first.prompt == prompt and second.messages == [{"role": "user", "content": prompt}]
    assert SamplingParams.from_stored(first.sampling) == sampling
    assert set(stored) == {custom_id, custom_id + "m"}
    assert line_errors == [jobs.LineError(9, custom_id, "x", prompt)]


def test_a_row_postgresql_refuses_is_its_lines_error_and_the_others_are_stored(session) -> None:
    job = _job(session)
    # NOTE: a lone surrogate, past the edges that refuse it: psycopg cannot encode it, so the COPY fails
    asked = [jobs.NewRequest(f"r{i}", "fp32", "fine" if i != 3 else "bad \ud800", None, SamplingParams())
             for i in range(6)]
    added = jobs.add_requests(session, job=job, requests=iter(asked))
    assert set(added.created) == {"r0", "r1", "r2", "r4", "r5"} and added.taken == []
    assert list(added.unstorable) == ["r3"] and "could not be stored" in added.unstorable["r3"]
    assert {r.custom_id for r in jobs.iter_job_requests(session, job_id=job.id)} == set(added.created)


def _job(session) -> jobs.StoredJob:
    f = files.create_file(session, tenant="t", purpose="batch", filename=f"{uuid.uuid4()}.jsonl", content=b"x")
    return jobs.create_job(session, tenant="t", endpoint="/v1/completions", input_file_id=f.id,
                           completion_window="24h", metadata=None, expires_at=datetime.now(UTC) + timedelta(hours=1))
