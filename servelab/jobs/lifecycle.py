"""A bulk job's lifecycle after ingest: cancel, expire, finalise (the output and error files), and advance.

Knows the OpenAI statuses and the order they come in, that every line of the input file ends in exactly
one of the two files (matched by custom_id), and that each step is a conditional move of the job row, so
running any of them twice changes nothing. Does not know Celery or HTTP.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from itertools import islice

from sqlalchemy.orm import Session, sessionmaker

from servelab.protocol import Answer, Choice, is_tool_call, response_object
from servelab.jobs.ingest import iter_lines
from servelab.store import batch_jobs as store
from servelab.store import files
from servelab.store.db import session_scope
from servelab.store.models import BatchStatus, RequestStatus

OUTPUT_PURPOSE = "batch_output"
MAX_WINDOW = timedelta(days=7)
WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
UNREAD_LINES_PER_INSERT = 5_000


class NotCancellable(ValueError):
    """The job has ended, or is writing its files: cancelling it would change nothing."""


@dataclass(frozen=True)
class Counts:
    num_output_lines: int
    num_error_lines: int
    usage: store.TokenUsage  # of the output lines' requests


def parse_window(window: str) -> timedelta:
    """'24h' (OpenAI's only value), or any whole number of s / m / h / d up to 7 days."""
    unit = WINDOW_UNITS.get(window[-1:]) if window else None
    if unit is None or not window[:-1].isdigit() or int(window[:-1]) < 1:
        raise ValueError(f"completion_window must look like '24h' (a whole number and s, m, h or d), got {window!r}")
    span = timedelta(seconds=int(window[:-1]) * unit)
    if span > MAX_WINDOW:
        raise ValueError(f"completion_window is at most 7d, got {window!r}")
    return span


def cancel_job(session: Session, *, job_id: uuid.UUID, tenant: str, now: datetime) -> store.StoredJob | None:
    """Stop ingest and drop queued requests; started ones finish and their results are kept. None: no such job."""
    job = store.get_job(session, job_id=job_id, tenant=tenant, for_update=True)
    if job is None:
        return None
    if job.status is BatchStatus.CANCELLING:
        return job
    if not store.move_job(session, job_id=job.id, from_statuses=(BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS),
                          to=BatchStatus.CANCELLING, now=now):
        raise NotCancellable(f"batch {job.public_id} is {job.status.value} and can no longer be cancelled")
    store.cancel_queued(session, job_id=job.id, reason="batch_cancelled: the batch was cancelled before it ran",
                        now=now)
    return store.get_job(session, job_id=job.id)


def advance_job(*, sessions: sessionmaker[Session], job_id: uuid.UUID, now: datetime) -> BatchStatus | None:
    """Do whatever is due: expire, end a cancel, or finalise a job whose last request ended."""
    with session_scope(sessions) as session:
        job = store.get_job(session, job_id=job_id, for_update=True)
        if job is None or job.status.is_terminal:
            return job.status if job else None
        if job.status is not BatchStatus.FINALIZING and not _due(session, job, now):
            return job.status
    finalise(sessions=sessions, job_id=job_id, now=now)
    with session_scope(sessions) as session:
        return store.get_job(session, job_id=job_id).status


def _due(session: Session, job: store.StoredJob, now: datetime) -> bool:
    """Move the job to finalizing if it is time; True if it is (or was already) finalizing."""
    waiting = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING)
    if now >= job.timestamps["expires_at"]:
        # NOTE: started requests are not waited for: the window is over, they are written as expired.
        store.cancel_queued(session, job_id=job.id, reason="batch_expired: the completion window ended first",
                            now=now)
        return store.move_job(session, job_id=job.id, from_statuses=waiting, to=BatchStatus.FINALIZING, now=now,
                              expired_at=now)
    if job.status is BatchStatus.CANCELLING:
        store.cancel_queued(session, job_id=job.id, reason="batch_cancelled: the batch was cancelled before it ran",
                            now=now)
        running = store.num_unfinished(session, job_id=job.id, statuses=(RequestStatus.RUNNING,))
        return running == 0 and store.move_job(session, job_id=job.id, from_statuses=(BatchStatus.CANCELLING,),
                                               to=BatchStatus.FINALIZING, now=now)
    if job.status is BatchStatus.IN_PROGRESS and job.is_ingested and store.num_unfinished(session, job_id=job.id) == 0:
        return store.move_job(session, job_id=job.id, from_statuses=(BatchStatus.IN_PROGRESS,),
                              to=BatchStatus.FINALIZING, now=now)
    return False


