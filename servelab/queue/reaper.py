"""The reaper: re-add unfinished requests whose stream entry was lost (Redis restarted empty, say).

Knows the rule: an unfinished row old enough that its entry should long have been read (queued) or
renewed (running), and whose id is missing from its config's set of enqueued ids, is enqueued again.
Imports no torch: the GPU worker runs it for its own config, the control plane for every config.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from servelab.queue.streams import RequestStreams
from servelab.store import requests as store
from servelab.store.db import session_scope


def reenqueue_lost(*, sessions: sessionmaker[Session], streams: RequestStreams, grace: timedelta,
                   now: datetime) -> int:
    with session_scope(sessions) as session:
        ids = store.find_lost_candidates(session, serving_config_name=streams.config_name,
                                         queued_before=now - grace, started_before=now - 2 * grace)
        lost = [i for i, present in zip(ids, streams.is_enqueued(ids)) if not present]
        kinds = store.stream_of(session, lost)
    for request_id in lost:
        streams.enqueue(request_id, kinds[request_id])
    return len(lost)
