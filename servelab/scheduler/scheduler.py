"""The scheduler: a worker's waiting and running requests and its KV budget, and at each step the plan.

Pure, in the shape of vLLM v1's and nano-vllm's schedulers: no Redis, no SQL, no torch, no clock of its own
(time and arrivals are handed in). The worker is the shell around it: it hands in the requests it read
(`add`), asks what to read next (`next_read`), runs each plan on the engine, and hands back the rows that
ended (`finish`). The admission rules (window, continuous, preemption) are BatchPolicy's.
Does not know streams, the store, the engine or what a request's tokens are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from servelab.scheduler.policy import BatchPolicy
from servelab.scheduler.state import ScheduledRequest, ScheduledStatus

IDLE_READ_S = 1.0  # how long an idle worker blocks on its streams before it looks again (a stop, a take-over)


class KVRoom(Protocol):
    """The paged KV cache's pool as admission reads it (the engine's BlockManager): blocks free (cached ones no row
    holds count: they are evicted when taken), and the new blocks a prompt would take, its cached prefix shared."""

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def usage(self) -> float: ...

    def blocks_to_admit(self, token_ids: Sequence[int]) -> int: ...


@dataclass(frozen=True)
class NextRead:
    """What the worker reads from its streams before the next plan."""

    count: int
    block_s: float | None  # None: do not wait (rows are running)
    is_interactive_only: bool = False  # the batch is full: only an interactive request can get in (by preemption)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step: `preempted` rows leave unfinished, `prefill` newcomers are prefilled whole and join, then every
    row of `decode` (the rows running after the newcomers joined) takes one decode step."""

    prefill: tuple[ScheduledRequest, ...] = ()
    preempted: tuple[ScheduledRequest, ...] = ()
    decode: tuple[ScheduledRequest, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.prefill or self.preempted or self.decode)


