"""Store functions of bulk jobs: create, read, lock and move a job; its requests, line errors and counts.

Knows the job row, its requests (by batch_job_id) and its bad lines. Status moves are conditional
updates, so a task that runs twice moves a job once. Does not know the file format (servelab/jobs/)
or Celery. Every function takes a session and never commits. Past 400 lines: one piece, the job row and the
rows that hang off it, which the jobs' conditional moves and counts read together.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import func, literal, select, tuple_, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from servelab.request import FinishReason, SamplingParams
from servelab.store.models import (
    BatchJobRow,
    BatchLineErrorRow,
    BatchStatus,
    RequestRow,
    RequestStatus,
    ResultRow,
    StreamKind,
)
from servelab.store.pgtext import from_column, json_to_column, to_column

ID_PREFIX = "batch_"
ACTIVE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING)


@dataclass(frozen=True)
class RequestCounts:
    total: int
    completed: int
    failed: int

    def as_dict(self) -> dict[str, int]:
        return {"total": self.total, "completed": self.completed, "failed": self.failed}


@dataclass(frozen=True)
class TokenUsage:
    """Tokens of a job's succeeded requests: the prompts read (of them, those served from the prefix cache)
    and the completions written."""

    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "cached_tokens": self.cached_tokens}


@dataclass(frozen=True)
class StoredJob:
    id: uuid.UUID
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, Any] | None
    status: BatchStatus
    errors: list[dict[str, Any]] | None
    ingest_offset: int
    num_lines: int  # physical lines read, blank ones included: the next line's number is num_lines + 1
    is_ingested: bool
    output_file_id: str | None
    error_file_id: str | None
    request_counts: dict[str, int] | None
    timestamps: dict[str, datetime | None]
    output_expires_after_s: int | None = None
    usage: dict[str, int] | None = None  # written when the job ends; live jobs: sum_usage

    @property
    def public_id(self) -> str:
        return public_id(self.id)


@dataclass(frozen=True)
class NewRequest:
    """A good batch line, ready to become a request row."""

    custom_id: str
    serving_config_name: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    sampling: SamplingParams


@dataclass(frozen=True)
class LineError:
    line_no: int
    custom_id: str | None
    code: str
    message: str


@dataclass(frozen=True)
class JobRequest:
    """One request of a job as finalisation sees it, with its result when it has one."""

    id: str
    custom_id: str
    serving_config_name: str
    status: RequestStatus
    error: str | None
    finish_reason: FinishReason | None
    finished_at: datetime | None
    text: str | None
    num_prompt_tokens: int | None
    num_generated_tokens: int | None
    logprobs: list[dict[str, Any]] | None = None  # as stored, when the line asked for them
    num_cached_tokens: int | None = None  # of num_prompt_tokens, served from the prefix cache
    constraint: str | None = None  # the stored sampling's constraint, if any (it says whether the answer is a tool call)


TIMESTAMPS = ("created_at", "expires_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at",
              "expired_at", "cancelling_at", "cancelled_at")


def public_id(job_id: uuid.UUID) -> str:
    return f"{ID_PREFIX}{job_id.hex}"


def parse_public_id(value: str) -> uuid.UUID | None:
    if not value.startswith(ID_PREFIX):
        return None
    try:
        return uuid.UUID(hex=value.removeprefix(ID_PREFIX))
    except ValueError:
        return None


def _stored(row: BatchJobRow) -> StoredJob:
    return StoredJob(
        row.id, row.tenant, row.endpoint, row.input_file_id, row.completion_window, row.job_metadata, row.status,
        row.errors, row.ingest_offset, row.num_lines, row.is_ingested, row.output_file_id, row.error_file_id,
        row.request_counts, {name: getattr(row, name) for name in TIMESTAMPS}, row.output_expires_after_s, row.usage,
    )


def create_job(session: Session, *, tenant: str, endpoint: str, input_file_id: str, completion_window: str,
               metadata: dict[str, Any] | None, expires_at: datetime, output_expires_after_s: int | None = None
               ) -> StoredJob:
    row = BatchJobRow(id=uuid.uuid4(), tenant=tenant, endpoint=endpoint, input_file_id=input_file_id,
                      completion_window=completion_window, job_metadata=metadata, expires_at=expires_at,
                      output_expires_after_s=output_expires_after_s)
    session.add(row)
    session.flush()
    session.refresh(row)
    return _stored(row)


def get_job(session: Session, *, job_id: uuid.UUID, tenant: str | None = None, for_update: bool = False
            ) -> StoredJob | None:
    """The job; None when it does not exist or (tenant given) belongs to another tenant."""
    query = select(BatchJobRow).where(BatchJobRow.id == job_id)
    if tenant is not None:
        query = query.where(BatchJobRow.tenant == tenant)
    if for_update:
        query = query.with_for_update()
    row = session.scalar(query)
    return _stored(row) if row else None


def list_jobs(session: Session, *, tenant: str, after: uuid.UUID | None = None, limit: int = 20) -> list[StoredJob]:
    """Newest first; `after` is the last id of the previous page."""
    query = select(BatchJobRow).where(BatchJobRow.tenant == tenant)
    if after is not None:
        anchor = select(BatchJobRow.created_at).where(BatchJobRow.id == after).scalar_subquery()
        # NOTE: a SQL row comparison (tuple_), so jobs made in the same instant page by id, none skipped
        query = query.where(tuple_(BatchJobRow.created_at, BatchJobRow.id) < tuple_(anchor, literal(after)))
    rows = session.scalars(query.order_by(BatchJobRow.created_at.desc(), BatchJobRow.id.desc()).limit(limit))
    return [_stored(r) for r in rows]


def active_jobs_reading(session: Session, *, file_id: str) -> list[uuid.UUID]:
    """Unfinished jobs whose input is this file (ingest and finalisation read it)."""
    return list(session.scalars(select(BatchJobRow.id).where(BatchJobRow.input_file_id == file_id,
                                                             BatchJobRow.status.in_(ACTIVE))
                                .order_by(BatchJobRow.created_at)))


def sum_usage(session: Session, *, job_id: uuid.UUID) -> TokenUsage:
    """Tokens of the job's succeeded requests so far (the requests its output file answers)."""
    row = session.execute(
        select(func.coalesce(func.sum(ResultRow.num_prompt_tokens), 0),
               func.coalesce(func.sum(ResultRow.num_generated_tokens), 0),
               func.coalesce(func.sum(ResultRow.num_cached_tokens), 0))
        .join(RequestRow, RequestRow.id == ResultRow.request_id)
        .where(RequestRow.batch_job_id == job_id, RequestRow.status == RequestStatus.SUCCEEDED)
    ).one()
    return TokenUsage(int(row[0]), int(row[1]), int(row[2]))


