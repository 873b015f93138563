"""Batch-file ingest: read the input file a slice at a time, validate every line, create and enqueue requests.

Knows the OpenAI batch line format ({"custom_id", "method": "POST", "url", "body"}), the reasons a line is
refused (each becomes an error-file line), and back-pressure: a slice holds at most as many lines as the job
may still have unfinished requests, so a 100,000-line file never floods Redis or memory. A slice's rows,
bad lines and file offset commit together, so a re-run slice (a crashed task) resumes exactly there. A slice's
requests go out with the lines that share a prompt prefix together (servelab/jobs/prefix_groups.py).
Does not know Celery or the fair share: servelab/jobs/feed.py runs ingest_step for every job, each slice capped
by the job's share; ingest_for reads one job alone until its file is read (the ingest bench).
"""

from __future__ import annotations

import gc
import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import islice
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy.orm import Session, sessionmaker

from servelab.config import describe_validation_error
from servelab.protocol import (CHAT_COMPLETIONS, COMPLETIONS, ChatCompletionBody, CompletionBody, Rejection,
                               body_model, to_submission)
from servelab.catalog import Catalog, load_catalog
from servelab.jobs.prefix_groups import grouped_by_prefix, prefix_key
from servelab.request import UNKNOWN_BODY_FIELD, find_non_text
from servelab.queue.streams import RequestStreams
from servelab.store import batch_jobs as store
from servelab.store import files
from servelab.store.db import session_scope
from servelab.store.models import BatchStatus, StreamKind

CHUNK_BYTES = 1 << 20  # read from the file at a time
HEAD_BYTES = 4096  # what is kept of a line longer than the limit: its start, where its custom_id is read from


@dataclass(frozen=True)
class TooLong:
    """Stands for a line longer than the line limit in a slice's list of lines: only its first bytes are kept."""

    head: bytes = b""


TOO_LONG = TooLong()  # a too-long line whose start holds nothing readable
CATALOG_MAX_AGE_S = 5.0  # ingest_for reloads the serving configs this often: a new config is known this soon
THROTTLED_WAIT_S = 0.1
MAX_STEP_TRIES = 5  # a slice that fails this many times in a row fails its job (a lost database, a bug), never stalls it
STEP_RETRY_WAIT_S = 0.5  # then 1, 2, 4 s: a short outage of PostgreSQL or Redis is waited out
log = logging.getLogger(__name__)


class BatchLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


class CompletionLine(BatchLine):
    body: CompletionBody


class ChatCompletionLine(BatchLine):
    body: ChatCompletionBody


# NOTE: a line validated whole, body included, from its raw bytes by pydantic's compiled validator (one pass,
# no json.loads): the fast path for good lines. A line it refuses goes through parse_line_reference.
TYPED_LINES: dict[str, type[CompletionLine] | type[ChatCompletionLine]] = {
    COMPLETIONS: CompletionLine, CHAT_COMPLETIONS: ChatCompletionLine}


@dataclass(frozen=True)
class IngestLimits:
    max_prompt_chars: int
    max_job_in_flight: int
    max_line_bytes: int
    max_lines_per_step: int = 5_000


@dataclass(frozen=True)
class IngestStep:
    num_lines: int = 0
    num_enqueued: int = 0
    num_bad_lines: int = 0
    is_done: bool = False  # the whole file is read, or the job no longer takes lines
    is_throttled: bool = False  # the job has max_job_in_flight unfinished requests: try again later
    # (request id, config): what was (or is to be) enqueued, lines sharing a prefix together, else in file order
    created: tuple[tuple[str, str], ...] = ()


