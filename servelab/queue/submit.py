"""Submitting requests: commit their rows, then add their ids to their configs' streams, one request or a group
at once (one transaction, one round trip to Redis); and cancelling one whose client left: commit the cancel,
then tell its worker and its waiters.

Knows the one rule that makes the queue safe to lose: the Postgres row exists (committed) before
its id is in Redis, so a lost entry can always be found again and no entry points at nothing. A group admits
under each tenant's queue limit and honours idempotency keys; one submission's failure fails it alone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import redis
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from servelab.idempotency import Fingerprint, KeyReused, KeyUse, check_reuse
from servelab.queue.streams import RequestStreams, end_event, enqueue_all, notify_done
from servelab.queue.tokens import request_cancel
from servelab.request import SamplingParams
from servelab.store import admission, keys
from servelab.store import idempotency as idempotency_keys
from servelab.store import requests as store
from servelab.store.admission import NewRequest, QueueFull
from servelab.store.db import commit_without_waiting, flush_commits, session_scope
from servelab.store.models import StreamKind

log = logging.getLogger(__name__)


def submit_request(
    *, sessions: sessionmaker[Session], streams: RequestStreams, kind: StreamKind = StreamKind.INTERACTIVE,
    prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
    sampling: SamplingParams | None = None, tenant: str = "default", priority: int = 0,
) -> str:
    with session_scope(sessions) as session:
        request_id = store.create_request(
            session, serving_config_name=streams.config_name, stream=kind, prompt=prompt, messages=messages,
            sampling=sampling, tenant=tenant, priority=priority,
        )
    streams.enqueue(request_id, kind)
    return request_id


def cancel_for_client(*, sessions: sessionmaker[Session], redis_client: redis.Redis, prefix: str, request_id: str,
                      now: datetime, if_queued: bool = False) -> bool:
    """Cancel a request whose client left (if_queued: only if no worker has started it); -> whether it was.

    NOTE: after the commit, the cancel flag (a worker that reads it finds the row cancelled and drops it at its
    next step) and the end notification (a waiting call wakes up)."""
    with session_scope(sessions) as session:
        cancelled = store.cancel_request(session, request_id=request_id, now=now, if_queued=if_queued)
    if cancelled:
        request_cancel(redis_client, prefix=prefix, request_id=request_id)
        notify_done(redis_client, prefix=prefix, ends={request_id: end_event(
            "cancelled", finish_reason="cancelled", error=store.CANCELLED_BY_CLIENT)})
    return cancelled


@dataclass(frozen=True)
class Posted:
    """One submission of a group: the request, and the Idempotency-Key it came with (and its fingerprint)."""

    request: NewRequest
    key: str | None = None
    fingerprint: Fingerprint | None = None

    def __post_init__(self) -> None:
        assert (self.key is None) == (self.fingerprint is None), "a key comes with the submission's fingerprint"


@dataclass(frozen=True)
class Admitted:
    request_ids: tuple[str, ...]  # one per choice (n), in order
    replayed: bool = False  # the key named an earlier submission: this one joins that one's request

    @property
    def request_id(self) -> str:
        """The first choice's: the request's id."""
        return self.request_ids[0]


Outcome = Admitted | QueueFull | KeyReused | Exception


def submit_group(posts: Sequence[Posted], *, sessions: sessionmaker[Session], redis_client: redis.Redis, prefix: str,
                 max_queued: int, key_ttl: timedelta, now: datetime) -> list[Outcome]:
    """Admit a group in one transaction, then enqueue what it made in one round trip; -> each one's outcome.

    NOTE: when the transaction fails (a row PostgreSQL refuses), each submission is tried again alone, so the
    one at fault fails and the others go through. The group's commit does not wait for the disk, so its
    tenants' counters are unlocked at once (the next group of a tenant need not wait for an fsync); it is on
    disk (flush_commits) before any id is enqueued or answered, and so is the commit of an earlier group whose
    request a key replays. A failure after the commit (the flush, Redis) fails the group's admitted
    submissions, never retries them: their rows may be queued, and the reaper puts their ids back.
    """
    try:
        with session_scope(sessions) as session:
            commit_without_waiting(session)
            outcomes, made = _admit(session, posts, max_queued=max_queued, key_ttl=key_ttl, now=now)
    except SQLAlchemyError as exc:
        if len(posts) == 1:
            return [exc]
        log.warning("a group of %d submissions failed (%s); trying each alone", len(posts), exc)
        return [outcome for post in posts for outcome in submit_group(
            [post], sessions=sessions, redis_client=redis_client, prefix=prefix, max_queued=max_queued,
            key_ttl=key_ttl, now=now)]
    try:
        if any(isinstance(o, Admitted) for o in outcomes):  # NOTE: a replay may name another's unflushed commit
            flush_commits(sessions)
        # NOTE: a request's choices side by side in its stream, so a worker reads them into one batch
        enqueue_all(redis_client, prefix=prefix,
                    entries=[(i, r.serving_config_name, r.stream) for r in made for i in r.ids])
    except (SQLAlchemyError, redis.RedisError) as exc:
        return [exc if isinstance(o, Admitted) else o for o in outcomes]
    return outcomes


def _admit(session: Session, posts: Sequence[Posted], *, max_queued: int, key_ttl: timedelta,
           now: datetime) -> tuple[list[Outcome], list[NewRequest]]:
    """Inside one transaction: find what the keys name (before the counters are locked), admit the new
    requests in one statement, remember the new keys; -> each post's outcome, and the requests made."""
    for tenant in sorted({p.request.tenant for p in posts if p.key is not None}):
        keys.lock_tenant(session, tenant)  # NOTE: one use of a tenant's keys at a time; before the counters
    uses = idempotency_keys.find_keys(session, tenant_keys=[(p.request.tenant, p.key) for p in posts if p.key],
                                      now=now)
    outcomes: list[Outcome | None] = [None] * len(posts)
    maker: dict[tuple[str, str], int] = {}  # (tenant, key) -> the post that makes its request in this group
    follows: dict[int, int] = {}  # a post -> the earlier one of the group whose key it repeats
    fresh: list[int] = []
    for i, post in enumerate(posts):
        pair = (post.request.tenant, post.key)
        if post.key is not None and pair in maker:
            earlier = posts[maker[pair]]
            outcomes[i] = _reused(KeyUse(post.key, earlier.fingerprint, earlier.request.id, now, now + key_ttl), post)
            if outcomes[i] is None:
                follows[i] = maker[pair]
            continue
        if post.key is not None and pair in uses:
            outcomes[i] = _replay(session, post, uses[pair])
            if outcomes[i] is not None:
                continue
        if post.key is not None:
            maker[pair] = i
        fresh.append(i)
    admitted = admission.admit_requests(session, [posts[i].request for i in fresh], max_queued=max_queued)
    for i in fresh:
        r = posts[i].request
        outcomes[i] = (Admitted(r.ids) if r.id in admitted
                       else QueueFull.of(r.tenant, max_queued=max_queued, num_choices=r.num_choices))
    idempotency_keys.save_keys(session, uses=[(p.request.tenant, p.key, p.fingerprint, p.request.id)
                                              for p in (posts[i] for i in maker.values()) if p.request.id in admitted],
                               now=now, ttl=key_ttl)
    for i, j in follows.items():
        first = outcomes[j]
        outcomes[i] = Admitted(first.request_ids, replayed=True) if isinstance(first, Admitted) else first
    return outcomes, [posts[i].request for i in fresh if posts[i].request.id in admitted]


def _reused(first: KeyUse, post: Posted) -> KeyReused | None:
    """KeyReused when the post's body differs from the key's first use; None: the same submission again."""
    try:
        check_reuse(first, post.fingerprint)
    except KeyReused as exc:
        return exc
    return None


def _replay(session: Session, post: Posted, first: KeyUse) -> Outcome | None:
    """The request an earlier use of the key made (KeyReused when the body differs); None: a new submission."""
    reused = _reused(first, post)
    if reused is not None:
        return reused
    if store.get_request_view(session, request_id=first.resource_id, tenant=post.request.tenant) is not None:
        # NOTE: the key names the first choice; the others are found from it
        ids = store.choice_ids(session, request_id=first.resource_id, tenant=post.request.tenant)
        return Admitted(tuple(ids), replayed=True)
    return None  # NOTE: its request is gone (deleted): the key makes a new one