def finalise(*, sessions: sessionmaker[Session], job_id: uuid.UUID, now: datetime) -> None:
    """Write the output and error files of a finalizing job and end it; a re-run writes the same files.

    NOTE: the files are written as they are built, a part at a time, from rows read through server-side
    cursors: a 50,000-line output is never held whole.
    """
    with session_scope(sessions) as session:
        job = store.get_job(session, job_id=job_id, for_update=True)
        if job is None or job.status is not BatchStatus.FINALIZING:
            return
        final = (BatchStatus.CANCELLED if job.timestamps["cancelling_at"] else
                 BatchStatus.EXPIRED if job.timestamps["expired_at"] else BatchStatus.COMPLETED)
        _answer_unread_lines(session, job, code=f"batch_{final.value}")
        output, errors = _writer(session, job, "output"), _writer(session, job, "errors")
        counts = _write_lines(session, job, final, output, errors)
        store.move_job(session, job_id=job.id, from_statuses=(BatchStatus.FINALIZING,), to=final, now=now,
                       output_file_id=_close(output), error_file_id=_close(errors),
                       request_counts={"total": counts.num_output_lines + counts.num_error_lines,
                                       "completed": counts.num_output_lines, "failed": counts.num_error_lines},
                       usage=counts.usage.as_dict())


def _answer_unread_lines(session: Session, job: store.StoredJob, *, code: str) -> None:
    """Lines never ingested (cancelled or expired first) each get an error line too, so every line is answered."""
    if job.is_ingested:
        return
    file = files.get_file(session, file_id=job.input_file_id, tenant=job.tenant)
    offset, num_lines = job.ingest_offset, job.num_lines
    lines = iter_lines(session, file=file, offset=offset, max_line_bytes=1 << 30) if file is not None else iter(())
    while batch := list(islice(lines, UNREAD_LINES_PER_INSERT)):
        errors = [store.LineError(num_lines + i + 1, _custom_id(raw), code, f"{code}: the line was never run")
                  for i, (raw, _) in enumerate(batch) if raw and raw.strip()]
        store.add_line_errors(session, job_id=job.id, errors=errors)
        num_lines, offset = num_lines + len(batch), batch[-1][1]
    store.update_job(session, job_id=job.id, ingest_offset=offset, num_lines=num_lines, is_ingested=True)


def _custom_id(raw: bytes) -> str | None:
    try:
        value = json.loads(raw).get("custom_id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _write_lines(session: Session, job: store.StoredJob, final: BatchStatus, output: files.FileWriter,
                 errors: files.FileWriter) -> Counts:
    num_output = num_errors = input_tokens = output_tokens = cached_tokens = 0
    for r in store.iter_job_requests(session, job_id=job.id):
        if r.status is RequestStatus.SUCCEEDED and r.text is not None:
            input_tokens += r.num_prompt_tokens
            output_tokens += r.num_generated_tokens
            cached_tokens += r.num_cached_tokens or 0
            answer = Answer(r.id, r.serving_config_name, int(r.finished_at.timestamp()), r.num_prompt_tokens,
                            (Choice.of_stored(r.text, r.finish_reason, r.num_generated_tokens, r.logprobs),),
                            r.num_cached_tokens or 0, tool_calls=is_tool_call(r.constraint))
            body = response_object(job.endpoint, answer)
            _line(output, r.id, r.custom_id, response={"status_code": 200, "request_id": r.id, "body": body})
            num_output += 1
            continue
        if r.status is RequestStatus.FAILED:
            code, message = "request_failed", r.error or "the request failed"
        elif r.status is RequestStatus.CANCELLED:
            code, message = (r.error or "batch_cancelled").split(":", 1)[0], r.error or "cancelled"
        else:  # started and unfinished when the window ended
            code, message = f"batch_{final.value}", "the request was still running when the batch ended"
        _line(errors, r.id, r.custom_id, error={"code": code, "message": message})
        num_errors += 1
    for e in store.iter_line_errors(session, job_id=job.id):
        _line(errors, f"line-{e.line_no}", e.custom_id, error={"code": e.code, "message": e.message}, line=e.line_no)
        num_errors += 1
    return Counts(num_output, num_errors, store.TokenUsage(input_tokens, output_tokens, cached_tokens))


def _line(out: files.FileWriter, request_id: str, custom_id: str | None, *, response: dict | None = None,
          error: dict | None = None, line: int | None = None) -> None:
    record = {"id": f"batch_req_{request_id}", "custom_id": custom_id, "response": response, "error": error}
    if line is not None:
        record["line"] = line  # NOTE: a bad line may have no custom_id; its line number still finds it
    out.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")


def _writer(session: Session, job: store.StoredJob, kind: str) -> files.FileWriter:
    # NOTE: the id follows from the job, so a re-run finalise finds the file it already wrote.
    expires_after = None if job.output_expires_after_s is None else timedelta(seconds=job.output_expires_after_s)
    return files.FileWriter(session, tenant=job.tenant, purpose=OUTPUT_PURPOSE, file_id=f"file-{uuid.uuid5(job.id, kind).hex}",
                            filename=f"{job.public_id}_{kind}.jsonl", expires_after=expires_after)


def _close(writer: files.FileWriter) -> str | None:
    """The file's id; None for a file with no line (OpenAI's batches then name no file)."""
    return writer.close().id if writer.num_bytes else None
