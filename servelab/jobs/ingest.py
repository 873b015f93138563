"""Batch-file ingest: read the input file a step at a time, validate every line, create and enqueue requests.

Knows the OpenAI batch line format ({"custom_id", "method": "POST", "url", "body"}), the reasons a line is
refused (each becomes an error-file line), and back-pressure: a step creates at most as many requests as
the job may still have unfinished, so a 100,000-line file never floods Redis or memory. A step's rows,
bad lines and file offset commit together, so a re-run step (a crashed task) resumes exactly there.
Does not know Celery: worker/jobs.py calls ingest_step until it reports done.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from itertools import islice
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy.orm import Session, sessionmaker

from servelab.config import describe_validation_error
from servelab.protocol import Rejection, body_model, to_submission
from servelab.jobs.catalog import Catalog, load_catalog
from servelab.queue.streams import RequestStreams
from servelab.store import batch_jobs as store
from servelab.store import files
from servelab.store.db import session_scope
from servelab.store.models import BatchStatus, StreamKind

CHUNK_BYTES = 1 << 20  # read from the file at a time
TOO_LONG = None  # stands for a line longer than the line limit in a step's list of lines


class BatchLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class IngestLimits:
    max_prompt_chars: int
    max_job_in_flight: int
    max_line_bytes: int
    max_lines_per_step: int = 500


@dataclass(frozen=True)
class IngestStep:
    num_lines: int = 0
    num_enqueued: int = 0
    num_bad_lines: int = 0
    is_done: bool = False  # the whole file is read, or the job no longer takes lines
    is_throttled: bool = False  # the job has max_job_in_flight unfinished requests: try again later


def parse_line(raw: bytes | None, *, line_no: int, endpoint: str, catalog: Catalog, max_prompt_chars: int,
               max_line_bytes: int) -> store.NewRequest | store.LineError:
    """One line -> a request to create, or the reason it is refused."""
    def refuse(code: str, message: str, custom_id: str | None = None) -> store.LineError:
        return store.LineError(line_no, custom_id, code, message)

    if raw is TOO_LONG:
        return refuse("line_too_large", f"the line is longer than {max_line_bytes} bytes")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return refuse("invalid_json", f"the line is not valid JSON: {exc}")
    custom_id = data.get("custom_id") if isinstance(data, dict) else None
    custom_id = custom_id if isinstance(custom_id, str) and custom_id else None
    try:
        line = BatchLine.model_validate(data)
    except ValidationError as exc:
        return refuse("invalid_line", describe_validation_error(exc), custom_id)
    if line.url != endpoint:
        return refuse("invalid_url", f"url is {line.url!r}; every line of this batch must use {endpoint!r}",
                      custom_id)
    try:
        body = body_model(endpoint).model_validate(line.body)
        if body.stream:
            raise Rejection("a batch line cannot stream; send stream: false (its answer goes to the output file)",
                            param="stream")
        submission = to_submission(body, catalog=catalog, max_prompt_chars=max_prompt_chars)
    except ValidationError as exc:
        return refuse("invalid_request", "body." + describe_validation_error(exc), custom_id)
    except Rejection as exc:
        return refuse(exc.code, str(exc), custom_id)
    return store.NewRequest(line.custom_id, submission.serving_config_name, submission.prompt,
                            submission.messages, submission.sampling)


def iter_lines(session: Session, *, file: files.StoredFile, offset: int, max_line_bytes: int
               ) -> Iterator[tuple[bytes | None, int]]:
    """The lines from offset on (blank ones included), each with the offset after it, read a chunk at a time;
    a line longer than max_line_bytes is TOO_LONG and never held whole."""
    pending: list[bytes] = []  # the start of a line that runs past the chunk read so far
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
                piece = TOO_LONG if is_too_long else b"".join([*pending, piece])
                pending, pending_bytes, is_too_long = [], 0, False
            elif len(piece) > max_line_bytes:
                piece = TOO_LONG
            yield piece, end
        at += len(chunk)
        is_too_long = is_too_long or pending_bytes + len(rest) > max_line_bytes
        pending, pending_bytes = ([], 0) if is_too_long else ([*pending, rest], pending_bytes + len(rest))
    if pending_bytes or is_too_long:  # the last line has no newline
        yield (TOO_LONG if is_too_long else b"".join(pending)), file.num_bytes


def read_lines(session: Session, *, file: files.StoredFile, offset: int, max_lines: int, max_line_bytes: int
               ) -> tuple[list[bytes | None], int]:
    """Up to max_lines lines from offset (blank ones included) -> (lines, the offset after them)."""
    lines, end = [], offset
    for line, end in islice(iter_lines(session, file=file, offset=offset, max_line_bytes=max_line_bytes), max_lines):
        lines.append(line)
    return lines, end


def ingest_step(*, sessions: sessionmaker[Session], streams_for: Callable[[str], RequestStreams],
                job_id: uuid.UUID, configs_dir: Path, live_since: datetime, limits: IngestLimits,
                now: datetime) -> IngestStep:
    """Read, validate and create one step of lines, commit, then enqueue what was created."""
    with session_scope(sessions) as session:
        job = store.get_job(session, job_id=job_id, for_update=True)  # NOTE: one ingest step per job at a time
        if job is None or job.is_ingested or job.status not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
            return IngestStep(is_done=True)
        room = min(limits.max_lines_per_step, limits.max_job_in_flight - store.num_unfinished(session, job_id=job.id))
        if room <= 0:
            return IngestStep(is_throttled=True)
        file = files.get_file(session, file_id=job.input_file_id, tenant=job.tenant)
        if file is None:
            store.move_job(session, job_id=job.id, from_statuses=(job.status,), to=BatchStatus.FAILED, now=now,
                           errors=[{"code": "file_not_found", "message": f"input file {job.input_file_id} is gone"}])
            return IngestStep(is_done=True)
        catalog = load_catalog(session, configs_dir=configs_dir, live_since=live_since)
        raw_lines, offset = read_lines(session, file=file, offset=job.ingest_offset, max_lines=room,
                                       max_line_bytes=limits.max_line_bytes)
        created, bad = _create(session, job=job, raw_lines=raw_lines, catalog=catalog, limits=limits)
        is_ingested = offset >= file.num_bytes
        store.update_job(session, job_id=job.id, ingest_offset=offset, num_lines=job.num_lines + len(raw_lines),
                         is_ingested=is_ingested)
        if job.status is BatchStatus.VALIDATING:
            store.move_job(session, job_id=job.id, from_statuses=(BatchStatus.VALIDATING,),
                           to=BatchStatus.IN_PROGRESS, now=now)
    enqueue_bulk(streams_for, created)
    return IngestStep(len(raw_lines), len(created), bad, is_done=is_ingested)


def _create(session: Session, *, job: store.StoredJob, raw_lines: list[bytes | None], catalog: Catalog,
            limits: IngestLimits) -> tuple[list[tuple[str, str]], int]:
    """Create this step's requests and record its bad lines -> ([(request id, config name)], number bad)."""
    good: dict[str, tuple[int, store.NewRequest]] = {}
    errors: list[store.LineError] = []
    for i, raw in enumerate(raw_lines):
        line_no = job.num_lines + i + 1
        if raw is not TOO_LONG and not raw.strip():
            continue  # NOTE: blank lines (a trailing newline) are not requests
        parsed = parse_line(raw, line_no=line_no, endpoint=job.endpoint, catalog=catalog,
                            max_prompt_chars=limits.max_prompt_chars, max_line_bytes=limits.max_line_bytes)
        if isinstance(parsed, store.LineError):
            errors.append(parsed)
        elif parsed.custom_id in good:
            errors.append(_duplicate(line_no, parsed.custom_id))
        else:
            good[parsed.custom_id] = (line_no, parsed)
    created, taken = store.add_requests(session, job=job, requests=[r for _, r in good.values()])
    errors += [_duplicate(good[custom_id][0], custom_id) for custom_id in taken]
    store.add_line_errors(session, job_id=job.id, errors=errors)
    names = {r.custom_id: r.serving_config_name for _, r in good.values()}
    return [(request_id, names[custom_id]) for custom_id, request_id in created.items()], len(errors)


def _duplicate(line_no: int, custom_id: str) -> store.LineError:
    return store.LineError(line_no, custom_id, "duplicate_custom_id",
                           f"custom_id {custom_id!r} is used by an earlier line; custom_ids must be unique")


def enqueue_bulk(streams_for: Callable[[str], RequestStreams], created: list[tuple[str, str]]) -> None:
    """Add committed request ids to their configs' bulk streams, one pipeline per config."""
    by_config: dict[str, list[str]] = {}
    for request_id, name in created:
        by_config.setdefault(name, []).append(request_id)
    for name, ids in by_config.items():
        streams_for(name).enqueue_many(ids, StreamKind.BULK)
