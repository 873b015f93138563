"""Admission under a tenant's queue limit on a real PostgreSQL: the counter the triggers keep equals the rows,
and the limit holds exactly, under concurrent groups, worker claims and cancels, and after a transaction dies
with its connection (a crashed api process)."""

from __future__ import annotations

import random
import threading
import uuid
from datetime import UTC, datetime

import psycopg
from sqlalchemy import Engine, delete, select, text, update
from sqlalchemy.exc import DBAPIError

from servelab.request import SamplingParams
from servelab.store import admission, keys
from servelab.store import requests as request_store
from servelab.store.admission import NewRequest
from servelab.store.db import session_factory, session_scope
from servelab.store.models import RequestRow, RequestStatus, StreamKind, TenantQueueRow


def _new(tenant: str, n: int, *, kind: StreamKind = StreamKind.INTERACTIVE) -> list[NewRequest]:
    return [NewRequest(tenant, "fp32", kind, f"prompt {i}", None, SamplingParams(max_new_tokens=1)) for i in range(n)]


def _counted(engine: Engine, tenant: str) -> tuple[int, int]:
    """(the counter, COUNT(*) of the tenant's queued rows with no batch job)."""
    with session_scope(session_factory(engine)) as session:
        return admission.num_queued(session, tenant), keys.num_queued_requests(session, tenant)


def _tenant() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def test_a_group_admits_what_fits_in_order_and_the_counter_follows_every_change(engine: Engine) -> None:
    sessions, tenant, other = session_factory(engine), _tenant(), _tenant()
    group = _new(tenant, 5) + _new(other, 2)
    with session_scope(sessions) as session:
        admitted = admission.admit_requests(session, group, max_queued=3)
    assert admitted == {r.id for r in group[:3] + group[5:]}, "the first three of the tenant, both of the other"
    assert _counted(engine, tenant) == (3, 3) and _counted(engine, other) == (2, 2)
    ids = [r.id for r in group[:3]]
    with session_scope(sessions) as session:
        assert set(request_store.claim_requests(session, ids=ids[:1], now=datetime.now(UTC))) == {ids[0]}
        assert request_store.cancel_request(session, request_id=ids[1], now=datetime.now(UTC), if_queued=True)
    assert _counted(engine, tenant) == (1, 1)
    with session_scope(sessions) as session:  # running and finished rows are not counted, deleted queued rows are
        session.execute(delete(RequestRow).where(RequestRow.id.in_([uuid.UUID(i) for i in ids])))
        session.execute(update(RequestRow).where(RequestRow.tenant == other).values(batch_job_id=uuid.uuid4()))
    assert _counted(engine, tenant) == (0, 0) and _counted(engine, other) == (0, 0)


def test_bulk_rows_and_other_statuses_never_count(engine: Engine) -> None:
    sessions, tenant = session_factory(engine), _tenant()
    with session_scope(sessions) as session:
        for r in _new(tenant, 3, kind=StreamKind.BULK):
            request_store.create_request(session, serving_config_name="fp32", stream=StreamKind.BULK, prompt=r.prompt,
                                         tenant=tenant, batch_job_id=uuid.uuid4(), custom_id="c")
        request_store.create_request(session, serving_config_name="fp32", stream=StreamKind.INTERACTIVE,
                                     prompt="hi", tenant=tenant)
    assert _counted(engine, tenant) == (1, 1)


def test_the_limit_holds_exactly_under_concurrent_groups_claims_and_cancels(engine: Engine) -> None:
    """Eight threads post groups for two tenants while two others claim and cancel queued rows; a watcher reads
    the counters all along. No commit ever leaves a tenant above its limit, and the counters end equal to the
    rows. With no claims, exactly the limit is admitted however the groups interleave."""
    sessions, tenants, max_queued = session_factory(engine), [_tenant(), _tenant()], 25
    stop, seen, failures = threading.Event(), [], []
    admitted_first: list[int] = []

    def post(seed: int, n_groups: int, out: list[int]) -> None:
        rnd = random.Random(seed)
        try:
            for _ in range(n_groups):
                group = [r for t in tenants for r in _new(t, rnd.randint(0, 6))]
                with session_scope(sessions) as session:
                    out.append(len(admission.admit_requests(session, group, max_queued=max_queued)))
        except Exception as exc:  # noqa: BLE001 (reported below)
            failures.append(exc)

    def drain(seed: int) -> None:
        rnd = random.Random(seed)
        while not stop.is_set():
            with session_scope(sessions) as session:
                ids = [str(i) for i in session.scalars(select(RequestRow.id).where(
                    RequestRow.tenant.in_(tenants), RequestRow.status == RequestStatus.QUEUED).limit(4))]
                if ids and rnd.random() < 0.5:
                    request_store.claim_requests(session, ids=ids, now=datetime.now(UTC))
                elif ids:
                    request_store.cancel_request(session, request_id=ids[0], now=datetime.now(UTC))

    def watch() -> None:
        while not stop.is_set():
            with session_scope(sessions) as session:
                seen.extend(session.scalars(select(TenantQueueRow.num_queued)
                                            .where(TenantQueueRow.tenant.in_(tenants))))

    # first, no claims: exactly the limit per tenant is admitted, whatever the interleaving
    threads = [threading.Thread(target=post, args=(i, 6, admitted_first)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert sum(admitted_first) == 2 * max_queued
    assert [_counted(engine, t) for t in tenants] == [(max_queued, max_queued)] * 2

    # then with claims and cancels running, and a watcher
    admitted_later: list[int] = []
    helpers = [threading.Thread(target=drain, args=(i,)) for i in range(2)] + [threading.Thread(target=watch)]
    threads = [threading.Thread(target=post, args=(100 + i, 8, admitted_later)) for i in range(8)]
    for t in helpers + threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    for t in helpers:
        t.join()
    assert not failures, failures
    assert sum(admitted_later) > 0, "the drains made room, and the posts took it"
    assert seen and max(seen) <= max_queued, f"a counter went above the limit: {max(seen)}"
    for t in tenants:
        counter, rows = _counted(engine, t)
        assert counter == rows <= max_queued


def test_a_transaction_that_dies_with_its_connection_leaves_the_counter_exact(engine: Engine) -> None:
    """A crashed api process: its group inserted and counted, never committed; its backend is terminated."""
    sessions, tenant = session_factory(engine), _tenant()
    with session_scope(sessions) as session:
        admission.admit_requests(session, _new(tenant, 2), max_queued=10)
    doomed = sessions()
    admitted = admission.admit_requests(doomed, _new(tenant, 5), max_queued=10)
    assert len(admitted) == 5
    pid = doomed.execute(text("SELECT pg_backend_pid()")).scalar_one()
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        conn.commit()
    try:
        doomed.commit()
        raise AssertionError("the terminated transaction committed")
    except DBAPIError as exc:
        assert isinstance(exc.orig, psycopg.OperationalError)
    finally:
        doomed.close()
    assert _counted(engine, tenant) == (2, 2)
    with session_scope(sessions) as session:  # and the room is what the rows leave
        assert len(admission.admit_requests(session, _new(tenant, 20), max_queued=10)) == 8
    assert _counted(engine, tenant) == (10, 10)
