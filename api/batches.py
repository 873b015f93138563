"""The OpenAI Files and Batch API: upload, list, read, download and delete files; create / read / list / cancel
a batch, with its token usage.

Thin: jobs and files are rows (servelab/store); the jobs-worker ingests, advances and finalises them
(servelab/jobs), so creating a batch only writes its row (once per Idempotency-Key). Another tenant's batch
or file is 404; a file an unfinished batch reads cannot be deleted (409).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, BinaryIO, Literal

from fastapi import APIRouter, Depends, File, Form, Path, Query, Request, UploadFile
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session, sessionmaker

from api.deps import IdempotencyKey, State, Tenant
from api.errors import ApiError, TextCheckedRoute
from servelab.idempotency import HEADER, Fingerprint, KeyReused, check_reuse
from servelab.protocol import ENDPOINTS
from servelab.jobs.lifecycle import NotCancellable, cancel_job, parse_window
from servelab.store import batch_jobs as jobs
from servelab.store import files
from servelab.store import idempotency as idempotency_keys
from servelab.store import keys
from servelab.store.db import session_scope

# NOTE: ids are letters, digits, "-" and "_" (file-<hex>, batch_<hex>): anything else (a NUL byte, which
# PostgreSQL text cannot hold) is a 400 naming the field, never a database error
ID_PATTERN = r"^[A-Za-z0-9_-]+$"
FileId = Annotated[str, Path(max_length=100, pattern=ID_PATTERN)]

router = APIRouter(route_class=TextCheckedRoute)
INPUT_PURPOSE = "batch"
BATCHES = "/v1/batches"
# OpenAI's bounds for a file's expiry (expires_after on upload, output_expires_after on a batch)
MIN_EXPIRY_S, MAX_EXPIRY_S = 3_600, 2_592_000
UPLOAD_FIELDS = {"file", "purpose", "expires_after[anchor]", "expires_after[seconds]"}


class FileOut(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"

    @classmethod
    def of(cls, f: files.StoredFile) -> FileOut:
        return cls(id=f.id, bytes=f.num_bytes, created_at=int(f.created_at.timestamp()), filename=f.filename,
                   purpose=f.purpose, expires_at=int(f.expires_at.timestamp()) if f.expires_at else None)


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class ExpiresAfter(BaseModel):
    """OpenAI's file expiry: this many seconds after the file is created."""

    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_EXPIRY_S, le=MAX_EXPIRY_S)


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileOut]
    first_id: str | None
    last_id: str | None
    has_more: bool


class BatchIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str = Field(min_length=1, max_length=100, pattern=ID_PATTERN)
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: str = Field(default="24h", max_length=16)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    output_expires_after: ExpiresAfter | None = Field(
        default=None, description="the output and error files expire this long after they are written")


class BatchOut(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: dict[str, Any] | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: dict[str, int]
    usage: dict[str, Any] = Field(description="OpenAI's shape: input_tokens, output_tokens, total_tokens (and their "
                                              "details) of the succeeded requests")
    metadata: dict[str, Any] | None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchOut]
    first_id: str | None
    last_id: str | None
    has_more: bool


def _batch_out(session, job: jobs.StoredJob) -> BatchOut:
    counts = job.request_counts or jobs.count_requests(session, job=job).as_dict()
    stamps = {name: int(t.timestamp()) if t else None for name, t in job.timestamps.items()}
    errors = {"object": "list", "data": job.errors} if job.errors else None
    # NOTE: a finished job's usage was written with its files (so it agrees with the output file); a live job's
    # is summed now, and grows
    usage = job.usage or jobs.sum_usage(session, job_id=job.id).as_dict()
    return BatchOut(id=job.public_id, endpoint=job.endpoint, errors=errors, input_file_id=job.input_file_id,
                    completion_window=job.completion_window, status=job.status.value,
                    output_file_id=job.output_file_id, error_file_id=job.error_file_id, request_counts=counts,
                    usage=_openai_usage(usage), metadata=job.metadata, **stamps)