def parse_line(raw: bytes | TooLong, *, line_no: int, endpoint: str, catalog: Catalog, max_prompt_chars: int,
               max_line_bytes: int) -> store.NewRequest | store.LineError:
    """One line -> a request to create, or the reason it is refused (exactly parse_line_reference's answer)."""
    accepted = parse_line_fast(raw, endpoint=endpoint, catalog=catalog, max_prompt_chars=max_prompt_chars)
    if accepted is not None:
        return accepted
    # NOTE: refused lines are rare: the reference says why, in the words it always has
    return parse_line_reference(raw, line_no=line_no, endpoint=endpoint, catalog=catalog,
                                max_prompt_chars=max_prompt_chars, max_line_bytes=max_line_bytes)


def parse_line_fast(raw: bytes | TooLong, *, endpoint: str, catalog: Catalog,
                    max_prompt_chars: int) -> store.NewRequest | None:
    """A good line -> its request, from one pydantic pass over its bytes; None: not taken here (a refused line,
    or one of the few good ones this pass cannot read), so parse_line_reference answers it."""
    if isinstance(raw, TooLong):
        return None
    try:
        line = TYPED_LINES[endpoint].model_validate_json(raw)
        if line.url == endpoint and not line.body.stream and line.body.num_choices == 1:
            submission = to_submission(line.body, catalog=catalog, max_prompt_chars=max_prompt_chars)
            return store.NewRequest(line.custom_id, submission.serving_config_name, submission.prompt,
                                    submission.messages, submission.sampling)
    except (ValidationError, Rejection):
        pass
    return None


def parse_line_reference(raw: bytes | TooLong, *, line_no: int, endpoint: str, catalog: Catalog, max_prompt_chars: int,
                         max_line_bytes: int) -> store.NewRequest | store.LineError:
    """One line -> a request to create, or the reason it is refused: the envelope, the url, then the body."""
    def refuse(code: str, message: str, custom_id: str | None = None) -> store.LineError:
        return store.LineError(line_no, custom_id, code, message)

    if isinstance(raw, TooLong):
        return refuse("line_too_large", f"the line is longer than {max_line_bytes} bytes", opening_custom_id(raw.head))
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # NOTE: [[[[... nests past the stack
        return refuse("invalid_json", f"the line is not valid JSON: {exc}")
    custom_id = data.get("custom_id") if isinstance(data, dict) else None
    custom_id = custom_id if isinstance(custom_id, str) and custom_id and find_non_text(custom_id) is None else None
    non_text = find_non_text(data)
    if non_text is not None:  # NOTE: before any message could echo it: the error file is UTF-8 text too
        return refuse("invalid_text", non_text.message, custom_id)
    try:
        line = BatchLine.model_validate(data)
    except ValidationError as exc:
        return refuse("invalid_line", describe_validation_error(exc, unknown_hint=UNKNOWN_BODY_FIELD), custom_id)
    if line.url != endpoint:
        return refuse("invalid_url", f"url is {line.url!r}; every line of this batch must use {endpoint!r}",
                      custom_id)
    try:
        body = body_model(endpoint).model_validate(line.body)
        if body.stream:
            raise Rejection("a batch line cannot stream; send stream: false (its answer goes to the output file)",
                            param="stream")
        if body.num_choices > 1:  # NOTE: a line is one request row, keyed and counted by its custom_id
            raise Rejection(f"n is {body.num_choices}: a batch line asks for one choice; send one line per choice "
                            "(with seeds seed, seed + 1, ... for the answers an n-choice request gives)",
                            code="unsupported_parameter", param="n")
        submission = to_submission(body, catalog=catalog, max_prompt_chars=max_prompt_chars)
    except ValidationError as exc:
        return refuse("invalid_request", "body." + describe_validation_error(exc, unknown_hint=UNKNOWN_BODY_FIELD),
                      custom_id)
    except Rejection as exc:
        return refuse(exc.code, str(exc), custom_id)
    return store.NewRequest(line.custom_id, submission.serving_config_name, submission.prompt,
                            submission.messages, submission.sampling)


