"""Submissions at a front end's rate: a key's tenant and the catalog are cached with a stated bound on staleness,
submissions that arrive together are written as one group (each answered once its row is committed and its id
is in the stream), and the queue limit's counter is exact after the api process is killed mid-load."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

import httpx
from sqlalchemy import event, select

from api.app import create_app
from api.caches import MIN_RELOAD_S
from servelab.config import ServingConfig
from servelab.queue.streams import stream_key
from servelab.store import admission, keys
from servelab.store import requests as request_store
from servelab.store.db import session_scope
from servelab.store.models import RequestRow, StreamKind
from tests.api.conftest import api_process
from tests.conftest import REPO

BODY = {"config": "fp32", "prompt": "hi", "sampling": {"max_new_tokens": 1}}


@contextmanager
def statements(engine, table: str) -> Iterator[list[str]]:
    """The SQL statements that name a table, as they are sent."""
    seen: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany) -> None:
        if table in statement:
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


class FakeClock:
    """The caches' clock, moved by the test: staleness bounds checked at their edges, never by sleeping."""

    def __init__(self) -> None:
        self.now_s = 1_000.0

    def __call__(self) -> float:
        return self.now_s


def app_on_fake_clock(stack):
    app = create_app(stack.runtime, stack.settings)
    clock = FakeClock()
    app.state.servelab.tenants.clock = app.state.servelab.catalogs.clock = clock
    return app, clock


def test_a_keys_tenant_is_looked_up_once_per_period_and_a_revoked_key_is_refused_after_it(make_stack) -> None:
    from fastapi.testclient import TestClient

    stack = make_stack(with_worker=False, key_cache_s=1.0)
    key = stack.key("acme")
    app, clock = app_on_fake_clock(stack)
    api = TestClient(app, headers={"Authorization": f"Bearer {key}"})
    with statements(stack.runtime.db, "api_keys") as lookups:
        assert all(api.get("/v1/batches").status_code == 200 for _ in range(5))
    assert len(lookups) == 1, "one look-up, then the cache"
    with session_scope(stack.runtime.sessions) as session:
        assert keys.revoke_key(session, key=key, now=datetime.now(UTC))
    clock.now_s += 0.999  # within key_cache_s of the look-up: the cache answers, as its bound allows
    with statements(stack.runtime.db, "api_keys") as lookups:
        assert api.get("/v1/batches").status_code == 200
    assert lookups == []
    clock.now_s += 0.001  # key_cache_s after the look-up: asked again, and refused
    with statements(stack.runtime.db, "api_keys") as lookups:
        assert api.get("/v1/batches").status_code == 401, "refused once key_cache_s has passed since the look-up"
    assert len(lookups) == 1
    with statements(stack.runtime.db, "api_keys") as lookups:
        assert api.get("/v1/batches").status_code == 401
    assert len(lookups) == 1, "a refused key is never remembered: it is looked up again"


def test_the_catalog_is_cached_and_a_config_registered_later_is_accepted_within_a_second(make_stack) -> None:
    from fastapi.testclient import TestClient

    stack = make_stack(with_worker=False, catalog_cache_s=3_600.0)
    app, clock = app_on_fake_clock(stack)
    api = TestClient(app, headers={"Authorization": f"Bearer {stack.key('acme')}"})
    with statements(stack.runtime.db, "workers") as loads:
        assert all(api.post("/v1/requests", json=BODY).status_code == 202 for _ in range(4))
    assert len(loads) == 1, "one catalog load for four submissions"
    late = ServingConfig.from_yaml(REPO / "configs" / "fp32.yaml").model_copy(
        update={"name": f"late-{uuid.uuid4().hex[:6]}"})
    with session_scope(stack.runtime.sessions) as session:
        request_store.save_serving_config(session, config=late)
        request_store.register_worker(session, name=f"w-{uuid.uuid4().hex[:6]}", serving_config_name=late.name,
                                      config_hash=late.config_hash, hardware={}, software={})
    clock.now_s += MIN_RELOAD_S - 0.001  # NOTE: a missing name reloads the catalog at most once per MIN_RELOAD_S
    with statements(stack.runtime.db, "workers") as loads:
        assert api.post("/v1/requests", json={**BODY, "config": late.name}).status_code == 404
    assert loads == [], "a missing name reloaded the catalog sooner than MIN_RELOAD_S after its load"
    clock.now_s += 0.001
    with statements(stack.runtime.db, "workers") as loads:
        posted = api.post("/v1/requests", json={**BODY, "config": late.name})
    assert posted.status_code == 202, posted.text
    assert len(loads) == 1, "the name it lacked reloaded the catalog, an hour before its time"
    assert api.post("/v1/requests", json={**BODY, "config": "nope"}).status_code == 404


def test_submissions_that_arrive_together_are_one_group_each_committed_and_enqueued(make_stack) -> None:
    stack = make_stack(with_worker=False, submit_wait_ms=50.0)
    app = create_app(stack.runtime, stack.settings)
    headers = {"Authorization": f"Bearer {stack.key('acme')}"}

    async def post_all() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api", headers=headers) as client:
            return await asyncio.gather(*(client.post("/v1/requests", json={**BODY, "prompt": f"p{i}"})
                                          for i in range(20)))

    answers = asyncio.run(post_all())
    assert [a.status_code for a in answers] == [202] * 20
    ids = [a.json()["id"] for a in answers]
    stats = app.state.servelab.submissions.stats
    assert stats.num_items == 20 and stats.num_groups <= 2, stats
    with session_scope(stack.runtime.sessions) as session:
        stored = {str(i) for i in session.scalars(select(RequestRow.id).where(
            RequestRow.id.in_([uuid.UUID(i) for i in ids])))}
    assert stored == set(ids)
    key = stream_key(stack.settings.key_prefix, "fp32", StreamKind.INTERACTIVE)
    queued = {fields[b"request_id"].decode() for _, fields in stack.runtime.redis.xrange(key)}
    assert set(ids) <= queued


def test_the_queue_counter_is_exact_after_the_api_process_is_killed_mid_load(make_stack) -> None:
    stack = make_stack(with_worker=False, max_queued_requests=400)
    tenant = f"crash-{uuid.uuid4().hex[:6]}"
    key = stack.key(tenant)
    accepted: list[int] = []
    started: list[subprocess.Popen] = []
    with api_process(stack, started) as url:
        stop = threading.Event()

        def hammer() -> None:
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=5) as client:
                while not stop.is_set():
                    try:
                        if client.post("/requests", json=BODY).status_code == 202:
                            accepted.append(1)
                    except httpx.HTTPError:
                        return

        threads = [threading.Thread(target=hammer) for _ in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(accepted) < 60 and time.monotonic() < deadline:
            time.sleep(0.01)
        started[0].send_signal(signal.SIGKILL)  # NOTE: mid-load: groups in flight die with their transactions
        stop.set()
        for t in threads:
            t.join()
    with session_scope(stack.runtime.sessions) as session:
        counter, rows = admission.num_queued(session, tenant), keys.num_queued_requests(session, tenant)
    assert counter == rows >= len(accepted) > 0, (counter, rows, len(accepted))
    with api_process(stack) as url, httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as client:
        codes = [client.post("/requests", json=BODY).status_code for _ in range(400 - rows + 3)]
    assert codes == [202] * (400 - rows) + [429] * 3, "after a restart the room is exactly what the rows leave"
