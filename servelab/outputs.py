"""What the engine hands back: one Completion per request, and the batch's timings and memory.

Plain frozen dataclasses, no torch: the worker stores them, the lab aggregates them.
A request's times are milliseconds from the start of its own prefill (`started_at_s`, Unix time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servelab.memory import MemoryBreakdown
from servelab.request import FinishReason


@dataclass(frozen=True)
class Alternative:
    """One token and its log-probability under the model (the raw log-softmax of its logits)."""

    token_id: int
    token_bytes: bytes  # the token's exact bytes (a byte-level BPE token may hold part of a character)
    logprob: float

    def to_stored(self) -> dict[str, Any]:
        return {"id": self.token_id, "bytes": list(self.token_bytes), "logprob": self.logprob}

    @classmethod
    def from_stored(cls, stored: dict[str, Any]) -> Alternative:
        return cls(stored["id"], bytes(stored["bytes"]), stored["logprob"])


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability, where its text begins in the row's text, and the most likely
    tokens at its position (most likely first; the chosen one among them when it is one of the top k)."""

    chosen: Alternative
    text_offset: int  # characters of the row's text before this token's
    top: tuple[Alternative, ...] = ()

    def to_stored(self) -> dict[str, Any]:
        """As the results row keeps it (JSON)."""
        return {**self.chosen.to_stored(), "text_offset": self.text_offset,
                "top": [a.to_stored() for a in self.top]}

    @classmethod
    def from_stored(cls, stored: dict[str, Any]) -> TokenLogprobs:
        return cls(Alternative.from_stored(stored), stored["text_offset"],
                   tuple(Alternative.from_stored(a) for a in stored["top"]))


@dataclass(frozen=True)
class Completion:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    finish_reason: FinishReason
    error: str | None = None
    seed: int | None = None
    ttft_ms: float | None = None  # from its prefill's start to the first generated token
    token_times_ms: tuple[float, ...] = ()  # each generated token's time, from its prefill's start
    e2e_ms: float | None = None
    started_at_s: float | None = None  # when its prefill began, Unix time
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per generated token, when the request asked
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (not prefilled): usage.cached_tokens

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def itl_ms(self) -> tuple[float, ...]:
        """Inter-token latencies: gaps between consecutive generated tokens."""
        t = self.token_times_ms
        return tuple(b - a for a, b in zip(t, t[1:]))

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first."""
        if len(self.token_times_ms) < 2:
            return None
        return (self.token_times_ms[-1] - self.token_times_ms[0]) / (len(self.token_times_ms) - 1)


def failed(request_id: str, reason: str, num_prompt_tokens: int = 0) -> Completion:
    return Completion(request_id, "", (), num_prompt_tokens, FinishReason.ERROR, error=reason)


@dataclass(frozen=True)
class BatchTimings:
    prefill_ms: float
    decode_ms: float
    num_rows_per_step: tuple[int, ...]  # rows that made a token at each pass: a prefill (its newcomers) or a decode step
    num_prefill_tokens: int  # per prefill: rows x padded prompt length
    num_decode_tokens: int  # tokens produced by decode steps (not by the prefills)
    num_preempted: int = 0  # rows taken out unfinished, to start over later
    started_at_s: float = 0.0  # Unix time of the first pass
    finished_at_s: float = 0.0  # Unix time the figures were taken
    num_prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries)
    num_prefix_hit_tokens: int = 0  # of those, tokens found there and not prefilled (prefix_cache_hits)

    @property
    def total_ms(self) -> float:
        return self.prefill_ms + self.decode_ms

    @property
    def decode_tok_s(self) -> float:
        """Tokens the decode steps made per second of those steps (0 where none ran)."""
        return self.num_decode_tokens / (max(self.decode_ms, 1e-6) / 1e3)


@dataclass(frozen=True)
class StepOutput:
    """What one add or step did: each row's new token, in row order, the requests that finished, and the text
    each row released (final: complete characters, never a possible stop-string start; only non-empty pieces)."""

    new_tokens: tuple[tuple[str, int], ...]  # (request id, token id)
    finished: tuple[Completion, ...]
    new_text: tuple[tuple[str, int, str], ...] = ()  # (request id, where the piece begins in the row's text, piece)


@dataclass(frozen=True)
class BatchResult:
    completions: tuple[Completion, ...]
    timings: BatchTimings
    memory: MemoryBreakdown
