"""Roofline arithmetic for decoding: what bounds a decode step, and where a precision stops paying.

Pure (no torch, no timing), so the store and the dashboard can read sweeps. Knows the bytes a decode
step reads (weights once, each row's KV cache), the FLOPs per token (2 per weight multiply-add, plus
attention over the context), the two rooflines, their meeting point, the crossover rule, and the sweep's
records. Does not measure anything: servelab/lab/sweep.py measures the machine and the engines.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Bound = Literal["bandwidth", "compute"]


@dataclass(frozen=True)
class DecodeCost:
    """What one decoded token costs a model, independent of the machine.

    NOTE: FLOPs come from the logical weight shapes (in x out of every matmul), bytes from storage: int4
    weights read 1/8 of the fp32 bytes but do the same multiply-adds, dequantised to the compute dtype.
    """

    weight_bytes: int  # read once per decode step, whatever the batch: Engine.step_weight_bytes, the decoder's
    # own layouts without the embedding table (its gather reads B rows; a head that reads it in place counts it)
    num_matmul_params: int  # in x out over every matmul the token passes through, the lm_head included
    num_layers: int
    attention_width: int  # query heads x head_dim: each attends over the whole context
    kv_bytes_per_token: float  # keys + values of one cached token over all layers

    def flops_per_token(self, context_tokens: float) -> float:
        """2 per weight multiply-add, plus QK^T and AV: 2 x 2 x layers x context x attention_width."""
        return 2 * self.num_matmul_params + 4 * self.num_layers * context_tokens * self.attention_width

    def bytes_per_step(self, batch_size: int, context_tokens: float) -> float:
        return self.weight_bytes + batch_size * context_tokens * self.kv_bytes_per_token


@dataclass(frozen=True)
class Machine:
    bandwidth_gbs: float  # memory bandwidth, GB/s (10^9 bytes)
    peak_flops_per_s: float  # matmul peak in the compute dtype


def weights_roofline(weight_bytes: int, bandwidth_gbs: float, batch_size: int) -> float:
    """Decode tokens/s if a step read only the weights, once, at the measured bandwidth (the KV reads left
    out: the engine benches' roof at short contexts; `bandwidth_roofline` adds them)."""
    return batch_size * bandwidth_gbs * 1e9 / weight_bytes


def mean_decode_context(num_prompt_tokens: int, num_new_tokens: int) -> float:
    """Mean cached tokens per row over the decode steps: the prompt, then one more token each step."""
    return num_prompt_tokens + num_new_tokens / 2


def bandwidth_roofline(cost: DecodeCost, machine: Machine, batch_size: int, context_tokens: float) -> float:
    """tokens/s if every step only had to read its bytes: batch x bandwidth / bytes per step."""
    return batch_size * machine.bandwidth_gbs * 1e9 / cost.bytes_per_step(batch_size, context_tokens)


def compute_roofline(cost: DecodeCost, machine: Machine, context_tokens: float) -> float:
    """tokens/s if every token only had to do its FLOPs at peak: independent of the batch size."""
    return machine.peak_flops_per_s / cost.flops_per_token(context_tokens)


def binding_bound(cost: DecodeCost, machine: Machine, batch_size: int, context_tokens: float) -> Bound:
    bandwidth = bandwidth_roofline(cost, machine, batch_size, context_tokens)
    return "bandwidth" if bandwidth <= compute_roofline(cost, machine, context_tokens) else "compute"


def ridge_batch_size(cost: DecodeCost, machine: Machine, context_tokens: float) -> float | None:
    """The batch size at which the two rooflines meet; None when bandwidth binds at every batch size.

    Solves B x BW / (W + B x c x k) = P / F for B: B = P x W / (BW x F - P x c x k). The KV cache grows
    with the batch, so when reading it costs more time per token than computing does, no batch escapes
    the bandwidth bound.
    """
    bandwidth = machine.bandwidth_gbs * 1e9
    flops = cost.flops_per_token(context_tokens)
    denominator = bandwidth * flops - machine.peak_flops_per_s * context_tokens * cost.kv_bytes_per_token
    if denominator <= 0:
        return None
    return machine.peak_flops_per_s * cost.weight_bytes / denominator


@dataclass(frozen=True)
class SweepPoint:
    """One (config, batch size) of a sweep: medians over rounds beside the machine's two rooflines."""

    config: str
    weights: str
    batch_size: int
    num_prompt_tokens: int
    num_new_tokens: int
    decode_tokens_per_s: float  # decode steps only (the prefill's first token excluded)
    tpot_ms: float  # time per output token after the first, mean over the batch's rows
    tokens_per_s: float  # end to end: output tokens over prefill + decode
    bandwidth_roofline_tokens_per_s: float
    compute_roofline_tokens_per_s: float
    ridge_batch_size: float | None  # where this config's rooflines meet on this machine

    @property
    def bound(self) -> Bound:
        is_bandwidth = self.bandwidth_roofline_tokens_per_s <= self.compute_roofline_tokens_per_s
        return "bandwidth" if is_bandwidth else "compute"

    @property
    def roofline_tokens_per_s(self) -> float:
        """The binding (lower) roofline."""
        return min(self.bandwidth_roofline_tokens_per_s, self.compute_roofline_tokens_per_s)

    @property
    def fraction_of_roofline(self) -> float:
        return self.decode_tokens_per_s / self.roofline_tokens_per_s

    def as_dict(self) -> dict:
        return {**asdict(self), "bound": self.bound, "roofline_tokens_per_s": self.roofline_tokens_per_s,
                "fraction_of_roofline": self.fraction_of_roofline}


def sweep_point(*, config: str, weights: str, batch_size: int, num_prompt_tokens: int, num_new_tokens: int,
                decode_tokens_per_s: float, tpot_ms: float, tokens_per_s: float, cost: DecodeCost,
                machine: Machine) -> SweepPoint:
    """A measured point placed against the rooflines at the sweep's mean decode context."""
    context = mean_decode_context(num_prompt_tokens, num_new_tokens)
    return SweepPoint(
        config=config, weights=weights, batch_size=batch_size, num_prompt_tokens=num_prompt_tokens,
        num_new_tokens=num_new_tokens, decode_tokens_per_s=decode_tokens_per_s, tpot_ms=tpot_ms,
        tokens_per_s=tokens_per_s,
        bandwidth_roofline_tokens_per_s=bandwidth_roofline(cost, machine, batch_size, context),
        compute_roofline_tokens_per_s=compute_roofline(cost, machine, context),
        ridge_batch_size=ridge_batch_size(cost, machine, context),
    )


def crossover_batch_size(baseline: list[SweepPoint], candidate: list[SweepPoint]) -> int | None:
    """The smallest batch size from which the candidate's decode tokens/s no longer beats the baseline's,
    at that size and every larger one measured for both; None when it still beats it at the largest.

    A tie is not a win. NOTE: "from which on" rather than "the first loss": one noisy loss followed by
    wins again is not where a precision stops paying.
    """
    assert len({p.config for p in baseline}) == 1 and len({p.config for p in candidate}) == 1, (
        "give the points of one config on each side")
    base = {p.batch_size: p.decode_tokens_per_s for p in baseline}
    cand = {p.batch_size: p.decode_tokens_per_s for p in candidate}
    sizes = sorted(set(base) & set(cand))
    assert sizes, "baseline and candidate share no batch size"
    crossover = None
    for size in reversed(sizes):
        if cand[size] > base[size]:
            break
        crossover = size
    return crossover


@dataclass(frozen=True)
class SweepReport:
    """A whole sweep: the machine as measured, every point, and each candidate's crossover."""

    bandwidth_gbs: float
    peak_flops_per_s: dict[str, float]  # compute dtype ("fp32", "bf16", ...) -> measured matmul peak
    num_threads: int
    device: str
    points: tuple[SweepPoint, ...]
    crossovers: dict[str, int | None]  # candidate config -> crossover batch size against the baseline
    baseline: str  # the first config: the one every candidate is held against

    def as_dict(self) -> dict:
        return {"bandwidth_gbs": self.bandwidth_gbs, "peak_flops_per_s": dict(self.peak_flops_per_s),
                "num_threads": self.num_threads, "device": self.device, "baseline": self.baseline,
                "points": [p.as_dict() for p in self.points], "crossovers": dict(self.crossovers)}