def active_job_ids(session: Session) -> list[uuid.UUID]:
    return list(session.scalars(select(BatchJobRow.id).where(BatchJobRow.status.in_(ACTIVE))
                                .order_by(BatchJobRow.created_at)))


def ingesting_jobs(session: Session, *, now: datetime) -> list[tuple[uuid.UUID, str]]:
    """Jobs with lines left to read and time left in their window, oldest first: (id, tenant)."""
    return [(job_id, tenant) for job_id, tenant in session.execute(
        select(BatchJobRow.id, BatchJobRow.tenant)
        .where(BatchJobRow.status.in_((BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)),
               BatchJobRow.is_ingested.is_(False), BatchJobRow.expires_at > now)
        .order_by(BatchJobRow.created_at, BatchJobRow.id))]


def queued_bulk(session: Session) -> dict[tuple[str, uuid.UUID | None], int]:
    """Bulk requests no worker has started, by (serving config, batch job; None for the lab's own): what each
    config's bulk stream holds ahead of a line enqueued now.

    NOTE: read through ix_requests_status_serving_config_name, so its cost is the queued rows', which the fair
    share bounds, not the table's.
    """
    rows = session.execute(
        select(RequestRow.serving_config_name, RequestRow.batch_job_id, func.count())
        .where(RequestRow.status == RequestStatus.QUEUED, RequestRow.stream == StreamKind.BULK)
        .group_by(RequestRow.serving_config_name, RequestRow.batch_job_id))
    return {(name, job_id): int(n) for name, job_id, n in rows}


def job_config_names(session: Session, *, job_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, set[str]]:
    """The serving configs each job's stored requests name, queued or not (a scan of the jobs' rows through
    ix_requests_batch_job_id: the feed asks once per job a task)."""
    names: dict[uuid.UUID, set[str]] = {}
    for job_id, name in session.execute(select(RequestRow.batch_job_id, RequestRow.serving_config_name).distinct()
                                        .where(RequestRow.batch_job_id.in_(list(job_ids)))):
        names.setdefault(job_id, set()).add(name)
    return names


def move_job(session: Session, *, job_id: uuid.UUID, from_statuses: tuple[BatchStatus, ...], to: BatchStatus,
             now: datetime, **values: Any) -> bool:
    """Move the job to `to` if it is in one of from_statuses, stamping `<to>_at`; True if it moved."""
    stamp = {f"{to.value}_at": now} if f"{to.value}_at" in TIMESTAMPS else {}
    result = session.execute(
        update(BatchJobRow).where(BatchJobRow.id == job_id, BatchJobRow.status.in_(from_statuses))
        .values(status=to, **stamp, **values).returning(BatchJobRow.id)
    )
    return result.first() is not None


def update_job(session: Session, *, job_id: uuid.UUID, **values: Any) -> None:
    session.execute(update(BatchJobRow).where(BatchJobRow.id == job_id).values(**values))