def opening_custom_id(head: bytes) -> str | None:
    """The custom_id a line opens with (`{"custom_id": "...", ...`, as the Batch format writes it), read from its first
    bytes alone; None when the line does not open so or the id is no usable text."""
    opening = re.match(rb'\s*\{\s*"custom_id"\s*:\s*', head)
    if opening is None:
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(head[opening.end():].decode("utf-8", errors="replace"))
    except ValueError:
        return None
    return value if isinstance(value, str) and value and find_non_text(value) is None and "\ufffd" not in value \
        else None


def iter_lines(session: Session, *, file: files.StoredFile, offset: int, max_line_bytes: int
               ) -> Iterator[tuple[bytes | TooLong, int]]:
    """The lines from offset on (blank ones included), each with the offset after it, read a chunk at a time;
    a line longer than max_line_bytes is a TooLong holding its first HEAD_BYTES, never held whole."""
    pending: list[bytes] = []  # the start of a line that runs past the chunk read so far
    head = b""  # that line's first bytes, kept when it turns out too long
    pending_bytes, is_too_long = 0, False
    at = offset
    while at < file.num_bytes:
        chunk = files.read_range(session, file_id=file.id, offset=at, num_bytes=CHUNK_BYTES)
        assert chunk, f"file {file.id} ends at {at}, before its {file.num_bytes} bytes"
        *whole, rest = chunk.split(b"\n")
        end = at
        for i, piece in enumerate(whole):
            end += len(piece) + 1
            if i == 0 and (pending or is_too_long):
                is_too_long = is_too_long or pending_bytes + len(piece) > max_line_bytes
                piece = TooLong((head + piece)[:HEAD_BYTES]) if is_too_long else b"".join([*pending, piece])
                pending, pending_bytes, is_too_long, head = [], 0, False, b""
            elif len(piece) > max_line_bytes:
                piece = TooLong(piece[:HEAD_BYTES])
            yield piece, end
        at += len(chunk)
        head = (head + rest)[:HEAD_BYTES]  # NOTE: rest starts a line, or goes on with the one in pending
        is_too_long = is_too_long or pending_bytes + len(rest) > max_line_bytes
        pending, pending_bytes = ([], 0) if is_too_long else ([*pending, rest], pending_bytes + len(rest))
    if pending_bytes or is_too_long:  # the last line has no newline
        yield (TooLong(head) if is_too_long else b"".join(pending)), file.num_bytes


def read_lines(session: Session, *, file: files.StoredFile, offset: int, max_lines: int, max_line_bytes: int
               ) -> tuple[list[bytes | TooLong], int]:
    """Up to max_lines lines from offset (blank ones included) -> (lines, the offset after them)."""
    lines, end = [], offset
    for line, end in islice(iter_lines(session, file=file, offset=offset, max_line_bytes=max_line_bytes), max_lines):
        lines.append(line)
    return lines, end


