"""Files of the Batch API: uploaded JSONL inputs and jobs' output / error files, content held in Postgres.

Knows ids ("file-<hex>"), ownership (every read names the tenant; another tenant's file is simply not
found), expiry and deletion (a file past its expires_at or deleted is not found either; deleting erases the
content and keeps the row, which batches point at) and reading content in byte ranges so a large file is
never loaded whole by ingest. Store functions take a session and never commit.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, func, literal, select, text, tuple_, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from servelab.store.models import FileRow


@dataclass(frozen=True)
class StoredFile:
    id: str
    tenant: str
    purpose: str
    filename: str
    num_bytes: int
    created_at: datetime
    expires_at: datetime | None = None


COLUMNS = (FileRow.id, FileRow.tenant, FileRow.purpose, FileRow.filename, FileRow.num_bytes, FileRow.created_at,
           FileRow.expires_at)


def _live() -> ColumnElement[bool]:
    """Not deleted, and not expired (by the database's clock: the API replicas and workers agree on it)."""
    return FileRow.deleted_at.is_(None) & (FileRow.expires_at.is_(None) | (FileRow.expires_at > func.now()))


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def create_file(session: Session, *, tenant: str, purpose: str, filename: str, content: bytes,
                file_id: str | None = None, expires_after: timedelta | None = None) -> StoredFile:
    """Insert a file (expiring expires_after after its creation, if given); with a given id, an existing file of
    that id is kept (a re-run writes nothing twice)."""
    file_id = file_id or new_file_id()
    expires_at = None if expires_after is None else func.now() + expires_after
    session.execute(insert(FileRow).values(
        id=file_id, tenant=tenant, purpose=purpose, filename=filename, num_bytes=len(content), content=content,
        expires_at=expires_at,
    ).on_conflict_do_nothing(index_elements=["id"]))
    stored = get_file(session, file_id=file_id, tenant=tenant)
    assert stored is not None, f"file {file_id} was not written"
    return stored


def get_file(session: Session, *, file_id: str, tenant: str, for_update: bool = False) -> StoredFile | None:
    query = select(*COLUMNS).where(FileRow.id == file_id, FileRow.tenant == tenant, _live())
    row = session.execute(query.with_for_update() if for_update else query).first()
    return StoredFile(*row) if row else None


def delete_file(session: Session, *, file_id: str, now: datetime) -> None:
    """Erase a file's content and mark it deleted; the caller has checked (and locked) it."""
    session.execute(update(FileRow).where(FileRow.id == file_id).values(deleted_at=now, content=b""))


def purge_expired_files(session: Session, *, now: datetime) -> int:
    """Erase the content of files past their expiry (reads stopped finding them at expires_at already)."""
    return session.execute(
        update(FileRow).where(FileRow.expires_at <= now, FileRow.deleted_at.is_(None)).values(deleted_at=now, content=b"")
    ).rowcount


def list_files(session: Session, *, tenant: str, after: str | None = None, limit: int = 100,
               purpose: str | None = None, ascending: bool = False) -> list[StoredFile]:
    """A page of the tenant's files by creation time (newest first unless ascending); `after` is the last id
    of the previous page. NOTE: ordered by (created_at, id), so files made in the same instant page stably."""
    query = select(*COLUMNS).where(FileRow.tenant == tenant, _live())
    if purpose is not None:
        query = query.where(FileRow.purpose == purpose)
    key = tuple_(FileRow.created_at, FileRow.id)
    if after is not None:
        anchor = tuple_(select(FileRow.created_at).where(FileRow.id == after).scalar_subquery(), literal(after))
        query = query.where(key > anchor if ascending else key < anchor)
    order = (FileRow.created_at.asc(), FileRow.id.asc()) if ascending else (FileRow.created_at.desc(),
                                                                            FileRow.id.desc())
    return [StoredFile(*r) for r in session.execute(query.order_by(*order).limit(limit)).all()]


def read_content(session: Session, *, file_id: str, tenant: str) -> bytes | None:
    return session.scalar(select(FileRow.content).where(FileRow.id == file_id, FileRow.tenant == tenant, _live()))


def read_range(session: Session, *, file_id: str, offset: int, num_bytes: int) -> bytes:
    """Bytes [offset, offset + num_bytes) of a file; fewer at its end."""
    # NOTE: substring on bytea is 1-based; Postgres reads only the range (TOAST slices), not the whole value.
    return session.scalar(
        select(func.substring(FileRow.content, offset + 1, num_bytes)).where(FileRow.id == file_id)
    ) or b""


def find_newline(session: Session, *, file_id: str, offset: int) -> int | None:
    """The offset of the first newline at or after offset, or None when the file ends first."""
    position = session.scalar(
        text("SELECT position('\\x0a'::bytea IN substring(content FROM :start)) FROM files WHERE id = :id"),
        {"start": offset + 1, "id": file_id},
    )
    return None if not position else offset + position - 1
