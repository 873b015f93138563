"""The measurement arithmetic, the same for every engine: pure, no timing and no engines.

Knows the schedule (round, precision, batch size, engine: every engine sees the same machine state
within a round), how a pair of timed calls becomes tokens/s, medians over rounds, and how far two greedy
token sequences agree. Does not time anything: bench/peers/run.py does, through the adapters.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """One round of one (precision, batch size, engine): a call with N new tokens and one with 1."""

    batch_size: int
    new_tokens: int
    seconds_n: float  # t_N: prefill + N - 1 decode steps
    seconds_1: float  # t_1: prefill and the first token only

    @property
    def e2e_tokens_per_s(self) -> float:
        return self.batch_size * self.new_tokens / self.seconds_n

    @property
    def decode_tokens_per_s(self) -> float | None:
        """B x (N - 1) / (t_N - t_1); None when noise made t_N no longer than t_1."""
        decode_s = self.seconds_n - self.seconds_1
        return self.batch_size * (self.new_tokens - 1) / decode_s if decode_s > 0 else None


@dataclass(frozen=True)
class Cell:
    """Medians over rounds for one (precision, batch size, engine), or why there are none."""

    decode_tokens_per_s: float | None = None
    e2e_tokens_per_s: float | None = None
    agreement: int | None = None  # leading greedy tokens of the first row equal to servelab's
    error: str | None = None
    samples: tuple[Sample, ...] = ()


def schedule(rounds: int, precisions: Sequence[str], batch_sizes: Sequence[int],
             engines: Sequence[str]) -> Iterator[tuple[int, str, int, str]]:
    """(round, precision, batch size, engine), innermost the engine: neighbours share the machine's state."""
    for round_idx in range(rounds):
        for precision in precisions:
            for batch_size in batch_sizes:
                for engine in engines:
                    yield round_idx, precision, batch_size, engine


def median_cell(samples: Sequence[Sample], agreement: int | None) -> Cell:
    decodes = [d for d in (s.decode_tokens_per_s for s in samples) if d is not None]
    return Cell(
        decode_tokens_per_s=statistics.median(decodes) if decodes else None,
        e2e_tokens_per_s=statistics.median(s.e2e_tokens_per_s for s in samples),
        agreement=agreement,
        samples=tuple(samples),
    )


def ratio(value: float | None, baseline: float | None) -> float | None:
    if value is None or not baseline:
        return None
    return value / baseline


@dataclass(frozen=True)
class Rooflines:
    """servelab's decode cost at one precision against the machine, at the run's mean decode context."""

    weight_bytes: int
    kv_bytes_per_token: float
    compute_dtype: str
    peak_flops_per_s: float
    bandwidth_tokens_per_s: dict[int, float]  # batch size -> tokens/s
    compute_tokens_per_s: float  # the same at every batch size


def rooflines(decode_cost: dict, compute_dtype: str, *, bandwidth_gbs: float, peak_flops_per_s: float,
              batch_sizes: Sequence[int], prompt_tokens: int, new_tokens: int) -> Rooflines:
    from servelab.analysis.roofline import DecodeCost, Machine, bandwidth_roofline, compute_roofline, mean_decode_context

    cost = DecodeCost(**decode_cost)
    machine = Machine(bandwidth_gbs, peak_flops_per_s)
    context = mean_decode_context(prompt_tokens, new_tokens)
    return Rooflines(
        weight_bytes=cost.weight_bytes, kv_bytes_per_token=cost.kv_bytes_per_token, compute_dtype=compute_dtype,
        peak_flops_per_s=peak_flops_per_s,
        bandwidth_tokens_per_s={b: bandwidth_roofline(cost, machine, b, context) for b in batch_sizes},
        compute_tokens_per_s=compute_roofline(cost, machine, context),
    )