_JSON = json.JSONEncoder(check_circular=False, separators=(",", ":"))  # NOTE: a quarter cheaper than json.dumps
_COPY_REQUESTS = ("COPY requests (id, tenant, serving_config_name, stream, status, prompt, messages, sampling, "
                  "batch_job_id, custom_id) FROM STDIN")


@dataclass(frozen=True)
class Added:
    """What add_requests stored of a slice's good lines."""

    created: dict[str, str]  # custom_id -> the new request's id
    taken: list[str]  # custom_ids that earlier slices' lines hold already
    unstorable: dict[str, str]  # custom_id -> why its row could not be stored (the line's error)


# NOTE: what a row PostgreSQL refuses raises: a psycopg error (a value it cannot take) or, before it is sent, the text
# psycopg cannot encode. Every text is kept (store/pgtext.py) and the edges refuse what is not text, so this is the
# net under them: one such row becomes its line's error instead of failing the slice, and its job, for ever.
UNSTORABLE = (psycopg.DataError, psycopg.IntegrityError, UnicodeEncodeError)


def add_requests(session: Session, *, job: StoredJob, requests: Iterable[NewRequest]) -> Added:
    """Insert request rows as they come. The caller holds the job's row lock (one writer per job), and the
    requests' custom_ids differ.

    NOTE: rows are COPYed straight into the table as the iterable yields them, so PostgreSQL inserts them while
    the caller parses the next lines; psycopg formats COPY rows in C (about 1 us a row, against 30-45 us to bind
    them as parameters). COPY has no ON CONFLICT: when an earlier slice holds one of the custom_ids, or a row is
    refused, the COPY is rolled back to its savepoint and runs again without the taken ones, then (if a row is
    still refused) a row at a time. A re-run slice (a resumed job) finds none of its own rows: they were rolled
    back with the offset that would have skipped it.
    """
    rows = zip(_new_request_ids(), requests)
    added: list[tuple[str, NewRequest]] = []
    cursor = session.connection().connection.driver_connection.cursor()  # in the session's transaction
    with cursor:
        if _copy_in_savepoint(cursor, job, rows, added) is None:
            return Added({r.custom_id: request_id for request_id, r in added}, [], {})
        added.extend(rows)  # the requests not yet copied when the COPY failed
        cursor.execute("SELECT custom_id FROM requests WHERE batch_job_id = %s AND custom_id = ANY(%s)",
                       (job.id, [to_column(r.custom_id) for _, r in added]))
        taken = {from_column(custom_id) for custom_id, in cursor.fetchall()}
        fresh = [(request_id, r) for request_id, r in added if r.custom_id not in taken]
        unstorable: dict[str, str] = {}
        if _copy_in_savepoint(cursor, job, iter(fresh), []) is not None:
            for request_id, r in fresh:
                refused = _copy_in_savepoint(cursor, job, iter([(request_id, r)]), [])
                if refused is not None:
                    unstorable[r.custom_id] = f"the line could not be stored: {str(refused).splitlines()[0]}"
    return Added({r.custom_id: request_id for request_id, r in fresh if r.custom_id not in unstorable},
                 [r.custom_id for _, r in added if r.custom_id in taken], unstorable)


def _copy_in_savepoint(cursor: psycopg.Cursor, job: StoredJob, rows: Iterator[tuple[str, NewRequest]],
                       added: list[tuple[str, NewRequest]]) -> Exception | None:
    """COPY the rows under a savepoint; -> None, or what refused them (everything rolled back to the savepoint)."""
    cursor.execute("SAVEPOINT add_requests")
    try:
        _copy_requests(cursor, job, rows, added)
    except UNSTORABLE as exc:
        cursor.execute("ROLLBACK TO SAVEPOINT add_requests")
        return exc
    cursor.execute("RELEASE SAVEPOINT add_requests")
    return None


def _new_request_ids(batch: int = 1_024) -> Iterator[str]:
    """Random (version 4) UUIDs as text, made from one read of random bytes per batch: a third of the cost of
    str(uuid.uuid4()) each, which ingest pays for every line."""
    while True:
        h = os.urandom(16 * batch).hex()
        for i in range(0, 32 * batch, 32):
            yield (f"{h[i:i + 8]}-{h[i + 8:i + 12]}-4{h[i + 13:i + 16]}-{'89ab'[int(h[i + 16], 16) & 3]}"
                   f"{h[i + 17:i + 20]}-{h[i + 20:i + 32]}")


