"""PostgreSQL restarted under two serving workers: they wait it out with their rows in hand, the claim keeper
renews every claim through the outage (no take-over, with a claim idle time shorter than the outage), and
every request runs exactly once.

NOTE: no take-over is read from Redis (every held entry keeps its owner and its delivery count through the
outage: a take-over changes both, a renewal neither), and exactly once from what a second run would count
above one (tests/queue/exactly_once.py), never from how long a claim went unrenewed.

The PostgreSQL here is one of the test's own (the embedded pgserver: a real PostgreSQL 16 in a temporary
folder), so stopping it disturbs no other test; Redis is the tests' server.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import func, select

from servelab.engine.engine import Engine
from servelab.scheduler.policy import BatchPolicy
from servelab.queue.streams import RequestStreams
from servelab.queue.submit import submit_request
from servelab.request import SamplingParams
from servelab.serving import FaultPolicy, ServingWorker
from servelab.settings import Settings
from servelab.store.db import make_engine, session_factory, session_scope
from servelab.store.migrate import upgrade
from servelab.store.models import RequestRow, RequestStatus
from tests.conftest import REDIS_URL
from tests.engine.conftest import bundled_folder, make_config, settings, tiny_folder  # noqa: F401 (fixtures)
from tests.queue.exactly_once import assert_each_ran_to_one_end, deliveries, read_ledger, reference_token_ids

pytest.importorskip("pgserver", reason="the embedded PostgreSQL (the `local` extra) is the server this test restarts")
from servelab.embedded import resolve_urls, stop_embedded  # noqa: E402

CLAIM_IDLE_MS = 1_000
OUTAGE_S = 3.0  # three claim idle times: a claim that is not renewed lapses
LONG = SamplingParams(max_new_tokens=300, ignore_eos=True)


class RestartablePostgres:
    def __init__(self) -> None:
        # NOTE: not under tmp_path, which pytest keeps at mode 0700: PostgreSQL runs as the 'pgserver' user there
        self.state_dir = Path(tempfile.mkdtemp(prefix="servelab-embedded-"))
        self.settings = Settings(redis_url=REDIS_URL, database_url=None, state_dir=self.state_dir)
        self.url = resolve_urls(self.settings).database_url

    def stop(self) -> None:
        assert [s.kind for s in stop_embedded(self.settings)] == ["pg"]

    def start(self) -> None:
        assert resolve_urls(self.settings).database_url == self.url, "the restarted server must keep its address"

    def close(self) -> None:
        stop_embedded(self.settings)
        shutil.rmtree(self.state_dir, ignore_errors=True)


@pytest.fixture
def postgres() -> Iterator[RestartablePostgres]:
    server = RestartablePostgres()
    try:
        upgrade(server.url)
        yield server
    finally:
        server.close()


def test_a_postgres_restart_under_serving_workers_renews_every_claim_and_runs_each_request_once(
        postgres: RestartablePostgres, tiny_folder: Path, settings: Settings,  # noqa: F811
        redis_client: redis.Redis, key_prefix: str) -> None:
    database = make_engine(postgres.url)
    sessions = session_factory(database)
    streams = RequestStreams(redis_client, prefix=key_prefix, config_name=f"tiny-{uuid.uuid4().hex[:8]}")
    config = make_config(str(tiny_folder), decoding={"max_new_tokens": 300, "max_context_tokens": 400})
    faults = FaultPolicy(claim_idle_ms=CLAIM_IDLE_MS, renew_every_s=0.1, reap_every_s=0.5, heartbeat_every_s=0.2)
    workers = [ServingWorker(engine=Engine.from_config(config, settings), streams=streams, sessions=sessions,
                             name=f"w{i}-{uuid.uuid4().hex[:6]}", faults=faults,
                             policy=BatchPolicy(max_batch_size=4, max_wait_ms=20, max_batch_tokens=100_000))
               for i in range(2)]
    prompts = [f"the cat sat on mat {i}" for i in range(16)]
    ids = [submit_request(sessions=sessions, streams=streams, prompt=prompt, sampling=LONG) for prompt in prompts]
    renewals = {w.name: 0 for w in workers}
    real_renew = streams.renew

    def counted_renew(consumer, entries):
        renewals[consumer] += 1
        return real_renew(consumer, entries)

    streams.renew = counted_renew
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while not _count(sessions, ids, RequestStatus.RUNNING):
            assert time.monotonic() < deadline, "no request started"
            time.sleep(0.01)

        postgres.stop()
        held = deliveries(streams)  # request id -> (owner, times delivered)
        assert held, "the workers hold no entry during the outage: it overlapped no work"
        renewed_before = dict(renewals)
        time.sleep(OUTAGE_S)  # NOTE: the outage's length, three claim idle times; nothing here is timed
        assert all(t.is_alive() for t in threads), "a worker died with the database down"
        still_held = deliveries(streams)
        assert {i: still_held.get(i) for i in held} == held, "an entry was taken over (or lost) during the outage"
        assert all(renewals[w] > renewed_before[w] for w in renewals), "a worker's keeper renewed nothing"
        postgres.start()

        deadline = time.monotonic() + 120
        while _count(sessions, ids, RequestStatus.SUCCEEDED) < len(ids):
            assert time.monotonic() < deadline, "not every request finished after the restart"
            assert all(t.is_alive() for t in threads), "a worker died after the restart"
            time.sleep(0.1)
        while (ledger := read_ledger(sessions=sessions, streams=streams, ids=ids)).num_pending:
            assert time.monotonic() < deadline, "an entry was never acknowledged"  # NOTE: the ack follows the commit
            time.sleep(0.1)
        assert_each_ran_to_one_end(ledger, ids, succeeded=set(ids))
        assert ledger.attempts == dict.fromkeys(ids, 1), "a request started more than once"
        reference = Engine.from_config(config, settings)  # the workers' limits: 300 new tokens fit its context
        assert ledger.token_ids == reference_token_ids(reference, dict(zip(ids, prompts)), max_new_tokens=300,
                                                       ignore_eos=True)
    finally:
        for worker in workers:
            worker.stop.set()
        for thread in threads:
            thread.join(timeout=30)
        database.dispose()


def _count(sessions, ids: list[str], status: RequestStatus) -> int:
    with session_scope(sessions) as session:
        return session.scalar(select(func.count()).where(RequestRow.id.in_([uuid.UUID(i) for i in ids]),
                                                         RequestRow.status == status))
