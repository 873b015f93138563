"""The GPU worker's serving loop: the shell around the scheduler. Stream entries -> requests (tokenised once)
-> the scheduler's plan -> the engine -> store -> notify -> ack.

Each turn reads what the scheduler asks for, hands it the requests, and runs its plan: preemptions are counted,
newcomers are claimed, the runner computes the step (decode tokens and prompt chunks in one forward), its text is
published (and the streamed rows' cancel flags read, one round trip), and every row that ended in the turn is
recorded at once. Knows the order that makes redelivery harmless (claim rows, serve,
write a finished row's result and metrics in one transaction, notify, then acknowledge), takes back its own
pending entries on start, takes over entries a dead worker left idle, renews the claim on everything it holds,
fails a request that has crashed its worker `max_attempts` times, and re-adds ids whose stream entry was lost.
Does not know HTTP or Celery, nor which rows run when (the scheduler decides); the engine's runner executes the
scheduler's plans and is handed in. Starting a worker process (load, register, signals) is process.py's.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import redis
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from servelab.engine.engine import Engine
from servelab.engine.threads import ThreadGovernor
from servelab.outputs import BatchResult, Completion, StepOutput
from servelab.request import FinishReason, RequestError, StreamKind
from servelab.queue.reaper import reenqueue_lost
from servelab.scheduler.policy import BatchPolicy
from servelab.scheduler.scheduler import Scheduler, SchedulerOutput
from servelab.scheduler.state import ScheduledRequest
from servelab.queue.streams import Entry, RequestStreams, end_event, notify_done
from servelab.queue.tokens import StepEvents, publish_step
from servelab.store import requests as store
from servelab.store.db import session_scope
from servelab.settings import Settings
from servelab.telemetry import WorkerMeter

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_OUTAGE_WAIT_S = 5.0  # the longest pause between two tries of a transaction while PostgreSQL is unreachable


@dataclass(frozen=True)
class FaultPolicy:
    max_attempts: int = 3  # started executions before a request is failed as a poison request
    claim_idle_ms: int = 30_000  # an entry idle this long belongs to a dead worker
    renew_every_s: float = 5.0  # well under claim_idle_ms
    reap_every_s: float = 15.0
    heartbeat_every_s: float = 5.0

    @classmethod
    def from_settings(cls, settings: Settings) -> FaultPolicy:
        return cls(max_attempts=settings.max_attempts, claim_idle_ms=settings.claim_idle_ms,
                   renew_every_s=settings.renew_every_s, reap_every_s=max(1.0, settings.claim_idle_ms / 2e3))


@dataclass
class _Held:
    """The stream entries this worker holds (read, not yet acknowledged): the claim keeper renews them all."""

    lock: threading.Lock = field(default_factory=threading.Lock)  # NOTE: also guards the scheduler (the keeper adds)
    entries: dict[str, Entry] = field(default_factory=dict)  # by Entry.key: scheduled requests' entries
    arriving: dict[str, Entry] = field(default_factory=dict)  # read, their rows being looked up: renewed too


STREAMED_KINDS = frozenset({StreamKind.INTERACTIVE})  # NOTE: bulk rows publish only their end: nobody watches them


class ServingWorker:
    def __init__(self, *, engine: Engine, streams: RequestStreams, sessions: sessionmaker[Session],
                 name: str, policy: BatchPolicy, faults: FaultPolicy = FaultPolicy(), clock=time.monotonic,
                 streamed: frozenset[StreamKind] = STREAMED_KINDS, threads: ThreadGovernor | None = None) -> None:
        self.engine, self.streams, self.sessions, self.name = engine, streams, sessions, name
        self.threads = threads  # resizes torch's team after each step while the host takes its cores (threads.py)
        self.faults, self.clock = faults, clock
        pool = engine.new_kv_pool()  # NOTE: this worker's scheduler owns the pool its runner's blocks are read from
        self.policy = policy = replace(policy, paged=pool is not None)
        self.scheduler = Scheduler(policy, pool)
        # NOTE: before the first read: on CUDA each padded decode size's graph is captured now, not mid-serving
        engine.runner.prepare(pool, policy.max_batch_size)
        self.streamed = streamed  # which streams' rows publish their text as it is made
        self._unpublished = StepEvents()  # events a Redis error kept from their step: they go first next step
        self.publish_s = 0.0  # time spent publishing steps (what streaming costs the decode loop)
        self.num_publishes = 0
        self.held = _Held()
        self.meter = WorkerMeter(streams.config_name)
        self.stop = threading.Event()

    @property
    def running(self) -> list[ScheduledRequest]:
        return self.scheduler.running

    # --- the loop: the scheduler decides, the engine computes, the worker carries ---

    def run(self) -> None:
        self.streams.ensure_groups()
        self._admit(self.streams.read_own_pending(self.name))  # a restart takes back its own entries first
        keeper = threading.Thread(target=self._keep_claims, name=f"{self.name}-keeper", daemon=True)
        keeper.start()
        while not self.stop.is_set():
            if not keeper.is_alive():
                # NOTE: without the keeper, claims lapse (others would run this worker's rows twice) and the
                # heartbeat stops: end loudly, so the supervisor restarts the process, never serve on silently
                raise RuntimeError(f"worker {self.name}: the claim keeper stopped; stopping the worker")
            self.step()
        while self.running:  # NOTE: a clean stop admits nothing more and finishes the rows in hand
            with self.held.lock:
                plan = self.scheduler.schedule(self.clock(), admit=False)
            self._run(plan)

    def step(self) -> int:
        """One turn: read until the scheduler has a plan, run it; -> how many requests ended."""
        while not self.stop.is_set():
            with self.held.lock:
                read = self.scheduler.next_read(self.clock())
            if read is not None:
                self._admit(self.streams.read_new(
                    self.name, count=read.count, interactive_only=read.is_interactive_only,
                    block_ms=None if read.block_s is None else max(1, int(read.block_s * 1e3))))
            with self.held.lock:  # NOTE: a stop that came during the read admits nothing (no claim, no attempt)
                plan = self.scheduler.schedule(self.clock(), admit=not self.stop.is_set())
            if not plan.is_empty:
                return self._run(plan)
        return 0

    def _run(self, plan: SchedulerOutput) -> int:
        """A plan on the runner: its preemptions counted, its newcomers claimed, one step run (its text published),
        then the rows that ended are recorded, notified and acknowledged together."""
        if plan.preempted:
            self._preempted(plan)
        plan, started = self._claim(plan)
        out = self.engine.runner.execute(plan)  # NOTE: read through the engine, which a test may wrap
        if self.threads is not None:
            # NOTE: the decode rows' tokens weigh a team kept for its speed (threads.py); a prompt chunk's tokens cost
            # far less each and would make its window look faster
            self.meter.threads(self.threads.tick(len(plan.decode)))
        with self.held.lock:
            self.scheduler.update(plan)
        finished = [*out.finished, *self._publish(started, out, ended={c.request_id for c in out.finished})]
        self._finish(finished)
        self._observe_turn(plan, started, out)
        return len(finished)

    def _observe_turn(self, plan: SchedulerOutput, started: list[ScheduledRequest], out: StepOutput) -> None:
        self.meter.turn(num_prompt_tokens=sum(r.num_prompt_tokens for r in started),
                        num_cached_tokens=sum(r.num_cached_tokens for r in started),
                        num_step_tokens=sum(n for _, n in plan.chunks) + len(out.new_tokens),
                        num_generated_tokens=len(out.new_tokens),
                        num_step_rows=len(plan.decode), num_running=len(self.running),
                        num_waiting=len(self.scheduler.waiting), kv_cache_usage=self.scheduler.kv_cache_usage)

    def _publish(self, started: list[ScheduledRequest], out: StepOutput, *, ended: set[str]) -> list[Completion]:
        """The text streamed rows released and their cancel flags, one round trip; -> the rows cancelled now."""
        streamed = {r.request_id: r for r in self.running if self._is_streamed(r)}
        if not streamed and self._unpublished.is_empty:
            return []
        late = self._unpublished
        events = StepEvents(
            started=late.started + tuple((r.request_id, r.num_attempts, r.num_prompt_tokens) for r in started
                                         if r.request_id in streamed),
            # NOTE: a piece carries the tokens made so far, so a client can be shown its usage as it grows
            texts=late.texts + tuple((rid, at, piece, streamed[rid].num_generated_tokens)
                                     for rid, at, piece in out.new_text if rid in streamed),
            watched=tuple(rid for rid in streamed if rid not in ended),
        )
        started_s = time.perf_counter()
        try:
            cancelled = publish_step(self.streams.client, prefix=self.streams.prefix, events=events)
        except (redis.RedisError, OSError) as exc:  # NOTE: keep decoding; the text goes out, in order, next step
            log.warning("could not publish a step's text (%s); retrying at the next step", exc)
            self._unpublished = StepEvents(events.started, events.texts)
            return []
        finally:
            self.publish_s += time.perf_counter() - started_s
            self.num_publishes += 1
        self._unpublished = StepEvents()
        if not cancelled:
            return []
        log.info("dropped %d row(s) whose client left", len(cancelled))
        gone = set(cancelled)
        return self.engine.runner.cancel([r for r in self.running if r.request_id in gone])

    def _is_streamed(self, r: ScheduledRequest) -> bool:
        return (StreamKind.INTERACTIVE if r.is_interactive else StreamKind.BULK) in self.streamed

    # --- requests in, claims, preemptions ---

    def _preempted(self, plan: SchedulerOutput) -> None:
        """Rows the plan took out of the batch unfinished wait again, still claimed, keeping their tokens: counted in
        the store and by cause (they compute their tokens again when they return)."""
        self._store(lambda session: store.count_preemptions(session, ids=[p.request.request_id for p in plan.preempted]))
        for p in plan.preempted:
            self.meter.preempted(cause=p.cause, num_lost_tokens=p.num_lost_tokens)
        log.info("preempted %s", ", ".join(f"{p.request.request_id} ({p.cause})" for p in plan.preempted))

    def _admit(self, entries: list[Entry], *, wait_out: bool = True) -> None:
        """Turn entries into scheduled requests; entries of finished, missing or poison requests end here.
        wait_out: wait out a PostgreSQL outage (the main loop) or raise at once (the claim keeper)."""
        with self.held.lock:
            entries = [e for e in entries if e.key not in self.held.entries and e.key not in self.held.arriving]
            self.held.arriving.update((e.key, e) for e in entries)
        try:
            self._admit_arriving(entries, wait_out=wait_out)
        finally:
            with self.held.lock:
                for e in entries:
                    self.held.arriving.pop(e.key, None)

    def _admit_arriving(self, entries: list[Entry], *, wait_out: bool) -> None:
        if not entries:
            return
        done, valid = [], []
        for e in entries:
            (valid if _is_uuid(e.request_id) else done).append(e)
        rows = self._store(lambda session: store.load_requests(session, [e.request_id for e in valid]),
                           wait_out=wait_out)
        poison: list[Entry] = []
        rejected: dict[str, list[Entry]] = {}
        for e in valid:
            row = rows.get(e.request_id)
            if row is None or row.status.is_terminal or self._is_held(e.request_id):
                done.append(e)  # NOTE: held already: an entry the reaper re-added while the first is served here
            elif row.num_attempts >= self.faults.max_attempts:
                poison.append(e)
            else:
                try:
                    self._hold(e, row)
                except RequestError as exc:  # NOTE: fails alone, before it can take a batch slot
                    rejected.setdefault(str(exc), []).append(e)
        self.streams.ack(done)
        self._fail(poison, f"crashed its worker {self.faults.max_attempts} times; not retried", wait_out=wait_out,
                   poison=True)
        for reason, bad in rejected.items():
            self._fail(bad, reason, wait_out=wait_out)

    def _is_held(self, request_id: str) -> bool:
        with self.held.lock:  # NOTE: the keeper adds to the scheduler from its thread
            return self.scheduler.holds(request_id)

    def _hold(self, entry: Entry, row: store.StoredRequest) -> None:
        """The stored request, tokenised once here (its limits checked), waits in the scheduler."""
        request = self.engine.tokenize(row.generation_request())
        scheduled = ScheduledRequest(request, entry.key, entry.is_interactive, row.enqueued_at, priority=row.priority,
                                     is_retry=row.num_attempts > 0)
        with self.held.lock:
            self.held.entries[entry.key] = entry
            self.scheduler.add([scheduled])

    def _claim(self, plan: SchedulerOutput) -> tuple[SchedulerOutput, list[ScheduledRequest]]:
        """Claim the plan's newcomers in the store; -> the plan less those this worker does not run (a request
        finished meanwhile, cancelled or served by another worker, leaves the scheduler and its entry is
        acknowledged), and the rows that started now (a preempted row returning is still claimed)."""
        fresh = [r for r in plan.admitted if not r.is_claimed]
        if not fresh:
            return plan, []
        claimed = self._store(lambda session: store.claim_requests(session, ids=[r.request_id for r in fresh],
                                                                   now=datetime.now(UTC)))
        for r in fresh:
            if r.request_id in claimed:
                r.is_claimed, r.num_attempts = True, claimed[r.request_id]
        skipped = [r for r in fresh if not r.is_claimed]
        if skipped:
            with self.held.lock:
                self.scheduler.finish([r.request_id for r in skipped])
            self._release(skipped)
            plan = plan.without({r.request_id for r in skipped})
        return plan, [r for r in fresh if r.is_claimed]

    # --- after the engine ---

    def _finish(self, completions: list[Completion]) -> None:
        """Rows that ended: their results and the steps since the last finish in one transaction, then
        notify, then acknowledge; the other rows go on."""
        if not completions:
            return
        if not self._unpublished.is_empty:  # NOTE: a row's last text must reach its stream before its end
            publish_step(self.streams.client, prefix=self.streams.prefix, events=self._unpublished)
            self._unpublished = StepEvents()
        timings, memory = self.engine.take_stats()
        self.meter.stretch(timings)
        with self.held.lock:
            ended = self.scheduler.finish([c.request_id for c in completions])
        assert len(ended) == len(completions), "a row ended that the scheduler was not running"
        batch_id = uuid.uuid4()  # NOTE: the same id on every try, so a retried commit records the batch once
        result = BatchResult(completions=tuple(completions), timings=timings, memory=memory)
        enqueued_at = {r.request_id: r.enqueued_at for r in ended}
        recorded = self._store(lambda session: store.record_batch(
            session, batch_id=batch_id, worker_name=self.name, serving_config_name=self.streams.config_name,
            config_hash=self.engine.config.config_hash, result=result, enqueued_at=enqueued_at))
        # NOTE: counted once committed (a failed commit is served again elsewhere), before the callers wake
        self.meter.finished([c for c in completions if c.request_id in recorded], enqueued_at=enqueued_at)
        notify_done(self.streams.client, prefix=self.streams.prefix, ends={c.request_id: _end_of(c) for c in completions})
        self._release(ended)

    def _fail(self, entries: list[Entry], reason: str, *, wait_out: bool = True, poison: bool = False) -> None:
        """These requests end failed, their callers told why; poison ones (they crashed their worker) are moved to
        the dead-letter stream, the others acknowledged."""
        if not entries:
            return
        failed = self._store(lambda session: store.fail_requests(session, ids=[e.request_id for e in entries],
                                                                 reason=reason, now=datetime.now(UTC)), wait_out=wait_out)
        self.meter.failed(len(failed))
        notify_done(self.streams.client, prefix=self.streams.prefix,
                    ends={e.request_id: end_event("failed", finish_reason="error", error=reason) for e in entries})
        if not poison:
            self.streams.ack(entries)
            return
        for e in entries:
            self.streams.dead_letter(e, reason)
        log.warning("dead-lettered %d request(s): %s", len(entries), reason)

    def _store(self, work: Callable[[Session], T], *, wait_out: bool = True) -> T:
        """One transaction. With wait_out, an unreachable PostgreSQL (a restart, a failover) is waited out here.

        NOTE: the main loop pauses with its rows in hand while the keeper goes on renewing their claims, so a
        database restart costs no model reload, no started execution and no take-over by another worker. Every
        retried transaction is safe to repeat: claims and finishes are conditional updates and a batch record
        keeps its id. A stopping worker does not wait: its unacknowledged entries are served again later.
        """
        delay_s = 0.1
        while True:
            try:
                with session_scope(self.sessions) as session:
                    return work(session)
            except (OperationalError, InterfaceError) as exc:
                if not wait_out or self.stop.is_set():
                    raise
                log.warning("PostgreSQL unreachable, retrying in %.1f s: %s", delay_s, _first_line(exc))
                self.stop.wait(delay_s)
                delay_s = min(2 * delay_s, MAX_OUTAGE_WAIT_S)

    def _release(self, ended: list[ScheduledRequest]) -> None:
        """Acknowledge the entries of requests this worker is done with."""
        with self.held.lock:
            entries = [self.held.entries.pop(r.entry_key) for r in ended]
        self.streams.ack(entries)

    # --- in the background: claims, take-overs, lost entries, heartbeat ---

    def _keep_claims(self) -> None:
        """Renew what this worker holds, take over dead workers' entries, re-add lost ids, heartbeat."""
        last = {"reap": 0.0, "beat": 0.0}
        while not self.stop.wait(self.faults.renew_every_s):
            try:
                with self.held.lock:
                    held = [*self.held.entries.values(), *self.held.arriving.values()]
                self.streams.renew(self.name, held)
                self._admit(self.streams.claim_idle(self.name, min_idle_ms=self.faults.claim_idle_ms,
                                                    count=self.policy.max_batch_size), wait_out=False)
                now = self.clock()
                if now - last["reap"] >= self.faults.reap_every_s:
                    last["reap"] = now
                    self.reap_lost()
                if now - last["beat"] >= self.faults.heartbeat_every_s:
                    last["beat"] = now
                    with session_scope(self.sessions) as session:
                        store.heartbeat(session, name=self.name)
            except (redis.RedisError, OSError) as exc:  # NOTE: Redis restarting: keep serving, retry next tick
                log.warning("claim keeper: Redis: %s", _first_line(exc))
            except SQLAlchemyError as exc:  # PostgreSQL restarting: the same
                log.warning("claim keeper: PostgreSQL: %s", _first_line(exc))
            except Exception:  # NOTE: anything else is said with its traceback, and the keeper goes on
                log.exception("claim keeper: unexpected error; retrying next tick")

    def reap_lost(self) -> int:
        """Re-add unfinished requests of this config whose stream entry is gone (e.g. Redis restarted empty)."""
        lost = reenqueue_lost(sessions=self.sessions, streams=self.streams, now=datetime.now(UTC),
                              grace=timedelta(milliseconds=self.faults.claim_idle_ms))
        if lost:
            log.warning("re-enqueued %d request(s) whose stream entry was lost", lost)
        return lost


def _first_line(exc: BaseException) -> str:
    """An error's first line: SQLAlchemy's messages go on with the whole statement and its parameters."""
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _end_of(c: Completion) -> dict:
    status = {FinishReason.ERROR: "failed", FinishReason.CANCELLED: "cancelled"}.get(c.finish_reason, "succeeded")
    return end_event(status, finish_reason=c.finish_reason.value, prompt_tokens=c.num_prompt_tokens,
                     completion_tokens=c.num_generated_tokens, cached_tokens=c.num_cached_tokens, error=c.error)


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True