def _copy_requests(cursor: psycopg.Cursor, job: StoredJob, rows: Iterator[tuple[str, NewRequest]],
                   added: list[tuple[str, NewRequest]]) -> None:
    """COPY (id, request) rows into the requests table, appending each to added as it goes."""
    stored: dict[SamplingParams, str] = {}  # NOTE: most lines of a file sample alike: one JSON text each
    stream, status = StreamKind.BULK.value, RequestStatus.QUEUED.value
    with cursor.copy(_COPY_REQUESTS) as copy:
        for request_id, r in rows:
            added.append((request_id, r))
            sampling = stored.get(r.sampling)
            if sampling is None:
                sampling = stored[r.sampling] = json.dumps(json_to_column(r.sampling.to_stored()))
            # NOTE: COPY passes the column types by: the client's text is kept by hand (store/pgtext.py)
            copy.write_row((request_id, job.tenant, r.serving_config_name, stream, status,
                            None if r.prompt is None else to_column(r.prompt),
                            None if r.messages is None else _messages_json(r.messages), sampling, job.id,
                            to_column(r.custom_id)))


def _messages_json(messages: list[dict[str, Any]]) -> str:
    """NOTE: JSON escapes NUL and the mark (ASCII output): only messages whose JSON shows one are walked."""
    encoded = _JSON.encode(messages)
    if "\\u0000" in encoded or "\\ufdd0" in encoded:
        encoded = _JSON.encode(json_to_column(messages))
    return encoded


def add_line_errors(session: Session, *, job_id: uuid.UUID, errors: list[LineError]) -> None:
    if not errors:
        return
    session.execute(
        insert(BatchLineErrorRow.__table__).on_conflict_do_nothing(index_elements=["batch_job_id", "line_no"]),
        [dict(batch_job_id=job_id, line_no=e.line_no, custom_id=e.custom_id, code=e.code, message=e.message)
         for e in errors],
    )


def num_unfinished(session: Session, *, job_id: uuid.UUID, statuses: tuple[RequestStatus, ...] = (
        RequestStatus.QUEUED, RequestStatus.RUNNING)) -> int:
    return session.scalar(select(func.count()).select_from(RequestRow).where(
        RequestRow.batch_job_id == job_id, RequestRow.status.in_(statuses))) or 0


def cancel_queued(session: Session, *, job_id: uuid.UUID, reason: str, now: datetime) -> int:
    """Cancel the job's requests no worker has started; started ones run to their end."""
    result = session.execute(
        update(RequestRow).where(RequestRow.batch_job_id == job_id, RequestRow.status == RequestStatus.QUEUED)
        .values(status=RequestStatus.CANCELLED, finish_reason=FinishReason.CANCELLED, error=reason, finished_at=now)
    )
    return result.rowcount


def count_requests(session: Session, *, job: StoredJob) -> RequestCounts:
    """Live counts: requests plus bad lines; succeeded requests; bad lines plus failed or cancelled requests."""
    by_status = dict(session.execute(
        select(RequestRow.status, func.count()).where(RequestRow.batch_job_id == job.id).group_by(RequestRow.status)
    ).all())
    num_bad_lines = session.scalar(select(func.count()).select_from(BatchLineErrorRow)
                                   .where(BatchLineErrorRow.batch_job_id == job.id)) or 0
    failed = num_bad_lines + by_status.get(RequestStatus.FAILED, 0) + by_status.get(RequestStatus.CANCELLED, 0)
    total = sum(by_status.values()) + num_bad_lines
    return RequestCounts(total=total, completed=by_status.get(RequestStatus.SUCCEEDED, 0), failed=failed)


def iter_job_requests(session: Session, *, job_id: uuid.UUID, page_size: int = 1_000) -> Iterator[JobRequest]:
    """Every request of the job with its result, streamed from the server in pages."""
    query = (
        select(RequestRow.id, RequestRow.custom_id, RequestRow.serving_config_name, RequestRow.status,
               RequestRow.error, RequestRow.finish_reason, RequestRow.finished_at, ResultRow.text,
               ResultRow.num_prompt_tokens, ResultRow.num_generated_tokens, ResultRow.logprobs,
               ResultRow.num_cached_tokens,
               # NOTE: the constraint alone, not the whole sampling object: a page of 1,000 rows stays small
               RequestRow.sampling["constraint"].astext)
        .outerjoin(ResultRow, ResultRow.request_id == RequestRow.id)
        .where(RequestRow.batch_job_id == job_id).order_by(RequestRow.enqueued_at, RequestRow.id)
    )
    for row in session.execute(query.execution_options(yield_per=page_size)):
        yield JobRequest(str(row[0]), *row[1:])


def iter_line_errors(session: Session, *, job_id: uuid.UUID) -> Iterator[LineError]:
    query = select(BatchLineErrorRow).where(BatchLineErrorRow.batch_job_id == job_id).order_by(BatchLineErrorRow.line_no)
    for row in session.scalars(query.execution_options(yield_per=1_000)):
        yield LineError(row.line_no, row.custom_id, row.code, row.message)
