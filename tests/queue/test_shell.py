"""The worker as the shell around the scheduler, at its edges: a stop that comes during a read admits nothing, and
a second entry of a request the worker already holds (the reaper re-added it) is acknowledged, not served twice.
Real Redis and PostgreSQL, the tiny model, driven step by step."""

from __future__ import annotations

import uuid

from servelab.queue.streams import GROUP, stream_key
from servelab.queue.submit import submit_request
from servelab.request import SamplingParams
from servelab.scheduler.policy import BatchPolicy
from servelab.store.db import session_scope
from servelab.store.models import RequestRow, RequestStatus, StreamKind
from tests.queue.conftest import step_until_one_finishes

POLICY = BatchPolicy(max_batch_size=4, max_wait_ms=0, max_batch_tokens=100_000, policy="continuous")


def test_a_stop_during_the_read_claims_nothing_it_read(make_served) -> None:
    served = make_served(POLICY)
    served.streams.ensure_groups()
    request_id = submit_request(sessions=served.sessions, streams=served.streams, prompt="the cat sat",
                                sampling=SamplingParams(max_new_tokens=3))
    real_read = served.streams.read_new

    def read_then_stop(*args, **kwargs):
        entries = real_read(*args, **kwargs)
        served.worker.stop.set()  # SIGTERM arrives while the read blocks
        return entries

    served.streams.read_new = read_then_stop
    assert served.worker.step() == 0
    assert served.worker.running == []  # held, read from its stream, but not started
    assert [r.request_id for r in served.worker.scheduler.waiting] == [request_id]
    with session_scope(served.sessions) as session:
        row = session.get(RequestRow, uuid.UUID(request_id))
        assert (row.status, row.num_attempts) == (RequestStatus.QUEUED, 0)  # not claimed: no attempt counted


def test_a_second_entry_of_a_held_request_is_acknowledged_not_served_twice(make_served) -> None:
    served = make_served(POLICY)
    served.streams.ensure_groups()
    request_id = submit_request(sessions=served.sessions, streams=served.streams, prompt="the cat sat",
                                sampling=SamplingParams(max_new_tokens=8, ignore_eos=True))
    served.worker.step()  # read, claimed, prefilled, one step: it is running
    assert [r.request_id for r in served.worker.running] == [request_id]
    served.streams.enqueue(request_id, StreamKind.INTERACTIVE)  # what the reaper does when Redis lost the entry
    finished = step_until_one_finishes(served.worker, max_steps=20)
    assert finished == 1
    assert [r.request_id for r in served.worker.scheduler.waiting] == []  # the second entry never waited
    client, key = served.streams.client, stream_key(served.streams.prefix, served.streams.config_name,
                                                    StreamKind.INTERACTIVE)
    assert client.xpending(key, GROUP)["pending"] == 0  # both entries acknowledged
    assert served.worker.held.entries == {}
    with session_scope(served.sessions) as session:
        assert session.get(RequestRow, uuid.UUID(request_id)).num_attempts == 1  # started once
