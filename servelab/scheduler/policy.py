"""The admission rules the scheduler applies: which waiting requests join the batch, when, and which running
row makes room.

Pure policy: no Redis, no clock of its own (time is an argument), no torch. Two policies share the same
limits: max_batch_size, and the KV room. Without a paged pool the room is a token budget counted as the batch's
cache holds it (rows x the longest row's prompt + max_new_tokens); with one (`paged`) the scheduler counts the
pool's real free blocks (its cached prefixes shared) and these rules count rows only:
- `window`: a batch forms within max_wait_ms after its first request, then runs closed until its last
  row ends (the card's time-window micro-batching);
- `continuous`: waiting requests join at every step boundary while rows and the room allow; an
  interactive request that finds no room preempts the newest bulk row, and bulk newcomers wait while an
  interactive row decodes (their prefill would run between its tokens). Without a pool, the newcomers of one
  step are prefilled whole, together, left-padded, within max_prefill_tokens; with one, the scheduler cuts
  prompts into chunks within the step's token budget instead.
Order of service: interactive before bulk, then higher `priority`, then age. Bulk progress is guaranteed
by two rules: while bulk work waits, bulk keeps at least `min_bulk_rows` rows of the batch (its next
request goes first when it holds fewer, and preemption never takes it below), and a row is preempted at
most once.
Does not know where requests come from, what runs them, or what a step does (the Scheduler decides that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from servelab.config import BatchingConfig
from servelab.memory import ModelShape
from servelab.scheduler.state import ScheduledRequest

AdmissionPolicy = Literal["window", "continuous"]


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int
    max_wait_ms: float
    max_batch_tokens: int
    policy: AdmissionPolicy = "window"
    min_bulk_rows: int = 1
    max_prefill_tokens: int = 256
    paged: bool = False  # the KV room is a paged pool's blocks, which the scheduler counts: these rules count rows

    @classmethod
    def from_config(cls, batching: BatchingConfig, shape: ModelShape, *, bytes_per_element: float) -> BatchPolicy:
        """The config's limits; a KV memory budget (max_kv_cache_mib) becomes tokens through the model's
        shape and the cache's bytes per element, and the smaller token budget holds."""
        budget = batching.max_batch_tokens
        if batching.max_kv_cache_mib is not None:
            budget = min(budget, int(batching.max_kv_cache_mib * 2**20 // shape.kv_bytes_per_token(bytes_per_element)))
        return cls(batching.max_batch_size, batching.max_wait_ms, max(budget, 1), batching.policy,
                   batching.min_bulk_rows, batching.max_prefill_tokens)

    @property
    def is_continuous(self) -> bool:
        return self.policy == "continuous"

    @property
    def bulk_share(self) -> int:
        """Rows bulk keeps while it has work; never the whole batch, so interactive always gets in."""
        return max(0, min(self.min_bulk_rows, self.max_batch_size - 1))

    def batch_tokens(self, rows: Sequence[ScheduledRequest]) -> int:
        """The room the rows' cache holds without a pool: every row as long as the longest prompt + max_new_tokens."""
        return len(rows) * max((c.num_columns for c in rows), default=0)

    def fits(self, rows: Sequence[ScheduledRequest], candidate: ScheduledRequest) -> bool:
        if not rows:
            return True  # NOTE: a lone request is always served, even past the budget, so nothing starves
        if len(rows) >= self.max_batch_size or candidate.is_retry or any(c.is_retry for c in rows):
            return False  # NOTE: a retried request runs alone, so a poison request cannot take batch-mates down
        return self.paged or self.batch_tokens([*rows, candidate]) <= self.max_batch_tokens

    def order(self, waiting: Sequence[ScheduledRequest]) -> list[ScheduledRequest]:
        """Interactive first, then higher priority, then older."""
        return sorted(waiting, key=lambda c: (not c.is_interactive, -c.priority, c.enqueued_s))

    def select(self, waiting: Sequence[ScheduledRequest], running: Sequence[ScheduledRequest] = ()
               ) -> tuple[list[ScheduledRequest], list[ScheduledRequest]]:
        """-> (what joins now, the rest), in order of service; stops at the first that does not fit. While
        bulk holds fewer rows than its share, bulk's next request goes first if it fits."""
        ordered = self.order(waiting)
        rows, joining = list(running), []
        first_bulk = next((c for c in ordered if not c.is_interactive), None)
        bulk_running = sum(not c.is_interactive for c in running)
        if first_bulk is not None and bulk_running < self.bulk_share and self.fits(rows, first_bulk):
            ordered.remove(first_bulk)
            rows.append(first_bulk)
            joining.append(first_bulk)
        for i, candidate in enumerate(ordered):
            if (self.bulk_waits(rows, candidate) or not self.fits(rows, candidate)
                    or not self.prefill_fits(joining, candidate)):
                return joining, ordered[i:]
            rows.append(candidate)
            joining.append(candidate)
        return joining, []

    def prefill_fits(self, joining: Sequence[ScheduledRequest], candidate: ScheduledRequest) -> bool:
        """Continuous without a pool: the newcomers of one step are prefilled whole and together (padded to the longest
        prompt) between two decode steps; their tokens stay within max_prefill_tokens (one newcomer always joins).
        With a pool the scheduler chunks prompts within the step's token budget instead."""
        if not self.is_continuous or not joining or self.paged:
            return True
        group = [*joining, candidate]
        return len(group) * max(c.num_prompt_tokens for c in group) <= self.max_prefill_tokens

    def bulk_waits(self, rows: Sequence[ScheduledRequest], candidate: ScheduledRequest) -> bool:
        """Continuous: a bulk newcomer waits while an interactive row decodes, since its prefill runs between
        that row's tokens (bulk's share is exempt, see select)."""
        return self.is_continuous and not candidate.is_interactive and any(c.is_interactive for c in rows)

    def victims(self, waiting: Sequence[ScheduledRequest], running: Sequence[ScheduledRequest],
                fits: Callable[[list[ScheduledRequest], ScheduledRequest, list[ScheduledRequest]], bool] | None = None
                ) -> list[ScheduledRequest]:
        """Continuous only: the running bulk rows to preempt so that the interactive request at the head
        fits (the newest first, each row at most once, bulk keeping its share); [] when none would do.
        fits(rows left, head, victims so far): the room check (a paged pool's free blocks, what the victims free
        counted); by default this policy's."""
        fits = fits or (lambda rows, head, _victims: self.fits(rows, head))
        ordered = self.order(waiting)
        if not self.is_continuous or not ordered or not ordered[0].is_interactive:
            return []
        head = ordered[0]
        if any(c.is_retry for c in running) or head.is_retry:
            return []  # NOTE: a retry runs alone and ends; preempting it would only run it again
        rows = list(running)
        bulk_left = sum(not c.is_interactive for c in rows)
        victims = []
        for row in reversed(running):  # the newest row has done the least work
            if fits(rows, head, victims):
                return victims
            if row.is_interactive or row.num_preemptions > 0 or bulk_left <= self.bulk_share:
                continue
            rows.remove(row)
            victims.append(row)
            bulk_left -= 1
        return victims if fits(rows, head, victims) else []

    def is_closed(self, batch: list[ScheduledRequest], rest: list[ScheduledRequest], *, first_seen_s: float,
                  now_s: float) -> bool:
        """Window: closed when full, when something waiting does not fit, or when the window after the
        first ran out. Continuous: at once (later arrivals join at the next step)."""
        return (self.is_continuous or len(batch) >= self.max_batch_size or bool(rest)
                or now_s - first_seen_s >= self.max_wait_ms / 1e3)

    def wait_left_s(self, *, first_seen_s: float, now_s: float) -> float:
        return max(0.0, first_seen_s + self.max_wait_ms / 1e3 - now_s)
