"""Files of the Batch API: uploaded JSONL inputs and jobs' output / error files, their bytes held in Postgres.

Knows ids ("file-<hex>"), ownership (every read names the tenant; another tenant's file is simply not
found), expiry and deletion (a file past its expires_at or deleted is not found either; deleting erases the
content and keeps the row, which batches point at), and the parts a file's bytes are kept in: a file is
written a part at a time (FileWriter) and read in byte ranges, so no process ever holds a whole file.
Store functions take a session and never commit.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, delete, func, literal, select, tuple_, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from servelab.store.models import FilePartRow, FileRow

PART_BYTES = 1 << 20  # NOTE: a file's parts are this long (its last one shorter); readers never assume it


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


class FileWriter:
    """A file written as it is built, in the caller's transaction: bytes are buffered up to one part, then
    inserted. Its row is inserted with the first part (or by close), so a writer closed with nothing written
    leaves no file unless asked to. With a given id, an existing file of that id is kept and nothing is written
    (a re-run writes nothing twice)."""

    def __init__(self, session: Session, *, tenant: str, purpose: str, filename: str, file_id: str | None = None,
                 expires_after: timedelta | None = None) -> None:
        self._session = session
        self.id, self.tenant, self.purpose, self.filename = file_id or new_file_id(), tenant, purpose, filename
        self._expires_after = expires_after
        self._buffer = bytearray()
        self.num_bytes = 0  # written so far, buffered bytes included
        self._is_created = False
        self._is_kept = False  # the id was taken already: writes are dropped

    def write(self, data: bytes) -> None:
        self._buffer += data
        self.num_bytes += len(data)
        while len(self._buffer) >= PART_BYTES:
            self._flush(PART_BYTES)

    def close(self) -> StoredFile:
        """Write what is buffered and the file's size; -> the file as stored."""
        self._flush(len(self._buffer))
        if not self._is_kept:
            self._session.execute(update(FileRow).where(FileRow.id == self.id).values(num_bytes=self.num_bytes))
        stored = get_file(self._session, file_id=self.id, tenant=self.tenant)
        assert stored is not None, f"file {self.id} was not written"
        return stored

    def _flush(self, num_bytes: int) -> None:
        if not self._is_created:
            self._create()
        if num_bytes == 0 or self._is_kept:
            del self._buffer[:num_bytes]
            return
        part = bytes(self._buffer[:num_bytes])
        del self._buffer[:num_bytes]
        start = self.num_bytes - len(self._buffer) - len(part)
        self._session.execute(insert(FilePartRow).values(file_id=self.id, byte_offset=start, content=part))

    def _create(self) -> None:
        self._is_created = True
        expires_at = None if self._expires_after is None else func.now() + self._expires_after
        inserted = self._session.execute(insert(FileRow).values(
            id=self.id, tenant=self.tenant, purpose=self.purpose, filename=self.filename, num_bytes=0,
            expires_at=expires_at,
        ).on_conflict_do_nothing(index_elements=["id"]).returning(FileRow.id)).first()
        self._is_kept = inserted is None


def create_file(session: Session, *, tenant: str, purpose: str, filename: str, content: bytes | Iterable[bytes],
                file_id: str | None = None, expires_after: timedelta | None = None) -> StoredFile:
    """Insert a file from its bytes, or from chunks of them (expiring expires_after after its creation, if
    given); with a given id, an existing file of that id is kept (a re-run writes nothing twice)."""
    writer = FileWriter(session, tenant=tenant, purpose=purpose, filename=filename, file_id=file_id,
                        expires_after=expires_after)
    for chunk in [content] if isinstance(content, bytes | bytearray) else content:
        writer.write(chunk)
    return writer.close()


def get_file(session: Session, *, file_id: str, tenant: str, for_update: bool = False) -> StoredFile | None:
    query = select(*COLUMNS).where(FileRow.id == file_id, FileRow.tenant == tenant, _live())
    row = session.execute(query.with_for_update() if for_update else query).first()
    return StoredFile(*row) if row else None


def delete_file(session: Session, *, file_id: str, now: datetime) -> None:
    """Erase a file's content and mark it deleted; the caller has checked (and locked) it."""
    session.execute(update(FileRow).where(FileRow.id == file_id).values(deleted_at=now))
    session.execute(delete(FilePartRow).where(FilePartRow.file_id == file_id))


def purge_expired_files(session: Session, *, now: datetime) -> int:
    """Erase the content of files past their expiry (reads stopped finding them at expires_at already)."""
    purged = session.scalars(update(FileRow).where(FileRow.expires_at <= now, FileRow.deleted_at.is_(None))
                             .values(deleted_at=now).returning(FileRow.id)).all()
    if purged:
        session.execute(delete(FilePartRow).where(FilePartRow.file_id.in_(purged)))
    return len(purged)


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
    """A whole file at once: for small files and tests; the API and the jobs-worker read ranges."""
    found = get_file(session, file_id=file_id, tenant=tenant)
    return None if found is None else read_range(session, file_id=file_id, offset=0, num_bytes=found.num_bytes)


# NOTE: only the bytes asked for leave the server: substring() of an uncompressed (STORAGE EXTERNAL) part
# reads just those TOAST slices. Positions within a part fit an integer (a bytea is under 1 GiB).
_RANGE = """
    SELECT substring(content FROM CAST(greatest(%(start)s - byte_offset, 0) + 1 AS integer)
                             FOR CAST(%(stop)s - greatest(byte_offset, %(start)s) AS integer))
    FROM file_parts
    WHERE file_id = %(file_id)s AND byte_offset < %(stop)s AND byte_offset + octet_length(content) > %(start)s
    ORDER BY byte_offset
"""


def read_range(session: Session, *, file_id: str, offset: int, num_bytes: int) -> bytes:
    """Bytes [offset, offset + num_bytes) of a file; fewer at its end."""
    # NOTE: the session's connection, asking for binary results: bytea as text would be hex, twice the bytes
    # to send and to decode.
    with session.connection().connection.driver_connection.cursor(binary=True) as cursor:
        cursor.execute(_RANGE, {"file_id": file_id, "start": offset, "stop": offset + num_bytes})
        pieces = [piece for piece, in cursor.fetchall()]
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)
