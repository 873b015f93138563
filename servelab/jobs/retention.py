"""Retention: the control plane removes finished requests (their results and metrics), batch records and files
older than the configured ages, in small batches, each its own transaction, until done or out of time.

Knows the order (requests first, whose metrics name the batches; then batches; then files), the slice size and
the time budget of one run. Does not know SQL (servelab.store.retention) or Celery (worker/jobs.py's beat task).
What is kept, whatever its age: unfinished requests, what a lab run sent (runs and comparisons are built from
it), the requests and files of batch jobs still running, runs, comparisons, sweeps, batch jobs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from servelab.settings import ServiceSettings
from servelab.store import retention as store
from servelab.store.db import session_scope


@dataclass(frozen=True)
class RetentionPolicy:
    max_age: timedelta | None  # finished requests with results and metrics, batch records; None keeps them
    max_file_age: timedelta | None  # files; None keeps them
    max_rows_per_slice: int = 1_000  # NOTE: one transaction each: locks and WAL stay small, workers never wait long
    budget_s: float = 30.0  # one run stops after this; the next run goes on where it stopped

    @classmethod
    def from_settings(cls, settings: ServiceSettings) -> RetentionPolicy:
        def age(days: float) -> timedelta | None:
            return timedelta(days=days) if days > 0 else None

        return cls(age(settings.retention_days), age(settings.file_retention_days))


@dataclass(frozen=True)
class Pruned:
    num_requests: int
    num_batches: int
    num_files: int  # deleted, or their content erased
    is_done: bool  # False: the time budget ran out first


def prune(*, sessions: sessionmaker[Session], policy: RetentionPolicy, now: datetime,
          clock: Callable[[], float] = time.monotonic) -> Pruned:
    """One run: every kind in order, slice after slice, while slices come back full and time is left."""
    deadline = clock() + policy.budget_s
    limit = policy.max_rows_per_slice

    def drain(step: Callable[[Session, object], tuple[int, object]]) -> tuple[int, bool]:
        total, position = 0, None
        while clock() < deadline:
            with session_scope(sessions) as session:
                n, position = step(session, position)
            total += n
            if n < limit:
                return total, True
        return total, False

    num_requests = num_batches = num_files = 0
    done = True
    if policy.max_age is not None:
        cutoff = now - policy.max_age
        num_requests, done = drain(lambda s, after: store.delete_old_requests(s, cutoff=cutoff, after=after,
                                                                              limit=limit))
        if done:
            num_batches, done = drain(lambda s, after: store.delete_old_batches(s, cutoff=cutoff, after=after,
                                                                                limit=limit))
    if done and policy.max_file_age is not None:
        file_cutoff = now - policy.max_file_age
        num_files, done = drain(lambda s, _: (store.delete_old_files(s, cutoff=file_cutoff, now=now, limit=limit),
                                              None))
    return Pruned(num_requests, num_batches, num_files, done)