def ingest_step(*, sessions: sessionmaker[Session], streams_for: Callable[[str], RequestStreams],
                job_id: uuid.UUID, configs_dir: Path, live_since: datetime, limits: IngestLimits,
                now: datetime, catalog: Catalog | None = None, max_lines: int | None = None,
                enqueue: bool = True) -> IngestStep:
    """Read, validate and create one slice of lines, commit, then enqueue what was created. catalog: the
    serving configs lines may name; None loads them now. max_lines: the job's fair share of its configs'
    bulk queues this round (servelab/jobs/feed.py), a cap on the slice; None: no cap but the limits.
    enqueue False: the caller enqueues step.created (the feed interleaves the jobs' slices); a crash before
    it does leaves committed rows without an entry, which the reaper adds."""
    with session_scope(sessions) as session:
        job = store.get_job(session, job_id=job_id, for_update=True)  # NOTE: one ingest step per job at a time
        if job is None or job.is_ingested or job.status not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
            return IngestStep(is_done=True)
        room = _room(session, job, limits, max_lines)
        if room <= 0:
            return IngestStep(is_throttled=True)
        file = files.get_file(session, file_id=job.input_file_id, tenant=job.tenant)
        if file is None:
            store.move_job(session, job_id=job.id, from_statuses=(job.status,), to=BatchStatus.FAILED, now=now,
                           errors=[{"code": "file_not_found", "message": f"input file {job.input_file_id} is gone"}])
            return IngestStep(is_done=True)
        catalog = catalog or load_catalog(session, configs_dir=configs_dir, live_since=live_since)
        with collector_paused():
            raw_lines, offset = read_lines(session, file=file, offset=job.ingest_offset, max_lines=room,
                                           max_line_bytes=limits.max_line_bytes)
            created, bad = _create(session, job=job, raw_lines=raw_lines, catalog=catalog, limits=limits)
        is_ingested = offset >= file.num_bytes
        store.update_job(session, job_id=job.id, ingest_offset=offset, num_lines=job.num_lines + len(raw_lines),
                         is_ingested=is_ingested)
        if job.status is BatchStatus.VALIDATING:
            store.move_job(session, job_id=job.id, from_statuses=(BatchStatus.VALIDATING,),
                           to=BatchStatus.IN_PROGRESS, now=now)
    if enqueue:
        enqueue_bulk(streams_for, created)
    return IngestStep(len(raw_lines), len(created), bad, is_done=is_ingested, created=tuple(created))


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a block, then back as it was.

    NOTE: a slice keeps tens of thousands of small containers alive at once (its lines' bodies, messages and
    rows); while they pile up the collector runs full passes over the whole heap, which took about 40 % of the
    ingesting process's CPU (`servelab bench ingest`: 40-48 against 26-27 us a line). A slice makes no
    reference cycles, so its objects are freed by reference counting when it ends and nothing waits for
    the collector, which runs again after the slice.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _room(session: Session, job: store.StoredJob, limits: IngestLimits, max_lines: int | None = None) -> int:
    """Lines this slice may read: a slice (or the job's share, max_lines), or fewer when the job is near its
    in-flight limit."""
    cap = limits.max_lines_per_step if max_lines is None else min(max_lines, limits.max_lines_per_step)
    # NOTE: a job cannot have more unfinished requests than lines read, so while that stays a slice below the
    # limit the count (a scan of the job's rows) is skipped.
    if job.num_lines + cap <= limits.max_job_in_flight:
        return cap
    return min(cap, limits.max_job_in_flight - store.num_unfinished(session, job_id=job.id))


def ingest_for(*, sessions: sessionmaker[Session], streams_for: Callable[[str], RequestStreams], job_id: uuid.UUID,
               configs_dir: Path, worker_live_s: float, limits: IngestLimits, max_s: float,
               max_tries: int = MAX_STEP_TRIES) -> int:
    """Ingest slices for up to max_s seconds, waiting out back-pressure; -> the number of lines read. A slice that
    fails max_tries times in a row fails the job, with the reason in its errors (see fail_ingest)."""
    deadline = time.monotonic() + max_s
    catalog, catalog_at, num_lines, num_failed = None, 0.0, 0, 0
    while time.monotonic() < deadline:
        now = datetime.now(UTC)
        live_since = now - timedelta(seconds=worker_live_s)
        try:
            if catalog is None or time.monotonic() - catalog_at > CATALOG_MAX_AGE_S:
                with session_scope(sessions) as session:
                    catalog = load_catalog(session, configs_dir=configs_dir, live_since=live_since)
                catalog_at = time.monotonic()
            step = ingest_step(sessions=sessions, streams_for=streams_for, job_id=job_id, configs_dir=configs_dir,
                               live_since=live_since, limits=limits, now=now, catalog=catalog)
        except Exception as exc:  # NOTE: whatever it is, the same slice fails again: tries are counted, not kinds
            num_failed += 1
            log.warning("ingest of job %s failed (try %d of %d): %r", job_id, num_failed, max_tries, exc)
            if num_failed >= max_tries:
                fail_ingest(sessions=sessions, job_id=job_id, reason=exc, num_tries=num_failed, now=now)
                break
            time.sleep(min(STEP_RETRY_WAIT_S * 2 ** (num_failed - 1), max(0.0, deadline - time.monotonic())))
            continue
        num_failed = 0
        num_lines += step.num_lines
        if step.is_done:
            break
        if step.is_throttled:
            time.sleep(THROTTLED_WAIT_S)
    return num_lines


