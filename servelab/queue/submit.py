"""Submitting a request: commit its row, then add its id to its config's stream.

Knows the one rule that makes the queue safe to lose: the Postgres row exists (committed) before
its id is in Redis, so a lost entry can always be found again and no entry points at nothing.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from servelab.queue.streams import RequestStreams
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
