"""The connections a process needs, built once at its entry point from Settings.

Knows the order: resolve the server URLs (starting the embedded Redis / PostgreSQL when no URL is
set), create and migrate the database, then open one Redis client and one SQLAlchemy engine.
Does not know what the process does with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from servelab.embedded import ServerURLs, resolve_urls
from servelab.settings import Settings
from servelab.store.db import ensure_database, make_engine, session_factory
from servelab.store.migrate import upgrade

# NOTE: blocking stream reads are cut into 1 s slices; the socket timeout must outlast one slice.
REDIS_SOCKET_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Runtime:
    settings: Settings
    urls: ServerURLs
    redis: redis.Redis
    db: Engine
    sessions: sessionmaker[Session]

    def close(self) -> None:
        self.redis.close()
        self.db.dispose()


def connect(settings: Settings, *, migrate: bool = True) -> Runtime:
    urls = resolve_urls(settings)
    if migrate:
        ensure_database(urls.database_url)
        upgrade(urls.database_url)
    client = redis.Redis.from_url(urls.redis_url, socket_timeout=REDIS_SOCKET_TIMEOUT_S)
    db = make_engine(urls.database_url)
    return Runtime(settings, urls, client, db, session_factory(db))