def fail_ingest(*, sessions: sessionmaker[Session], job_id: uuid.UUID, reason: BaseException, num_tries: int,
                now: datetime) -> bool:
    """The job fails (a slice of its file could not be ingested), its queued requests are cancelled (started ones
    finish) and `errors` says why and from which line; -> whether it moved (an ended job stays as it is)."""
    with session_scope(sessions) as session:
        job = store.get_job(session, job_id=job_id, for_update=True)
        if job is None or job.status not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
            return False
        message = (f"ingest failed {num_tries} times in a row at line {job.num_lines + 1} of the input file: "
                   f"{type(reason).__name__}: {str(reason).splitlines()[0] if str(reason) else ''}")
        store.cancel_queued(session, job_id=job.id, reason=f"batch_failed: {message}", now=now)
        return store.move_job(session, job_id=job.id, from_statuses=(job.status,), to=BatchStatus.FAILED, now=now,
                              errors=[{"code": "ingest_failed", "message": message, "line": job.num_lines + 1}])


def _create(session: Session, *, job: store.StoredJob, raw_lines: list[bytes | TooLong], catalog: Catalog,
            limits: IngestLimits) -> tuple[list[tuple[str, str]], int]:
    """Create this slice's requests and record its bad lines -> ([(request id, config name)] with the lines that
    share a prompt prefix together, in file order within a group, number bad)."""
    good: dict[str, tuple[int, store.NewRequest]] = {}
    errors: list[store.LineError] = []

    def new_requests() -> Iterator[store.NewRequest]:
        for i, raw in enumerate(raw_lines):
            line_no = job.num_lines + i + 1
            if not isinstance(raw, TooLong) and not raw.strip():
                continue  # NOTE: blank lines (a trailing newline) are not requests
            parsed = parse_line(raw, line_no=line_no, endpoint=job.endpoint, catalog=catalog,
                                max_prompt_chars=limits.max_prompt_chars, max_line_bytes=limits.max_line_bytes)
            if isinstance(parsed, store.LineError):
                errors.append(parsed)
            elif parsed.custom_id in good:
                errors.append(_duplicate(line_no, parsed.custom_id))
            else:
                good[parsed.custom_id] = (line_no, parsed)
                yield parsed

    # NOTE: lines are parsed as the store copies them in: PostgreSQL inserts one line's row while the next is parsed
    added = store.add_requests(session, job=job, requests=new_requests())
    errors += [_duplicate(good[custom_id][0], custom_id) for custom_id in added.taken]
    errors += [store.LineError(good[custom_id][0], custom_id, "unstorable_line", why)
               for custom_id, why in added.unstorable.items()]
    store.add_line_errors(session, job_id=job.id, errors=sorted(errors, key=lambda e: e.line_no))
    ordered = grouped_by_prefix(good.values(), key=lambda found: prefix_key(found[1].prompt, found[1].messages))
    return ([(added.created[r.custom_id], r.serving_config_name) for _, r in ordered if r.custom_id in added.created],
            len(errors))


def _duplicate(line_no: int, custom_id: str) -> store.LineError:
    return store.LineError(line_no, custom_id, "duplicate_custom_id",
                           f"custom_id {custom_id!r} is used by an earlier line; custom_ids must be unique")


def enqueue_bulk(streams_for: Callable[[str], RequestStreams], created: list[tuple[str, str]]) -> None:
    """Add committed request ids to their configs' bulk streams, one round trip per config."""
    by_config: dict[str, list[str]] = {}
    for request_id, name in created:
        by_config.setdefault(name, []).append(request_id)
    for name, ids in by_config.items():
        streams_for(name).enqueue_many(ids, StreamKind.BULK)
