"""The micro-batching policy: which waiting requests form the next batch, and when it closes.

Pure policy: no Redis, no clock of its own (time is an argument), no torch. Knows the three limits
(max_batch_size, max_wait_ms after the first request, and the KV-cache token budget counted as the
padded worst case), and that interactive requests go before bulk ones. Does not know where
candidates come from or how they are served.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelab.config import BatchingConfig
from servelab.engine.memory import ModelShape


@dataclass(frozen=True)
class Candidate:
    entry_id: str
    request_id: str
    num_prompt_tokens: int
    max_new_tokens: int
    is_interactive: bool
    is_retry: bool = False  # started before and not finished: maybe it crashed its worker


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int
    max_wait_ms: float
    max_batch_tokens: int

    @classmethod
    def from_config(cls, batching: BatchingConfig, shape: ModelShape, *, bytes_per_element: float) -> BatchPolicy:
        """The config's limits; a KV memory budget (max_kv_cache_mib) becomes tokens through the model's
        shape and the cache's bytes per element, and the smaller token budget holds."""
        budget = batching.max_batch_tokens
        if batching.max_kv_cache_mib is not None:
            budget = min(budget, int(batching.max_kv_cache_mib * 2**20 // shape.kv_bytes_per_token(bytes_per_element)))
        return cls(batching.max_batch_size, batching.max_wait_ms, max(budget, 1))

    def batch_tokens(self, batch: list[Candidate]) -> int:
        """KV tokens the batch may retain: every row padded to the longest prompt, plus the longest decode."""
        if not batch:
            return 0
        return len(batch) * (max(c.num_prompt_tokens for c in batch) + max(c.max_new_tokens for c in batch))

    def fits(self, batch: list[Candidate], candidate: Candidate) -> bool:
        if not batch:
            return True  # NOTE: a lone request is always served, even past the budget, so nothing starves
        if len(batch) >= self.max_batch_size or candidate.is_retry or any(c.is_retry for c in batch):
            return False  # NOTE: a retried request runs alone, so a poison request cannot take batch-mates down
        return self.batch_tokens([*batch, candidate]) <= self.max_batch_tokens

    def select(self, waiting: list[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
        """-> (the batch, the rest). Interactive first, then arrival order; stops at the first misfit."""
        ordered = sorted(waiting, key=lambda c: not c.is_interactive)  # stable: keeps arrival order
        batch: list[Candidate] = []
        for i, candidate in enumerate(ordered):
            if not self.fits(batch, candidate):
                return batch, ordered[i:]
            batch.append(candidate)
        return batch, []

    def is_closed(self, batch: list[Candidate], rest: list[Candidate], *, first_seen_s: float, now_s: float) -> bool:
        """Closed when full, when something waiting does not fit, or when the window after the first ran out."""
        return len(batch) >= self.max_batch_size or bool(rest) or now_s - first_seen_s >= self.max_wait_ms / 1e3

    def wait_left_s(self, *, first_seen_s: float, now_s: float) -> float:
        return max(0.0, first_seen_s + self.max_wait_ms / 1e3 - now_s)
