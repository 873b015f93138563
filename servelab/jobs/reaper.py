"""The control plane's reaper: re-add unfinished requests whose stream entry was lost (Redis restarted empty).

Runs the data plane's rule (servelab/queue/reaper.py) for every serving config with unfinished rows, so
lost entries are found even for a config whose workers are all down. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import distinct, select
from sqlalchemy.orm import Session, sessionmaker

from servelab.queue.reaper import reenqueue_lost
from servelab.queue.streams import RequestStreams
from servelab.store.db import session_scope
from servelab.store.models import RequestRow, RequestStatus


def reap_lost(*, sessions: sessionmaker[Session], streams_for: Callable[[str], RequestStreams], grace: timedelta,
              now: datetime) -> int:
    with session_scope(sessions) as session:
        names = session.scalars(select(distinct(RequestRow.serving_config_name))
                                .where(RequestRow.status.in_((RequestStatus.QUEUED, RequestStatus.RUNNING)))).all()
    return sum(reenqueue_lost(sessions=sessions, streams=streams_for(name), grace=grace, now=now) for name in names)
