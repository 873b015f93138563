"""The admission rules the scheduler applies: which waiting requests join the batch, when, and which running
row makes room.

Pure policy: no Redis, no clock of its own (time is an argument), no torch. Two policies share the same
limits (max_batch_size, and the KV-cache token budget counted as the room the batch's cache holds:
rows x the longest row's prompt + max_new_tokens; with a paged pool (`paged`), what the rows hold when they
join, their prompts and one token each, since the pool's blocks grow with each row and a row that finds none
mid-decode gives its blocks back and is recomputed later):
- `window`: a batch forms within max_wait_ms after its first request, then runs closed until its last
  row ends (the card's time-window micro-batching);
- `continuous`: waiting requests join at every step boundary while rows and the budget allow; an
  interactive request that finds no room preempts the newest bulk row, and bulk newcomers wait while an
  interactive row decodes (their prefill would run between its tokens); the newcomers of one step are
  prefilled within max_prefill_tokens, so no step is held up by a large group's prefill.
Order of service: interactive before bulk, then higher `priority`, then age. Bulk progress is guaranteed
by two rules: while bulk work waits, bulk keeps at least `min_bulk_rows` rows of the batch (its next
request goes first when it holds fewer, and preemption never takes it below), and a row is preempted at
most once.
Does not know where requests come from, what runs them, or what a step does (the Scheduler decides that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

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
    paged: bool = False  # the budget is a paged pool's tokens: rows are charged what they hold, not their worst case

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
        """The room the rows' cache holds: every row as long as the longest prompt + max_new_tokens; paged, each
        row's prompt and its first token (the scheduler's room then counts blocks, prefix sharing included)."""
        if self.paged:
            return sum(c.num_prompt_tokens + 1 for c in rows)
        return len(rows) * max((c.num_columns for c in rows), default=0)

    def fits(self, rows: Sequence[ScheduledRequest], candidate: ScheduledRequest) -> bool:
        if not rows:
            return True  # NOTE: a lone request is always served, even past the budget, so nothing starves
        if len(rows) >= self.max_batch_size or candidate.is_retry or any(c.is_retry for c in rows):
            return False  # NOTE: a retried request runs alone, so a poison request cannot take batch-mates down
        return self.batch_tokens([*rows, candidate]) <= self.max_batch_tokens

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
        """Continuous: the newcomers of one step are prefilled together (padded to the longest prompt)
        between two decode steps; their tokens stay within max_prefill_tokens (one newcomer always joins)."""
        if not self.is_continuous or not joining:
            return True
        group = [*joining, candidate]
        return len(group) * max(c.num_prompt_tokens for c in group) <= self.max_prefill_tokens

    def bulk_waits(self, rows: Sequence[ScheduledRequest], candidate: ScheduledRequest) -> bool:
        """Continuous: a bulk newcomer waits while an interactive row decodes, since its prefill runs between
        that row's tokens (bulk's share is exempt, see select)."""
        return self.is_continuous and not candidate.is_interactive and any(c.is_interactive for c in rows)

    def victims(self, waiting: Sequence[ScheduledRequest], running: Sequence[ScheduledRequest]
                ) -> list[ScheduledRequest]:
        """Continuous only: the running bulk rows to preempt so that the interactive request at the head
        fits (the newest first, each row at most once, bulk keeping its share); [] when none would do."""
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
            if self.fits(rows, head):
                return victims
            if row.is_interactive or row.num_preemptions > 0 or bulk_left <= self.bulk_share:
                continue
            rows.remove(row)
            victims.append(row)
            bulk_left -= 1
        return victims if self.fits(rows, head) else []

    def is_closed(self, batch: list[ScheduledRequest], rest: list[ScheduledRequest], *, first_seen_s: float,
                  now_s: float) -> bool:
        """Window: closed when full, when something waiting does not fit, or when the window after the
        first ran out. Continuous: at once (later arrivals join at the next step)."""
        return (self.is_continuous or len(batch) >= self.max_batch_size or bool(rest)
                or now_s - first_seen_s >= self.max_wait_ms / 1e3)

    def wait_left_s(self, *, first_seen_s: float, now_s: float) -> float:
        return max(0.0, first_seen_s + self.max_wait_ms / 1e3 - now_s)