def _openai_usage(usage: dict[str, int]) -> dict[str, Any]:
    """NOTE: no reasoning tokens here: their details are 0, truly. Cached tokens are the prompt tokens served
    from the prefix cache (a job that ended before they were counted stored none: 0, as nothing was cached)."""
    return {"input_tokens": usage["input_tokens"],
            "input_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)},
            "output_tokens": usage["output_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["input_tokens"] + usage["output_tokens"]}


def _job_id(batch_id: str):
    job_id = jobs.parse_public_id(batch_id)
    if job_id is None:
        raise ApiError(404, f"no batch {batch_id!r}", code="batch_not_found", param="batch_id")
    return job_id


def _store_upload(upload: BinaryIO, writer: files.FileWriter, *, max_lines: int) -> tuple[int, bool]:
    """Copy an upload into its file a part at a time -> (its number of lines, whether it holds any text). Past
    max_lines the rest is only counted: the upload will be refused, naming its true number of lines."""
    num_newlines, has_text, last = 0, False, b""
    while chunk := upload.read(files.PART_BYTES):
        num_newlines += chunk.count(b"\n")
        has_text = has_text or bool(chunk.strip())
        last = chunk[-1:]
        if num_newlines <= max_lines:
            writer.write(chunk)
    return num_newlines + (0 if last in (b"", b"\n") else 1), has_text


def _parts(sessions: sessionmaker[Session], found: files.StoredFile) -> Iterator[bytes]:
    """A file's bytes a part at a time. NOTE: each part is read in a short transaction of its own, so a slow
    client holds no database connection between parts and the api never holds more than a part."""
    for offset in range(0, found.num_bytes, files.PART_BYTES):
        with session_scope(sessions) as session:
            part = files.read_range(session, file_id=found.id, offset=offset, num_bytes=files.PART_BYTES)
        yield part


async def _known_form_fields(http: Request) -> None:
    """NOTE: a form field FastAPI does not declare would be dropped in silence: refuse it, naming it."""
    unknown = sorted(set((await http.form()).keys()) - UPLOAD_FIELDS)
    if unknown:
        raise ApiError(400, f"unknown form field {unknown[0]!r}; an upload takes {', '.join(sorted(UPLOAD_FIELDS))}",
                       code="unknown_parameter", param=unknown[0])


def _expires_after(anchor: str | None, seconds: int | None) -> timedelta | None:
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at" or seconds is None or not MIN_EXPIRY_S <= seconds <= MAX_EXPIRY_S:
        raise ApiError(400, f"expires_after takes anchor 'created_at' and seconds from {MIN_EXPIRY_S} to "
                       f"{MAX_EXPIRY_S}; got anchor {anchor!r}, seconds {seconds!r}", code="invalid_expires_after",
                       param="expires_after")
    return timedelta(seconds=seconds)


@router.post("/v1/files", response_model=FileOut, tags=["files"], dependencies=[Depends(_known_form_fields)])
def upload_file(state: State, tenant: Tenant, file: UploadFile = File(description="a JSONL batch file"),
                purpose: str = Form(description="'batch'"),
                expires_after_anchor: str | None = Form(default=None, alias="expires_after[anchor]", max_length=32),
                expires_after_seconds: int | None = Form(default=None, alias="expires_after[seconds]")) -> FileOut:
    """Upload a JSONL batch input file (purpose 'batch'), kept until deleted or, with expires_after, until then."""
    expires_after = _expires_after(expires_after_anchor, expires_after_seconds)
    if purpose != INPUT_PURPOSE:
        raise ApiError(400, f"purpose must be 'batch', got {purpose!r}", code="invalid_purpose", param="purpose")
    limit = state.settings.max_batch_lines
    with session_scope(state.runtime.sessions) as session:  # NOTE: a refused upload rolls back what it wrote
        writer = files.FileWriter(session, tenant=tenant, purpose=purpose, filename=file.filename or "upload.jsonl",
                                  expires_after=expires_after)
        num_lines, has_text = _store_upload(file.file, writer, max_lines=limit)
        if not has_text:
            raise ApiError(400, "the file is empty; give one JSON request per line", code="empty_file", param="file")
        if num_lines > limit:
            raise ApiError(413, f"the file has {num_lines} lines; a batch takes at most {limit}; split it",
                           code="too_many_lines", param="file")
        stored = writer.close()
    return FileOut.of(stored)


@router.get("/v1/files", response_model=FileList, tags=["files"])
def list_files(state: State, tenant: Tenant,
               after: str | None = Query(default=None, max_length=100, pattern=ID_PATTERN),
               limit: int = Query(default=10_000, ge=1, le=10_000),
               order: Literal["asc", "desc"] = Query(default="desc"),
               purpose: str | None = Query(default=None, max_length=64, pattern=r"^[a-z_-]+$")) -> FileList:
    """A page of files (OpenAI's cursor: pass the last id as `after` while has_more is true)."""
    with session_scope(state.runtime.sessions) as session:
        page = files.list_files(session, tenant=tenant, after=after, limit=limit + 1, purpose=purpose,
                                ascending=order == "asc")
    data = [FileOut.of(f) for f in page[:limit]]
    return FileList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                    has_more=len(page) > limit)


@router.get("/v1/files/{file_id}", response_model=FileOut, tags=["files"])
def read_file(file_id: FileId, state: State, tenant: Tenant) -> FileOut:
    with session_scope(state.runtime.sessions) as session:
        found = files.get_file(session, file_id=file_id, tenant=tenant)
    if found is None:
        raise ApiError(404, f"no file {file_id!r}", code="file_not_found", param="file_id")
    return FileOut.of(found)


@router.delete("/v1/files/{file_id}", response_model=FileDeleted, tags=["files"])
def delete_file(file_id: FileId, state: State, tenant: Tenant) -> FileDeleted:
    """Delete a file: its content is erased at once and it is gone for every read. NOTE: refused (409) while an
    unfinished batch reads it as its input; a finished batch keeps naming its files after they are deleted."""
    with session_scope(state.runtime.sessions) as session:
        found = files.get_file(session, file_id=file_id, tenant=tenant, for_update=True)
        if found is None:
            raise ApiError(404, f"no file {file_id!r}", code="file_not_found", param="file_id")
        readers = jobs.active_jobs_reading(session, file_id=file_id)
        if readers:
            names = ", ".join(jobs.public_id(i) for i in readers)
            raise ApiError(409, f"file {file_id} is the input of unfinished batch {names}; cancel it or let it end "
                           "first", code="file_in_use", param="file_id", headers={"x-should-retry": "false"})
        files.delete_file(session, file_id=file_id, now=datetime.now(UTC))
    return FileDeleted(id=file_id, deleted=True)


@router.get("/v1/files/{file_id}/content", tags=["files"],
            responses={200: {"content": {"application/octet-stream": {}}}})
def read_file_content(file_id: FileId, state: State, tenant: Tenant) -> Response:
    """The file's bytes, streamed a part at a time. NOTE: with its Content-Length, so a download cut short (the
    file deleted meanwhile) is an error for the client, never a short file."""
    with session_scope(state.runtime.sessions) as session:
        found = files.get_file(session, file_id=file_id, tenant=tenant)
    if found is None:
        raise ApiError(404, f"no file {file_id!r}", code="file_not_found", param="file_id")
    return StreamingResponse(_parts(state.runtime.sessions, found), media_type="application/octet-stream",
                             headers={"content-length": str(found.num_bytes)})


@router.post("/v1/batches", response_model=BatchOut, tags=["batches"])
def create_batch(body: BatchIn, state: State, tenant: Tenant, response: Response,
                 key: IdempotencyKey = None) -> BatchOut:
    """Create a batch from an uploaded file; the jobs-worker validates and runs every line. With an
    Idempotency-Key, a retry answers with the batch the first call made."""
    assert body.endpoint in ENDPOINTS
    try:
        window = parse_window(body.completion_window)
    except ValueError as exc:
        raise ApiError(400, str(exc), code="invalid_completion_window", param="completion_window") from None
    now = datetime.now(UTC)
    with session_scope(state.runtime.sessions) as session:
        if key is not None and (earlier := _earlier_batch(session, tenant, key, body, now)) is not None:
            response.headers["Idempotent-Replayed"] = "true"
            return _batch_out(session, earlier)
        found = files.get_file(session, file_id=body.input_file_id, tenant=tenant, for_update=True)
        if found is None:
            raise ApiError(404, f"no file {body.input_file_id!r}", code="file_not_found", param="input_file_id")
        if found.purpose != INPUT_PURPOSE:
            raise ApiError(400, f"file {found.id} has purpose {found.purpose!r}, not 'batch'",
                           code="invalid_input_file", param="input_file_id")
        expires_after_s = body.output_expires_after.seconds if body.output_expires_after else None
        job = jobs.create_job(session, tenant=tenant, endpoint=body.endpoint, input_file_id=found.id,
                              completion_window=body.completion_window, metadata=body.metadata,
                              expires_at=now + window, output_expires_after_s=expires_after_s)
        if key is not None:
            idempotency_keys.save_key(session, tenant=tenant, key=key, resource_id=job.public_id, now=now,
                                      fingerprint=Fingerprint.of(BATCHES, body.model_dump(mode="json")),
                                      ttl=state.key_ttl)
        return _batch_out(session, job)


def _earlier_batch(session, tenant: str, key: str, body: BatchIn, now: datetime) -> jobs.StoredJob | None:
    """The batch an earlier create with this key made (the tenant's keys locked until the commit)."""
    keys.lock_tenant(session, tenant)
    first = idempotency_keys.find_key(session, tenant=tenant, key=key, now=now)
    if first is None:
        return None
    try:
        check_reuse(first, Fingerprint.of(BATCHES, body.model_dump(mode="json")))
    except KeyReused as exc:
        raise ApiError(422, str(exc), code="idempotency_key_reused", param=HEADER) from None
    job_id = jobs.parse_public_id(first.resource_id)
    return jobs.get_job(session, job_id=job_id, tenant=tenant) if job_id else None


@router.get("/v1/batches", response_model=BatchList, tags=["batches"])
def list_batches(state: State, tenant: Tenant, after: str | None = Query(default=None, max_length=100),
                 limit: int = Query(default=20, ge=1, le=100)) -> BatchList:
    after_id = jobs.parse_public_id(after) if after else None
    with session_scope(state.runtime.sessions) as session:
        page = jobs.list_jobs(session, tenant=tenant, after=after_id, limit=limit + 1)
        data = [_batch_out(session, j) for j in page[:limit]]
    return BatchList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                     has_more=len(page) > limit)


@router.get("/v1/batches/{batch_id}", response_model=BatchOut, tags=["batches"])
def read_batch(batch_id: str, state: State, tenant: Tenant) -> BatchOut:
    with session_scope(state.runtime.sessions) as session:
        job = jobs.get_job(session, job_id=_job_id(batch_id), tenant=tenant)
        if job is None:
            raise ApiError(404, f"no batch {batch_id!r}", code="batch_not_found", param="batch_id")
        return _batch_out(session, job)


@router.post("/v1/batches/{batch_id}/cancel", response_model=BatchOut, tags=["batches"])
def cancel_batch(batch_id: str, state: State, tenant: Tenant) -> BatchOut:
    """Stop ingest and drop queued requests; finished results are kept, and the batch ends cancelled."""
    with session_scope(state.runtime.sessions) as session:
        try:
            job = cancel_job(session, job_id=_job_id(batch_id), tenant=tenant, now=datetime.now(UTC))
        except NotCancellable as exc:
            raise ApiError(409, str(exc), code="batch_not_cancellable") from None
        if job is None:
            raise ApiError(404, f"no batch {batch_id!r}", code="batch_not_found", param="batch_id")
        return _batch_out(session, job)
