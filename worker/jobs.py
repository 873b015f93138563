"""The jobs-worker and beat processes: Celery tasks that drive bulk jobs with servelab.jobs.

Thin: `configure` binds the Celery app to a Runtime (broker = the same Redis, keys under the prefix);
tasks call the core. Every task is idempotent (its work is conditional updates) and carries an id;
acks are late and a lost worker's task is re-delivered. Beat runs `sweep` every jobs_poll_s: it starts
the bulk feed (one task that reads every job's lines, shared fairly) while jobs have unread lines and
advances the other jobs, each under a short Redis lease so no two copies of a task are in flight (the feed's
holds a token that passes from task to successor: only its holder extends or deletes it); `reap`
re-adds requests whose stream entry was lost;
`purge` erases expired files' content and forgets expired idempotency keys (reads ignore both at once already);
and `prune` deletes finished requests, batch records and files past the retention ages, in small transactions.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from celery import Celery
from redis import Redis

from servelab.jobs.feed import StepTries, feed_bulk as feed_bulk_lines
from servelab.jobs.ingest import IngestLimits
from servelab.jobs.lifecycle import advance_job
from servelab.jobs.reaper import reap_lost
from servelab.jobs.retention import RetentionPolicy, prune as prune_history
from servelab.queue.streams import RequestStreams
from servelab.runtime import Runtime
from servelab.settings import ServiceSettings
from servelab.store import batch_jobs as store
from servelab.store import files
from servelab.store import idempotency as idempotency_keys
from servelab.store.db import session_scope
from servelab.store.models import BatchStatus

log = logging.getLogger(__name__)
app = Celery("servelab")
FEED_TASK_S = 20.0  # one feed task runs this long at most (many rounds), then hands over to the next
LEASE_MS = 60_000  # NOTE: longer than FEED_TASK_S: a lease outlives the task that holds it
VISIBILITY_TIMEOUT_S = 3_600  # NOTE: far above the longest task (an ingest task, a 100k-line finalise)
PURGE_EVERY_S = 60.0
PRUNE_EVERY_S = 600.0  # NOTE: one run spends at most RetentionPolicy.budget_s (30 s); a backlog drains run by run
_bound: dict[str, object] = {}


def configure(runtime: Runtime, settings: ServiceSettings) -> Celery:
    """Bind the app to a process's connections; called once by the process entry point.

    NOTE: Celery caches broker connections on first use, so configure a process once (tests run the
    jobs-worker and beat as subprocesses for that reason).
    """
    _bound.update(runtime=runtime, settings=settings)
    app.conf.update(
        broker_url=runtime.urls.redis_url, task_ignore_result=True,
        task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
        broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT_S,
                                  "global_keyprefix": (settings.celery_prefix or f"{settings.key_prefix}:celery") + ":"},
        task_default_queue="servelab-jobs", broker_connection_retry_on_startup=True,
        beat_schedule={
            "sweep": {"task": "servelab.sweep", "schedule": settings.jobs_poll_s},
            "reap": {"task": "servelab.reap", "schedule": max(1.0, settings.claim_idle_ms / 2e3)},
            "purge": {"task": "servelab.purge", "schedule": PURGE_EVERY_S},
            "prune": {"task": "servelab.prune", "schedule": PRUNE_EVERY_S},
        },
        beat_schedule_filename=str(settings.state_dir / "celerybeat-schedule"),
    )
    return app


def _runtime() -> tuple[Runtime, ServiceSettings]:
    assert _bound, "worker.jobs.configure(runtime, settings) was not called"
    return _bound["runtime"], _bound["settings"]


def _streams_for(runtime: Runtime, settings: ServiceSettings):
    return lambda name: RequestStreams(runtime.redis, prefix=settings.key_prefix, config_name=name)


def _lease_key(settings: ServiceSettings, kind: str, job_id: str) -> str:
    return f"{settings.key_prefix}:lease:{kind}:{job_id}"


# NOTE: the feed lease's value is its holder's token: only the holder extends or deletes it (compare-and-set)
HOLD_LEASE = """if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0"""
RELEASE_LEASE = """if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0"""


@dataclass(frozen=True)
class FeedLease:
    """The one feed's lease, held under a token that the task passes on to its successor."""

    redis: Redis
    key: str
    token: str

    def take(self) -> bool:
        return bool(self.redis.set(self.key, self.token, nx=True, px=LEASE_MS))

    def hold(self) -> bool:
        """Still ours? Then it runs LEASE_MS from now."""
        return bool(self.redis.register_script(HOLD_LEASE)(keys=[self.key], args=[self.token, LEASE_MS]))

    def release(self) -> bool:
        """Delete it if it is still ours (a lease that expired and was taken by another feed stays theirs)."""
        return bool(self.redis.register_script(RELEASE_LEASE)(keys=[self.key], args=[self.token]))


