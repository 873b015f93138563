"""Submitting a request: commit its row, then add its id to its config's stream; and cancelling one whose
client left: commit the cancel, then tell its worker and its waiters.

Knows the one rule that makes the queue safe to lose: the Postgres row exists (committed) before
its id is in Redis, so a lost entry can always be found again and no entry points at nothing.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import redis
from sqlalchemy.orm import Session, sessionmaker

from servelab.queue.streams import RequestStreams, end_event, notify_done
from servelab.queue.tokens import request_cancel
from servelab.request import SamplingParams
from servelab.store import requests as store
from servelab.store.db import session_scope
from servelab.store.models import StreamKind


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
