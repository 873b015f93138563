"""The OpenAI Files and Batch API: upload a JSONL file, create / read / list / cancel a batch, download files.

Thin: jobs and files are rows (servelab/store); the jobs-worker ingests, advances and finalises them
(servelab/jobs), so creating a batch only writes its row. Another tenant's batch or file is 404.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Path, Query, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from api.deps import State, Tenant
from api.errors import ApiError
from servelab.protocol import ENDPOINTS
from servelab.jobs.lifecycle import NotCancellable, cancel_job, parse_window
from servelab.store import batch_jobs as jobs
from servelab.store import files
from servelab.store.db import session_scope

# NOTE: ids are letters, digits, "-" and "_" (file-<hex>, batch_<hex>): anything else (a NUL byte, which
# PostgreSQL text cannot hold) is a 400 naming the field, never a database error
ID_PATTERN = r"^[A-Za-z0-9_-]+$"
FileId = Annotated[str, Path(max_length=100, pattern=ID_PATTERN)]

router = APIRouter()
INPUT_PURPOSE = "batch"


class FileOut(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"

    @classmethod
    def of(cls, f: files.StoredFile) -> FileOut:
        return cls(id=f.id, bytes=f.num_bytes, created_at=int(f.created_at.timestamp()), filename=f.filename,
                   purpose=f.purpose)


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
    return BatchOut(id=job.public_id, endpoint=job.endpoint, errors=errors, input_file_id=job.input_file_id,
                    completion_window=job.completion_window, status=job.status.value,
                    output_file_id=job.output_file_id, error_file_id=job.error_file_id, request_counts=counts,
                    metadata=job.metadata, **stamps)


def _job_id(batch_id: str):
    job_id = jobs.parse_public_id(batch_id)
    if job_id is None:
        raise ApiError(404, f"no batch {batch_id!r}", code="batch_not_found", param="batch_id")
    return job_id


def _num_lines(content: bytes) -> int:
    return content.count(b"\n") + (0 if content.endswith(b"\n") else 1)


@router.post("/v1/files", response_model=FileOut, tags=["files"])
def upload_file(state: State, tenant: Tenant, file: UploadFile = File(description="a JSONL batch file"),
                purpose: str = Form(description="'batch'")) -> FileOut:
    """Upload a JSONL batch input file (purpose 'batch')."""
    if purpose != INPUT_PURPOSE:
        raise ApiError(400, f"purpose must be 'batch', got {purpose!r}", code="invalid_purpose", param="purpose")
    content = file.file.read()
    if not content.strip():
        raise ApiError(400, "the file is empty; give one JSON request per line", code="empty_file", param="file")
    num_lines, limit = _num_lines(content), state.settings.max_batch_lines
    if num_lines > limit:
        raise ApiError(413, f"the file has {num_lines} lines; a batch takes at most {limit}; split it",
                       code="too_many_lines", param="file")
    with session_scope(state.runtime.sessions) as session:
        stored = files.create_file(session, tenant=tenant, purpose=purpose, filename=file.filename or "upload.jsonl",
                                   content=content)
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


@router.get("/v1/files/{file_id}/content", tags=["files"],
            responses={200: {"content": {"application/octet-stream": {}}}})
def read_file_content(file_id: FileId, state: State, tenant: Tenant) -> Response:
    with session_scope(state.runtime.sessions) as session:
        content = files.read_content(session, file_id=file_id, tenant=tenant)
    if content is None:
        raise ApiError(404, f"no file {file_id!r}", code="file_not_found", param="file_id")
    return Response(content, media_type="application/octet-stream")


@router.post("/v1/batches", response_model=BatchOut, tags=["batches"])
def create_batch(body: BatchIn, state: State, tenant: Tenant) -> BatchOut:
    """Create a batch from an uploaded file; the jobs-worker validates and runs every line."""
    assert body.endpoint in ENDPOINTS
    try:
        window = parse_window(body.completion_window)
    except ValueError as exc:
        raise ApiError(400, str(exc), code="invalid_completion_window", param="completion_window") from None
    with session_scope(state.runtime.sessions) as session:
        found = files.get_file(session, file_id=body.input_file_id, tenant=tenant)
        if found is None:
            raise ApiError(404, f"no file {body.input_file_id!r}", code="file_not_found", param="input_file_id")
        if found.purpose != INPUT_PURPOSE:
            raise ApiError(400, f"file {found.id} has purpose {found.purpose!r}, not 'batch'",
                           code="invalid_input_file", param="input_file_id")
        job = jobs.create_job(session, tenant=tenant, endpoint=body.endpoint, input_file_id=found.id,
                              completion_window=body.completion_window, metadata=body.metadata,
                              expires_at=datetime.now(UTC) + window)
        return _batch_out(session, job)


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
