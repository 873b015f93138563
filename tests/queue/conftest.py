"""A live serving worker on the tiny model, against the tests' real PostgreSQL and Redis."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import redis
from sqlalchemy.orm import Session, sessionmaker

from servelab.engine.engine import Engine
from servelab.scheduler.policy import BatchPolicy
from servelab.queue.streams import RequestStreams
from servelab.serving import FaultPolicy, ServingWorker
from servelab.store.db import session_factory
from tests.engine.conftest import (bundled_folder, settings, tiny_engine, tiny_folder,  # noqa: F401 (fixtures)
                                   tiny_transformers_engine)


@dataclass
class Served:
    """A worker serving one fresh config name; start() runs it in a thread until the test ends."""

    worker: ServingWorker
    streams: RequestStreams
    sessions: sessionmaker[Session]
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()


def step_until_one_finishes(worker: ServingWorker, *, max_steps: int) -> int:
    """Turn a worker step by step until a request ends (or max_steps pass); -> how many ended."""
    finished = 0
    for _ in range(max_steps):
        finished += worker.step()
        if finished:
            break
    return finished


def unblock_reads(client: redis.Redis, name: str) -> None:
    """End the blocking stream reads of the connections named `name` (this test's own) as if their wait ran out.

    NOTE: an idle worker blocks up to a second on its streams before it sees a stop; CLIENT UNBLOCK answers that
    read as a timeout would, so the worker leaves by the same path, without the wait.
    """
    for connection in client.client_list():
        if connection.get("name") == name and "b" in connection.get("flags", ""):
            client.client_unblock(int(connection["id"]))


def stop_and_join(worker: ServingWorker, thread: threading.Thread, client: redis.Redis, name: str,
                  timeout_s: float = 10.0) -> None:
    """Stop a worker running in `thread` and wait for it to leave (a liveness guard, never a timing check)."""
    worker.stop.set()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < deadline:
        unblock_reads(client, name)
        thread.join(timeout=0.05)
    assert not thread.is_alive(), "worker did not stop"


@contextmanager
def serving_workers(model: Engine, database, client: redis.Redis, key_prefix: str
                    ) -> Iterator[Callable[..., Served]]:
    """-> make(policy, faults): a worker on `model` serving a fresh config name; each started one is stopped at the
    end (and must stop)."""
    started: list[Served] = []

    def make(policy: BatchPolicy, faults: FaultPolicy = FaultPolicy(renew_every_s=0.2)) -> Served:
        streams = RequestStreams(client, prefix=key_prefix, config_name=f"tiny-{uuid.uuid4().hex[:8]}")
        sessions = session_factory(database)
        worker = ServingWorker(engine=model, streams=streams, sessions=sessions,
                               name=f"w-{uuid.uuid4().hex[:6]}", policy=policy, faults=faults)
        served = Served(worker, streams, sessions)
        started.append(served)
        return served

    yield make
    for served in started:
        served.worker.stop.set()
    for served in started:
        if served.thread is not None:
            stop_and_join(served.worker, served.thread, client, key_prefix)


@pytest.fixture
def make_served(tiny_engine: Engine, engine, redis_client: redis.Redis, key_prefix: str) -> Iterator:
    with serving_workers(tiny_engine, engine, redis_client, key_prefix) as make:
        yield make
