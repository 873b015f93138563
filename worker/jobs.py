"""The jobs-worker and beat processes: Celery tasks that drive bulk jobs with servelab.jobs.

Thin: `configure` binds the Celery app to a Runtime (broker = the same Redis, keys under the prefix);
tasks call the core. Every task is idempotent (its work is conditional updates) and carries an id;
acks are late and a lost worker's task is re-delivered. Beat runs `sweep` every jobs_poll_s: it starts
ingest for jobs with unread lines and advances the others, each under a short Redis lease so a job
never has two copies of the same task in flight; `reap` re-adds requests whose stream entry was lost;
`purge` erases expired files' content and forgets expired idempotency keys (reads ignore both at once already);
and `prune` deletes finished requests, batch records and files past the retention ages, in small transactions.
"""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime, timedelta

from celery import Celery

from servelab.jobs.ingest import IngestLimits, ingest_for
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
INGEST_TASK_S = 20.0  # one ingest task runs this long at most (many slices), then gives its slot back
LEASE_MS = 60_000  # NOTE: longer than INGEST_TASK_S: a lease outlives the task that holds it
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


@app.task(name="servelab.ingest_batch")
def ingest_batch(job_id: str) -> int:
    """Ingest a job's lines for up to INGEST_TASK_S, waiting out back-pressure; sweep starts the next task."""
    runtime, settings = _runtime()
    limits = IngestLimits(max_prompt_chars=settings.max_prompt_chars, max_job_in_flight=settings.max_job_in_flight,
                          max_line_bytes=settings.max_request_bytes)
    try:
        return ingest_for(sessions=runtime.sessions, streams_for=_streams_for(runtime, settings),
                          job_id=uuid.UUID(job_id), configs_dir=settings.configs_dir,
                          worker_live_s=settings.worker_live_s, limits=limits, max_s=INGEST_TASK_S)
    finally:
        runtime.redis.delete(_lease_key(settings, "ingest", job_id))


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
    """Start the task each active job needs; a job whose task is still in flight (leased) is skipped."""
    runtime, settings = _runtime()
    with session_scope(runtime.sessions) as session:
        active = [store.get_job(session, job_id=i) for i in store.active_job_ids(session)]
    started = 0
    now = datetime.now(UTC)
    for job in active:
        needs_ingest = (not job.is_ingested and now < job.timestamps["expires_at"]
                        and job.status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS))
        kind, task = ("ingest", ingest_batch) if needs_ingest else ("advance", advance_batch)
        if runtime.redis.set(_lease_key(settings, kind, str(job.id)), "1", nx=True, px=LEASE_MS):
            task.apply_async(args=[str(job.id)], task_id=f"{kind}-{job.public_id}-{uuid.uuid4().hex[:8]}")
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
