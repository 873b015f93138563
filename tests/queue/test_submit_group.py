"""A group of submissions on real PostgreSQL and Redis: one transaction, then every id in its stream; a bad
submission fails alone; idempotency keys within a group and across groups; the queue limit per submission."""

from __future__ import annotations

import dataclasses

import uuid
from datetime import UTC, datetime, timedelta

import redis
from sqlalchemy import Engine, select

from servelab.idempotency import Fingerprint, KeyReused
from servelab.queue.streams import RequestStreams, enqueue_all, stream_key
from servelab.queue.submit import Admitted, Posted, submit_group
from servelab.request import SamplingParams
from servelab.store.admission import NewRequest, QueueFull
from servelab.store.db import session_factory, session_scope
from servelab.store.models import RequestRow, StreamKind

TTL = timedelta(hours=1)


def _post(tenant: str, prompt: str = "hi", *, key: str | None = None, body: dict | None = None,
          config: str = "fp32", kind: StreamKind = StreamKind.INTERACTIVE) -> Posted:
    request = NewRequest(tenant, config, kind, prompt, None, SamplingParams(max_new_tokens=1))
    fingerprint = None if key is None else Fingerprint.of("/v1/requests", body or {"prompt": prompt})
    return Posted(request, key, fingerprint)


def _submit(engine: Engine, redis_client: redis.Redis, prefix: str, posts: list[Posted], *, max_queued: int = 100):
    return submit_group(posts, sessions=session_factory(engine), redis_client=redis_client, prefix=prefix,
                        max_queued=max_queued, key_ttl=TTL, now=datetime.now(UTC))


def _stream_ids(redis_client: redis.Redis, prefix: str, config: str, kind: StreamKind) -> list[str]:
    return [fields[b"request_id"].decode() for _, fields in redis_client.xrange(stream_key(prefix, config, kind))]


def _rows(engine: Engine, ids: list[str]) -> set[str]:
    with session_scope(session_factory(engine)) as session:
        return {str(i) for i in session.scalars(select(RequestRow.id).where(RequestRow.id.in_(
            [uuid.UUID(i) for i in ids])))}


def test_a_group_is_committed_then_enqueued_on_each_configs_stream_in_order(engine, redis_client, key_prefix) -> None:
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    posts = [_post(tenant, "a"), _post(tenant, "b", config="bf16"), _post(tenant, "c", kind=StreamKind.BULK),
             _post(tenant, "d")]
    outcomes = _submit(engine, redis_client, key_prefix, posts)
    ids = [o.request_id for o in outcomes]
    assert all(isinstance(o, Admitted) and not o.replayed for o in outcomes) and len(set(ids)) == 4
    assert _rows(engine, ids) == set(ids)
    assert _stream_ids(redis_client, key_prefix, "fp32", StreamKind.INTERACTIVE) == [ids[0], ids[3]]
    assert _stream_ids(redis_client, key_prefix, "bf16", StreamKind.INTERACTIVE) == [ids[1]]
    assert _stream_ids(redis_client, key_prefix, "fp32", StreamKind.BULK) == [ids[2]]
    streams = RequestStreams(redis_client, prefix=key_prefix, config_name="fp32")
    assert streams.is_enqueued(ids[:1]) == [True]
    assert redis_client.xinfo_groups(stream_key(key_prefix, "bf16", StreamKind.INTERACTIVE)), "the group was made"


def test_a_submission_postgresql_refuses_fails_alone_and_its_group_goes_through(engine, redis_client,
                                                                                  key_prefix) -> None:
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    # NOTE: a priority past PostgreSQL's integer: the edge bounds it, so only a bug could send it (a NUL, the
    # case this test used before, is now stored escaped and served)
    refused = _post(tenant, "out of range")
    refused = Posted(dataclasses.replace(refused.request, priority=2**40), refused.key, refused.fingerprint)
    posts = [_post(tenant, "fine"), refused, _post(tenant, "fine too")]
    outcomes = _submit(engine, redis_client, key_prefix, posts)
    assert isinstance(outcomes[0], Admitted) and isinstance(outcomes[2], Admitted)
    assert isinstance(outcomes[1], Exception) and not isinstance(outcomes[1], Admitted)
    good = [outcomes[0].request_id, outcomes[2].request_id]
    assert _rows(engine, good + [posts[1].request.id]) == set(good)
    assert _stream_ids(redis_client, key_prefix, "fp32", StreamKind.INTERACTIVE) == good


def test_the_queue_limit_is_per_submission_within_a_group(engine, redis_client, key_prefix) -> None:
    tenant, other = f"t-{uuid.uuid4().hex[:6]}", f"u-{uuid.uuid4().hex[:6]}"
    outcomes = _submit(engine, redis_client, key_prefix, [_post(tenant) for _ in range(4)] + [_post(other)],
                       max_queued=3)
    assert [type(o) for o in outcomes] == [Admitted, Admitted, Admitted, QueueFull, Admitted]
    assert "3 queued requests" in str(outcomes[3])
    assert len(_stream_ids(redis_client, key_prefix, "fp32", StreamKind.INTERACTIVE)) == 4


