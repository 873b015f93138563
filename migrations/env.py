"""Alembic's entry: runs migrations against the URL or connection it is handed.

Knows three ways to be handed a database, in order: a live connection in config.attributes["connection"]
(tests), a URL in config.attributes["url"] (servelab/store/migrate.py), `-x url=...` or the ini's
sqlalchemy.url (the alembic command line). Never reads the environment: the process entry point decides.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from servelab.store.db import make_engine, sqlalchemy_url
from servelab.store.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("url") or context.get_x_argument(as_dictionary=True).get("url")
    url = url or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit(
            "no database URL: run `alembic -x url=postgresql+psycopg://USER@HOST:PORT/DB upgrade head`, "
            "or servelab.store.migrate.upgrade(url)"
        )
    return url


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(url=sqlalchemy_url(_url()), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
