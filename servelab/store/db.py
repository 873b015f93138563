"""Engines, sessions and the transaction boundary; and creating a missing database (or dropping one).

Knows how to turn a PostgreSQL URL into an engine and a session factory, built explicitly by a process
entry point, never at import time. Does not know the schema (models.py, migrations/) or where the URL
comes from (Settings, or servelab/embedded.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.orm import Session, sessionmaker

DUPLICATE_DATABASE = "42P04"


def sqlalchemy_url(url: str | URL) -> URL:
    """The URL with the psycopg 3 driver named: a bare postgresql:// would ask for psycopg2."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def make_engine(url: str | URL, *, echo: bool = False) -> Engine:
    # NOTE: pre-ping, because workers hold connections across long batches and database restarts.
    return create_engine(sqlalchemy_url(url), echo=echo, pool_pre_ping=True)


def session_factory(engine: Engine) -> sessionmaker[Session]:
    # NOTE: objects stay readable after commit; callers hand frozen dataclasses on, not rows.
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One transaction: commit when the block succeeds, roll back when it raises."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def ensure_database(url: str | URL) -> bool:
    """Create the URL's database if it does not exist (via the 'postgres' database); True if it was created."""
    target = sqlalchemy_url(url)
    name = target.database
    assert name, f"the URL names no database: {target.render_as_string(hide_password=True)}"
    admin = create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            if conn.scalar(text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name}):
                return False
            quoted = conn.dialect.identifier_preparer.quote(name)
            try:
                conn.execute(text(f"CREATE DATABASE {quoted}"))
            except ProgrammingError as exc:
                # Another process created it between the check and the CREATE.
                if getattr(exc.orig, "sqlstate", None) == DUPLICATE_DATABASE:
                    return False
                raise
            return True
    finally:
        admin.dispose()


def drop_database(url: str | URL) -> None:
    """Drop the URL's database if it exists, ending its connections (a bench's scratch database)."""
    target = sqlalchemy_url(url)
    assert target.database and target.database != "postgres", f"refusing to drop {target.database!r}"
    admin = create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            quoted = conn.dialect.identifier_preparer.quote(target.database)
            conn.execute(text(f"DROP DATABASE IF EXISTS {quoted} WITH (FORCE)"))
    finally:
        admin.dispose()


def commit_without_waiting(session: Session) -> None:
    """This transaction's commit returns before its WAL is on disk (its locks go at once); the caller waits
    for the disk with flush_commits before it tells anyone about what it wrote."""
    session.execute(text("SET LOCAL synchronous_commit = off"))


def flush_commits(factory: sessionmaker[Session]) -> None:
    """Return once every transaction committed so far is on disk: a transaction with an id commits
    synchronously, and PostgreSQL flushes the WAL up to its commit record, so every earlier commit with it."""
    with session_scope(factory) as session:
        session.execute(text("SELECT txid_current()"))