def test_a_key_repeated_in_a_group_or_a_later_one_joins_its_first_use(engine, redis_client, key_prefix) -> None:
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    first = _submit(engine, redis_client, key_prefix, [
        _post(tenant, "x", key="k1"), _post(tenant, "x", key="k1"), _post(tenant, "y", key="k1"),
        _post(tenant, "z", key="k2")])
    assert isinstance(first[0], Admitted) and not first[0].replayed
    assert first[1] == Admitted((first[0].request_id,), replayed=True)
    assert isinstance(first[2], KeyReused) and "prompt" in str(first[2])
    assert isinstance(first[3], Admitted) and not first[3].replayed
    again = _submit(engine, redis_client, key_prefix, [_post(tenant, "x", key="k1"), _post(tenant, "z", key="k2")])
    assert again == [Admitted((first[0].request_id,), replayed=True), Admitted((first[3].request_id,), replayed=True)]
    assert _stream_ids(redis_client, key_prefix, "fp32", StreamKind.INTERACTIVE) == [first[0].request_id,
                                                                                     first[3].request_id]


def test_a_keyed_submission_refused_for_the_limit_keeps_no_key(engine, redis_client, key_prefix) -> None:
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    full = _submit(engine, redis_client, key_prefix, [_post(tenant, "a"), _post(tenant, "b", key="k")], max_queued=1)
    assert isinstance(full[0], Admitted) and isinstance(full[1], QueueFull)
    later = _submit(engine, redis_client, key_prefix, [_post(tenant, "b", key="k")], max_queued=2)
    assert isinstance(later[0], Admitted) and not later[0].replayed, "a new request, not a replay of nothing"


def test_enqueue_all_makes_missing_groups_and_accepts_existing_ones(redis_client, key_prefix) -> None:
    entries = [(f"r{i}", "fp32", StreamKind.INTERACTIVE) for i in range(3)]
    assert enqueue_all(redis_client, prefix=key_prefix, entries=entries) == 3
    key = stream_key(key_prefix, "fp32", StreamKind.INTERACTIVE)
    assert [g["name"] for g in redis_client.xinfo_groups(key)] == [b"workers"]
    assert enqueue_all(redis_client, prefix=key_prefix, entries=entries[:1]) == 1  # BUSYGROUP is no error
    assert redis_client.xlen(key) == 4
    assert _stream_ids(redis_client, key_prefix, "fp32", StreamKind.INTERACTIVE) == ["r0", "r1", "r2", "r0"]
    assert redis_client.smembers(f"{key_prefix}:enqueued:fp32") == {b"r0", b"r1", b"r2"}


def test_a_requests_choices_are_admitted_all_or_none_seeded_apart_and_enqueued_side_by_side(
        engine, redis_client, key_prefix) -> None:
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    three = NewRequest(tenant, "fp32", StreamKind.INTERACTIVE, "hi", None, SamplingParams(max_new_tokens=1, seed=7),
                       num_choices=3)
    two = NewRequest(tenant, "fp32", StreamKind.INTERACTIVE, "hi", None, SamplingParams(max_new_tokens=1),
                     num_choices=2)
    one = NewRequest(tenant, "fp32", StreamKind.INTERACTIVE, "hi", None, SamplingParams(max_new_tokens=1))
    outcomes = _submit(engine, redis_client, key_prefix, [Posted(three), Posted(two), Posted(one)], max_queued=4)
    # 3 fit; the 2 would make 5 of 4 and go in not at all (no choice alone), nor the request after it (in order)
    assert isinstance(outcomes[0], Admitted) and outcomes[0].request_ids == three.ids and len(set(three.ids)) == 3
    assert isinstance(outcomes[1], QueueFull) and "no room for 2 more (one per choice)" in str(outcomes[1])
    assert isinstance(outcomes[2], QueueFull)
    assert _rows(engine, [*three.ids, *two.ids, one.id]) == set(three.ids)
    assert _stream_ids(redis_client, key_prefix, "fp32", StreamKind.INTERACTIVE) == list(three.ids)
    later = _submit(engine, redis_client, key_prefix, [Posted(one)], max_queued=4)  # the room left, in a new group
    assert isinstance(later[0], Admitted)
    with session_scope(session_factory(engine)) as session:
        rows = {str(r.id): r for r in session.scalars(select(RequestRow).where(
            RequestRow.id.in_([uuid.UUID(i) for i in three.ids])))}
    assert [(rows[i].choice_index, str(rows[i].first_choice_id), rows[i].sampling["seed"]) for i in three.ids] == [
        (0, three.id, 7), (1, three.id, 8), (2, three.id, 9)]