class Scheduler:
    def __init__(self, policy: BatchPolicy, room: KVRoom | None = None) -> None:
        """room: the paged cache's pool, when the engine serves from one: admission then counts the blocks a
        newcomer takes (its cached prefix shared) against the blocks free, not the policy's token budget."""
        self.policy, self.room = policy, room
        self.waiting: list[ScheduledRequest] = []  # in order of arrival; the policy orders them for service
        self.running: list[ScheduledRequest] = []  # in order of admission: the newest last (preempted first)
        self._first_seen_s: float | None = None  # when an idle scheduler first had a batch to form (the window)

    # --- what comes in and goes out ---

    def add(self, requests: list[ScheduledRequest]) -> None:
        for r in requests:
            assert r.status is ScheduledStatus.WAITING, f"{r.request_id} is added while {r.status.name}"
        self.waiting += requests

    def finish(self, request_ids: list[str]) -> list[ScheduledRequest]:
        """Requests that ended (finished, cancelled, failed, or served elsewhere) leave, waiting or running;
        -> their states, in the order asked (ids this scheduler does not hold are skipped)."""
        wanted = set(request_ids)
        gone = {r.request_id: r for r in [*self.running, *self.waiting] if r.request_id in wanted}
        self.running = [r for r in self.running if r.request_id not in wanted]
        self.waiting = [r for r in self.waiting if r.request_id not in wanted]
        for r in gone.values():
            r.status = ScheduledStatus.FINISHED
        return [gone[i] for i in request_ids if i in gone]

    def holds(self, request_id: str) -> bool:
        """Whether a request of this id waits or runs here."""
        return any(r.request_id == request_id for r in [*self.running, *self.waiting])

    # --- the plan ---

    def next_read(self, now_s: float) -> NextRead | None:
        """How many entries the worker reads before the next plan, and how long it may block; None: none."""
        if self.running:
            if not self.policy.is_continuous:
                return None  # a window batch is closed until its last row ends
            free = self.policy.max_batch_size - len(self.running) - len(self.waiting)
            if free > 0:
                return NextRead(free, None)
            if not any(r.is_interactive for r in self.waiting):
                return NextRead(1, None, is_interactive_only=True)
            return None
        batch, rest = self._forming(now_s)
        if batch and self.policy.is_closed(batch, rest, first_seen_s=self._first_seen_s, now_s=now_s):
            return None
        block_s = self.policy.wait_left_s(first_seen_s=self._first_seen_s, now_s=now_s) if batch else IDLE_READ_S
        return NextRead(self.policy.max_batch_size - len(batch), block_s)

    def schedule(self, now_s: float, *, admit: bool = True) -> SchedulerOutput:
        """The plan for one step.

        A step preempts, prefills newcomers, then runs one decode step for every running row. When nothing
        runs, a batch forms from the waiting requests in order of service (interactive first, then higher
        priority, then age) within max_batch_size and the KV budget (every row counted as long as the longest
        prompt + max_new_tokens); under `window` it starts when it is full, when the next request in order
        does not fit, or max_wait_ms after the scheduler first saw it, and then runs closed until its last row
        ends; under `continuous` it starts at once. While rows run under `continuous`, the running bulk rows
        that must leave for the interactive request at the head of the queue to fit are preempted first (the
        newest first, each at most once, bulk keeping `min_bulk_rows`); they wait again, still claimed, and
        start over later from their prompt with the same seed. Then waiting requests join while rows, the KV
        budget and the step's prefill budget (max_prefill_tokens) allow; a bulk newcomer waits while an
        interactive row decodes. A retried request (it may have crashed its worker) runs alone. With
        admit=False (a stopping worker) nothing joins and the running rows decode to their end.
        """
        if not admit:
            return SchedulerOutput(decode=tuple(self.running))
        if not self.running:
            batch, rest = self._forming(now_s)
            if not batch or not self.policy.is_closed(batch, rest, first_seen_s=self._first_seen_s, now_s=now_s):
                return SchedulerOutput()
            self._first_seen_s = None
            self._start(batch)
            return SchedulerOutput(prefill=tuple(batch), decode=tuple(self.running))
        if not self.policy.is_continuous:
            return SchedulerOutput(decode=tuple(self.running))
        victims = self.policy.victims(self.waiting, self.running)
        self._preempt(victims)
        joining, _rest = self.policy.select(self.waiting, self.running)
        joining = self._within_room(joining)
        self._start(joining)
        return SchedulerOutput(prefill=tuple(joining), preempted=tuple(victims), decode=tuple(self.running))

    # --- figures ---

    @property
    def kv_cache_usage(self) -> float:
        """The share of the KV budget the running rows' cache holds: the pool's blocks held, or (no pool) the
        policy's token count."""
        if self.room is not None:
            return self.room.usage
        return self.policy.batch_tokens(self.running) / self.policy.max_batch_tokens

    def preemption_order(self) -> list[str]:
        """Running rows in the order they give the pool's blocks back when it runs out mid-decode: bulk before
        interactive, the newest first (the engine recomputes such a row when room returns; it keeps its tokens)."""
        newest_first = list(reversed(self.running))
        return [r.request_id for r in sorted(newest_first, key=lambda r: r.is_interactive)]

    def _within_room(self, joining: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """The newcomers, in order, while the pool's free blocks hold them; each running row keeps one block in
        reserve for its next token. A newcomer into an empty batch always joins (the pool holds one request of
        max_context_tokens); one that does not fit stops the rest (the order of service holds)."""
        if self.room is None:
            return joining
        free = self.room.num_free_blocks - len(self.running)
        kept = []
        for r in joining:
            need = self.room.blocks_to_admit(r.request.prompt_token_ids)
            if need > free and (self.running or kept):
                break
            free -= need + 1
            kept.append(r)
        return kept

    # --- moves between the two sets ---

    def _forming(self, now_s: float) -> tuple[list[ScheduledRequest], list[ScheduledRequest]]:
        """Idle: the batch the waiting requests would form now, and the rest; the window opens at the first."""
        batch, rest = self.policy.select(self.waiting)
        if not batch:
            self._first_seen_s = None
        elif self._first_seen_s is None:
            self._first_seen_s = now_s
        return batch, rest

    def _start(self, joining: list[ScheduledRequest]) -> None:
        taken = {id(r) for r in joining}
        self.waiting = [r for r in self.waiting if id(r) not in taken]
        for r in joining:
            r.status = ScheduledStatus.RUNNING
        self.running += joining

    def _preempt(self, victims: list[ScheduledRequest]) -> None:
        taken = {id(r) for r in victims}
        self.running = [r for r in self.running if id(r) not in taken]
        for r in victims:
            r.status, r.num_preemptions, r.is_claimed = ScheduledStatus.WAITING, r.num_preemptions + 1, True
        self.waiting += victims