@app.task(name="servelab.feed_bulk")
def feed_bulk(token: str | None = None) -> int:
    """Read every job's lines into the bulk streams, each job its fair share, for up to FEED_TASK_S; -> lines read.

    NOTE: one task for every job, so a job never waits for another's task to end, and the feed holds one of
    the worker's slots, leaving the others to sweep, advance, reap. token: the feed lease's value when the
    sweep (or the predecessor) sent this task; the task runs a round only while the lease still holds it,
    extending it each round, so a successor that waited in the queue past the lease, after the sweep started
    another feed, ends at once. When time is up with lines left, the task sends its successor the same token
    before it ends: the successor queues behind the tasks already waiting (they get this slot first), and the
    streams are not left unfed until the next sweep. None (a task sent before tokens): it takes the lease.
    """
    runtime, settings = _runtime()
    limits = IngestLimits(max_prompt_chars=settings.max_prompt_chars, max_job_in_flight=settings.max_job_in_flight,
                          max_line_bytes=settings.max_request_bytes)
    lease = FeedLease(runtime.redis, _lease_key(settings, "feed", "bulk"), token or uuid.uuid4().hex)
    if token is None and not lease.take():
        return 0
    handed_over = False
    try:
        fed = feed_bulk_lines(sessions=runtime.sessions, streams_for=_streams_for(runtime, settings),
                              configs_dir=settings.configs_dir, worker_live_s=settings.worker_live_s, limits=limits,
                              max_bulk_queued_batches=settings.max_bulk_queued_batches, max_s=FEED_TASK_S,
                              tries=StepTries(runtime.redis, f"{settings.key_prefix}:feed:step_tries"),
                              is_mine=lease.hold)
        if fed.has_more and lease.hold():
            feed_bulk.apply_async(kwargs={"token": lease.token}, task_id=f"feed-{uuid.uuid4().hex[:8]}")
            handed_over = True
        return fed.num_lines
    finally:
        if not handed_over:
            lease.release()


@app.task(name="servelab.advance_batch")
def advance_batch(job_id: str) -> str | None:
    """Expire, end a cancel, or finalise the job, whichever is due."""
    runtime, settings = _runtime()
    try:
        status = advance_job(sessions=runtime.sessions, job_id=uuid.UUID(job_id), now=datetime.now(UTC))
    finally:
        runtime.redis.delete(_lease_key(settings, "advance", job_id))
    return status.value if status else None


@app.task(name="servelab.sweep")
def sweep() -> int:
    """Start the feed while jobs have lines to read, and the task each other active job needs; a task still in
    flight (leased) is not started again."""
    runtime, settings = _runtime()
    with session_scope(runtime.sessions) as session:
        active = [store.get_job(session, job_id=i) for i in store.active_job_ids(session)]
    started = 0
    now = datetime.now(UTC)
    needs_feed = False
    for job in active:
        if (not job.is_ingested and now < job.timestamps["expires_at"]
                and job.status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)):
            needs_feed = True  # NOTE: the one feed reads it
        elif runtime.redis.set(_lease_key(settings, "advance", str(job.id)), "1", nx=True, px=LEASE_MS):
            advance_batch.apply_async(args=[str(job.id)], task_id=f"advance-{job.public_id}-{uuid.uuid4().hex[:8]}")
            started += 1
    lease = FeedLease(runtime.redis, _lease_key(settings, "feed", "bulk"), uuid.uuid4().hex)
    if needs_feed and lease.take():
        feed_bulk.apply_async(kwargs={"token": lease.token}, task_id=f"feed-{uuid.uuid4().hex[:8]}")
        started += 1
    return started


@app.task(name="servelab.reap")
def reap() -> int:
    """Re-add unfinished requests whose stream entry is gone (the data plane's reaper, for every config)."""
    runtime, settings = _runtime()
    return reap_lost(sessions=runtime.sessions, streams_for=_streams_for(runtime, settings),
                     grace=timedelta(milliseconds=settings.claim_idle_ms), now=datetime.now(UTC))


@app.task(name="servelab.purge")
def purge() -> int:
    """Erase the content of files past their expiry and delete expired idempotency keys; -> rows changed."""
    runtime, _ = _runtime()
    now = datetime.now(UTC)
    with session_scope(runtime.sessions) as session:
        return files.purge_expired_files(session, now=now) + idempotency_keys.purge_expired_keys(session, now=now)


@app.task(name="servelab.prune")
def prune() -> dict[str, int | bool]:
    """Delete finished requests (results, metrics), batch records and files past the retention ages, except
    what runs and running jobs need; -> what went, and whether it all went within the time budget."""
    runtime, settings = _runtime()
    pruned = prune_history(sessions=runtime.sessions, policy=RetentionPolicy.from_settings(settings),
                           now=datetime.now(UTC))
    if pruned.num_requests or pruned.num_batches or pruned.num_files:
        log.info("retention: deleted %d requests and %d batch records; %d files deleted or erased%s",
                    pruned.num_requests, pruned.num_batches, pruned.num_files,
                    "" if pruned.is_done else " (more next run)")
    return {"num_requests": pruned.num_requests, "num_batches": pruned.num_batches, "num_files": pruned.num_files,
            "is_done": pruned.is_done}


def main(argv: list[str]) -> None:
    """`python -m worker.jobs worker` (jobs-worker) or `python -m worker.jobs beat`: Settings read once here."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from servelab.runtime import connect

    settings = ServiceSettings()
    configure(connect(settings), settings)
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    app.start(argv=argv or ["worker"])


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
