"""The bulk feed: one loop that reads every batch job's lines into the configs' bulk streams, shared fairly.

Knows rounds: a round reads which jobs have lines left, how many bulk lines each config's stream holds not
yet started, the tenants' weights and each config's bound (max_bulk_queued_batches x its max_batch_size),
asks servelab/jobs/share.py how many lines each job may read now, and runs ingest_step for each, capped at
that; it waits THROTTLED_WAIT_S between rounds unless a job read a whole slice. Does not know Celery
(worker/jobs.py runs it as one task for every job) nor the share's arithmetic.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from servelab.catalog import Catalog, load_catalog
from servelab.jobs.ingest import CATALOG_MAX_AGE_S, THROTTLED_WAIT_S, IngestLimits, enqueue_bulk, ingest_step
from servelab.jobs.share import BulkJob, ShareState, share_round
from servelab.queue.streams import RequestStreams
from servelab.store import batch_jobs as store
from servelab.store import keys
from servelab.store.db import session_scope


@dataclass(frozen=True)
class Fed:
    num_lines: int  # lines read, over every job
    has_more: bool  # jobs still had lines to read when the time ran out


@dataclass(frozen=True)
class FeedRound:
    """What one round read from the store: the jobs with lines left, what waits in the bulk streams, weights."""

    jobs: list[tuple[uuid.UUID, str]]  # (job, tenant), oldest first
    queued: dict[tuple[str, uuid.UUID | None], int]  # (config, job) -> bulk lines not started
    weights: dict[str, float]


def bulk_bounds(catalog: Catalog, *, max_bulk_queued_batches: float) -> dict[str, int]:
    """Each config's bound on bulk lines queued and not started; {} when the bound is off (0).

    NOTE: the bound is in the config's own batches. The worker takes at most max_batch_size queued lines into
    its batch at a time (as rows free up), and the feed tops each queue up every round (THROTTLED_WAIT_S
    apart, plus the round's own few ms), so a worker never finds the stream empty while a job has lines
    left as long as it serves fewer than (batches - 1) x max_batch_size lines in one round: 3 x 16 lines in
    0.1 s for the served config (480 lines/s), far above what it serves on a CPU. A newcomer's first line
    waits behind at most the bound.
    """
    if max_bulk_queued_batches <= 0:
        return {}
    return {name: max(1, math.ceil(max_bulk_queued_batches * config.batching.max_batch_size))
            for name, config in catalog.configs.items()}


def free_room(bounds: Mapping[str, int], queued: Mapping[tuple[str, uuid.UUID | None], int]) -> dict[str, int]:
    """Each bounded config's bound less the bulk lines its stream holds not yet started."""
    held: dict[str, int] = {}
    for (name, _), n in queued.items():
        held[name] = held.get(name, 0) + n
    return {name: max(0, bound - held.get(name, 0)) for name, bound in bounds.items()}


def interleaved(visits: Sequence[tuple[str, int]], created: Mapping[str, Sequence[tuple[str, str]]]
                ) -> list[tuple[str, str]]:
    """The jobs' new requests in the order the share gave their lines: each visit takes up to that many of its
    job's next requests (fewer where its file ended; a bad line made none)."""
    taken = {job_id: 0 for job_id in created}
    ordered = []
    for job_id, n in visits:
        at = taken.get(job_id, 0)
        ordered += created.get(job_id, ())[at:at + n]
        taken[job_id] = at + n
    return ordered


def read_round(session: Session, *, now: datetime) -> FeedRound:
    jobs = store.ingesting_jobs(session, now=now)
    if not jobs:
        return FeedRound([], {}, {})
    tenants = sorted({tenant for _, tenant in jobs})
    return FeedRound(jobs, store.queued_bulk(session), keys.tenant_weights(session, tenants=tenants))


def feed_bulk(*, sessions: sessionmaker[Session], streams_for: Callable[[str], RequestStreams], configs_dir: Path,
              worker_live_s: float, limits: IngestLimits, max_bulk_queued_batches: float, max_s: float) -> Fed:
    """Rounds for up to max_s seconds, or until no job has lines left.

    NOTE: one loop for every job, not a task per job: a job created now is in the next round (THROTTLED_WAIT_S
    away at most), never behind another job's task; and the round-robin state lives here. Two feeds at once (a lease outlived) would overfill a queue for a round,
    never read a line twice: each ingest step holds its job's row lock and commits its offset.
    """
    deadline = time.monotonic() + max_s
    catalog, catalog_at, num_lines = None, 0.0, 0
    state, seen = ShareState(), {}  # seen: job -> configs its lines joined (a job whose lines all started)
    while time.monotonic() < deadline:
        now = datetime.now(UTC)
        live_since = now - timedelta(seconds=worker_live_s)
        with session_scope(sessions) as session:
            if catalog is None or time.monotonic() - catalog_at > CATALOG_MAX_AGE_S:
                catalog = load_catalog(session, configs_dir=configs_dir, live_since=live_since)
                catalog_at = time.monotonic()
            found = read_round(session, now=now)
        if not found.jobs:
            return Fed(num_lines, has_more=False)
        bounds = bulk_bounds(catalog, max_bulk_queued_batches=max_bulk_queued_batches)
        seen = {str(job_id): seen.get(str(job_id), set()) for job_id, _ in found.jobs}
        for name, job_id in found.queued:
            if job_id is not None and str(job_id) in seen:
                seen[str(job_id)].add(name)
        bulk_jobs = [BulkJob(str(job_id), tenant, frozenset(seen[str(job_id)]), limits.max_lines_per_step)
                     for job_id, tenant in found.jobs]
        planned = share_round(bulk_jobs, weights=found.weights, free=free_room(bounds, found.queued), state=state)
        state, num_read, created, is_slice_full = planned.state, 0, {}, False
        for job_id, room in planned.rooms.items():
            step = ingest_step(sessions=sessions, streams_for=streams_for, job_id=uuid.UUID(job_id),
                               configs_dir=configs_dir, live_since=live_since, limits=limits, now=now,
                               catalog=catalog, max_lines=room, enqueue=False)
            seen[job_id] |= {name for _, name in step.created}
            created[job_id] = step.created
            num_read += step.num_lines
            is_slice_full |= step.num_lines >= limits.max_lines_per_step
        enqueue_bulk(streams_for, interleaved(planned.visits, created))
        num_lines += num_read
        # NOTE: the queues are full again (or every job is at its in-flight limit): wait for the workers to take
        # lines rather than spin a round per line they take. Only a job cut short by the slice size goes on.
        if not is_slice_full:
            time.sleep(THROTTLED_WAIT_S)
    return Fed(num_lines, has_more=True)
