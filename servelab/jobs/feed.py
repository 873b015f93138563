"""The bulk feed: one loop that reads every batch job's lines into the configs' bulk streams, shared fairly.

Knows rounds: a round reads which jobs have lines left, how many bulk lines each config's stream holds not
yet started, the tenants' weights and each config's bound (max_bulk_queued_batches x its max_batch_size),
asks servelab/jobs/share.py how many lines each job may read now, and runs ingest_step for each, capped at
that; it waits THROTTLED_WAIT_S between rounds unless a job read a whole slice. A job whose slice raises is
retried in later rounds (its tries counted in Redis, so they outlive the task) and failed at MAX_STEP_TRIES;
the other jobs go on. Does not know Celery (worker/jobs.py runs it as one task for every job) nor the share's
arithmetic.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from redis import Redis
from sqlalchemy.orm import Session, sessionmaker

from servelab.catalog import Catalog, load_catalog
from servelab.jobs.ingest import (CATALOG_MAX_AGE_S, MAX_STEP_TRIES, STEP_RETRY_WAIT_S, THROTTLED_WAIT_S, IngestLimits,
                                  enqueue_bulk, fail_ingest, ingest_step)
from servelab.jobs.share import BulkJob, ShareState, share_round
from servelab.queue.streams import RequestStreams
from servelab.store import batch_jobs as store
from servelab.store import keys
from servelab.store.db import session_scope

STEP_TRIES_TTL_MS = 86_400_000  # NOTE: a day: the count of a job that ended while failing is forgotten then
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fed:
    num_lines: int  # lines read, over every job
    has_more: bool  # jobs still had lines to read when the time ran out


@dataclass(frozen=True)
class StepTries:
    """Each job's failed slices in a row, in a Redis hash, so the count outlives the feed task that made it (a
    task hands over every FEED_TASK_S; a job that raised at every task's first round must still fail)."""

    redis: Redis
    key: str  # under the service's key prefix

    def failed(self, job_id: str) -> int:
        """One more failure in a row -> how many now."""
        with self.redis.pipeline() as pipe:
            pipe.hincrby(self.key, job_id, 1)
            pipe.pexpire(self.key, STEP_TRIES_TTL_MS)
            num_failed, _ = pipe.execute()
        return int(num_failed)

    def succeeded(self, job_id: str) -> None:
        self.redis.hdel(self.key, job_id)

    def counted(self) -> set[str]:
        """The jobs with a failure counted (their next success clears it)."""
        return {job_id.decode() if isinstance(job_id, bytes) else job_id for job_id in self.redis.hkeys(self.key)}


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
    waits behind at most the bound. A config with no live worker is unbounded: nothing takes its lines, so
    there is nothing to share, and a dead worker's full queue must not hold back the jobs of other configs.
    """
    if max_bulk_queued_batches <= 0:
        return {}
    return {name: max(1, math.ceil(max_bulk_queued_batches * config.batching.max_batch_size))
            for name, config in catalog.configs.items() if name in catalog.live_names}


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
              worker_live_s: float, limits: IngestLimits, max_bulk_queued_batches: float, max_s: float,
              tries: StepTries, is_mine: Callable[[], bool] = lambda: True) -> Fed:
    """Rounds for up to max_s seconds (one at least), or until no job has lines left, or until is_mine() (asked
    before each round: does this feed still hold its lease?) says no.

    NOTE: one loop for every job, not a task per job: a job created now is in the next round (THROTTLED_WAIT_S
    away at most), never behind another job's task; and the round-robin state lives here. Two feeds at once
    (a round that outlived the lease; is_mine ends the other after it) would overfill a queue for a round,
    never read a line twice: each ingest step holds its job's row lock and commits its offset.
    Fed.has_more is True too when is_mine() said no: lines may be left, for the lease's holder.
    A slice that raises (a bug, a bad row) costs its job that round only: the other jobs read on, what the
    round created goes out, and the job is tried again STEP_RETRY_WAIT_S later (doubling), failing with the
    reason in its errors at MAX_STEP_TRIES in a row, so one broken job never stalls the jobs after it.
    """
    deadline = time.monotonic() + max_s
    catalog, catalog_at, num_lines = None, 0.0, 0
    state, seen = ShareState(), {}  # seen: job -> configs its lines joined (a job whose lines all started)
    retry_at: dict[str, float] = {}  # a job whose slice raised: not before then (monotonic)
    counted = tries.counted()
    is_first = True  # NOTE: one round at least, however long the task took to get here (a loaded host)
    while (is_first or time.monotonic() < deadline) and is_mine():
        is_first = False
        now = datetime.now(UTC)
        live_since = now - timedelta(seconds=worker_live_s)
        with session_scope(sessions) as session:
            if catalog is None or time.monotonic() - catalog_at > CATALOG_MAX_AGE_S:
                catalog = load_catalog(session, configs_dir=configs_dir, live_since=live_since)
                catalog_at = time.monotonic()
            found = read_round(session, now=now)
            # NOTE: a job new to this task: the configs its stored lines named (lines that all started are not
            # queued, so the queue alone would leave it naming none after a handover)
            new = [job_id for job_id, _ in found.jobs if str(job_id) not in seen]
            stored = store.job_config_names(session, job_ids=new) if new else {}
        if not found.jobs:
            return Fed(num_lines, has_more=False)
        bounds = bulk_bounds(catalog, max_bulk_queued_batches=max_bulk_queued_batches)
        seen = {str(job_id): seen.get(str(job_id)) or set(stored.get(job_id, ())) for job_id, _ in found.jobs}
        for name, job_id in found.queued:
            if job_id is not None and str(job_id) in seen:
                seen[str(job_id)].add(name)
        waiting = {job_id for job_id, at in retry_at.items() if at > time.monotonic()}
        bulk_jobs = [BulkJob(str(job_id), tenant, frozenset(seen[str(job_id)]), limits.max_lines_per_step)
                     for job_id, tenant in found.jobs if str(job_id) not in waiting]
        planned = share_round(bulk_jobs, weights=found.weights, free=free_room(bounds, found.queued), state=state)
        state, num_read, created, is_slice_full = planned.state, 0, {}, False
        try:
            for job_id, room in planned.rooms.items():
                try:
                    step = ingest_step(sessions=sessions, streams_for=streams_for, job_id=uuid.UUID(job_id),
                                       configs_dir=configs_dir, live_since=live_since, limits=limits, now=now,
                                       catalog=catalog, max_lines=room, enqueue=False)
                except Exception as exc:  # NOTE: the same slice fails again: tries are counted, not kinds
                    num_failed = tries.failed(job_id)
                    counted.add(job_id)
                    log.warning("ingest of job %s failed (try %d of %d)", job_id, num_failed, MAX_STEP_TRIES,
                                exc_info=True)
                    if num_failed >= MAX_STEP_TRIES:
                        fail_ingest(sessions=sessions, job_id=uuid.UUID(job_id), reason=exc, num_tries=num_failed,
                                    now=now)
                        tries.succeeded(job_id)  # NOTE: it ended: nothing left to count
                        counted.discard(job_id)
                    else:
                        retry_at[job_id] = time.monotonic() + STEP_RETRY_WAIT_S * 2 ** (num_failed - 1)
                    continue
                retry_at.pop(job_id, None)
                if job_id in counted:
                    tries.succeeded(job_id)
                    counted.discard(job_id)
                seen[job_id] |= {name for _, name in step.created}
                created[job_id] = step.created
                num_read += step.num_lines
                is_slice_full |= step.num_lines >= limits.max_lines_per_step
        finally:  # NOTE: the slices committed before anything raised go out now, not when the reaper finds them
            enqueue_bulk(streams_for, interleaved(planned.visits, created))
        num_lines += num_read
        # NOTE: the queues are full again (or every job is at its in-flight limit): wait for the workers to take
        # lines rather than spin a round per line they take. Only a job cut short by the slice size goes on.
        if not is_slice_full:
            time.sleep(THROTTLED_WAIT_S)
    return Fed(num_lines, has_more=True)
