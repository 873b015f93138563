"""The batch sweep: decode speed against batch size for each config, beside the machine's rooflines.

Knows how to measure the machine (memory bandwidth, matmul peak in a config's compute dtype), a model's
decode cost (bytes from storage, FLOPs from logical weight shapes), and how to time every (config, batch)
pair in interleaved rounds on a shared, noisy machine (medians). The arithmetic is servelab/analysis/roofline.py.
Does not store sweeps or know queues: it calls the engine directly.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch

from servelab.engine.engine import Engine
from servelab.engine.loader import DTYPES
from servelab.lab.bench import bench_requests
from servelab.hardware import measure_bandwidth_gbs, sync
from servelab.analysis.stats import interleaved_medians
from servelab.analysis.roofline import (
    DecodeCost,
    Machine,
    SweepPoint,
    SweepReport,
    crossover_batch_size,
    sweep_point,
)

DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def measure_peak_flops(device: torch.device, dtype: torch.dtype, *, size: int | None = None,
                       repeats: int = 5) -> float:
    """Best of `repeats` square products in `dtype` through F.linear: FLOP/s (2 n^3 each), after a warm-up.

    NOTE: measured in the dtype the config computes in, since CPUs differ wildly by dtype (bf16 without
    AVX-512 / AMX runs far below fp32; fp16 has no fast CPU path at all); and through F.linear, the op
    nn.Linear runs: on an AVX2-only CPU bf16 torch.matmul measured 0.4 GFLOP/s against 2.8 for F.linear.
    """
    n = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for i in range(repeats + 1):
        sync(device)
        started = time.perf_counter()
        torch.nn.functional.linear(a, b)
        sync(device)
        if i:  # the first call pays for lazy initialisation
            best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best


def compute_dtype_name(engine: Engine) -> str:
    """The dtype the matmuls run in: the weights' for fp32 / bf16 / fp16, the dequantised one for int4."""
    return DTYPE_NAMES.get(engine.loaded.dtype, str(engine.loaded.dtype).removeprefix("torch."))


def decode_cost(engine: Engine) -> DecodeCost:
    hf_config = engine.loaded.model.config
    shape = engine.loaded.shape
    # NOTE: every matmul layer (nn.Linear and the quantised linear kernels alike) names its logical
    # in_features / out_features; packed int4 storage would undercount parameters 8-fold
    num_matmul_params = sum(
        m.in_features * m.out_features for m in engine.loaded.model.modules()
        if not any(True for _ in m.children()) and hasattr(m, "in_features") and hasattr(m, "out_features")
    )
    return DecodeCost(
        weight_bytes=engine.step_weight_bytes,
        num_matmul_params=num_matmul_params,
        num_layers=shape.num_layers,
        attention_width=hf_config.num_attention_heads * shape.head_dim,
        kv_bytes_per_token=shape.kv_bytes_per_token(engine.kv_bytes_per_element),
    )


def time_batch(engine: Engine, batch_size: int, num_prompt_tokens: int,
               num_new_tokens: int) -> tuple[float, float, float]:
    """One batch of equal prompts, exactly num_new_tokens each -> (decode tokens/s, TPOT ms, tokens/s)."""
    result = engine.generate(bench_requests(engine, batch_size, num_prompt_tokens, num_new_tokens))
    assert all(c.error is None for c in result.completions), [c.error for c in result.completions]
    t = result.timings
    num_tokens = sum(c.num_generated_tokens for c in result.completions)
    tpot_ms = statistics.mean(c.tpot_ms for c in result.completions)
    return t.decode_tok_s, tpot_ms, num_tokens / (t.total_ms / 1e3)


def run_sweep(
    engines: list[Engine], *, batch_sizes: list[int], num_prompt_tokens: int, num_new_tokens: int,
    num_rounds: int, progress: Callable[[str], None] = lambda message: None,
    bandwidth_gbs: float | None = None, peak_flops_per_s: Mapping[str, float] | None = None,
) -> list[SweepPoint]:
    """Interleaved rounds: every (engine, batch size) pair once per round, round after round; medians.

    The machine's bandwidth and per-dtype peak are measured here unless given (sweep_report gives them).
    """
    _check_sweep(engines, num_new_tokens)
    bandwidth_gbs = bandwidth_gbs or measure_bandwidth_gbs(engines[0].device)
    peaks = dict(peak_flops_per_s or measure_peaks(engines))
    for engine in engines:  # warm-up: first calls pay for lazy initialisation
        time_batch(engine, 1, 8, 2)
    cells = [(e_idx, batch_size) for e_idx in range(len(engines)) for batch_size in batch_sizes]
    medians = interleaved_medians(
        cells, lambda cell: time_batch(engines[cell[0]], cell[1], num_prompt_tokens, num_new_tokens),
        num_rounds=num_rounds, progress=progress, label=lambda cell: f"{engines[cell[0]].config.name} batch {cell[1]}")
    points = []
    for (e_idx, batch_size), (decode, tpot, e2e) in medians.items():
        engine = engines[e_idx]
        machine = Machine(bandwidth_gbs, peaks[compute_dtype_name(engine)])
        points.append(sweep_point(
            config=engine.config.name, weights=engine.config.weights, batch_size=batch_size,
            num_prompt_tokens=num_prompt_tokens, num_new_tokens=num_new_tokens, decode_tokens_per_s=decode,
            tpot_ms=tpot, tokens_per_s=e2e, cost=decode_cost(engine), machine=machine,
        ))
    return points


def measure_peaks(engines: list[Engine]) -> dict[str, float]:
    """Matmul peak once per compute dtype the engines use, on the first engine's device."""
    names = dict.fromkeys(compute_dtype_name(e) for e in engines)
    return {name: measure_peak_flops(engines[0].device, DTYPES[name]) for name in names}


def sweep_report(
    engines: list[Engine], *, batch_sizes: list[int], num_prompt_tokens: int, num_new_tokens: int,
    num_rounds: int, progress: Callable[[str], None] = lambda message: None,
) -> SweepReport:
    """Measure the machine, sweep every engine, and hold every later config against the first."""
    _check_sweep(engines, num_new_tokens)
    progress("measuring memory bandwidth and matmul peak")
    bandwidth_gbs = measure_bandwidth_gbs(engines[0].device)
    peaks = measure_peaks(engines)
    points = run_sweep(engines, batch_sizes=batch_sizes, num_prompt_tokens=num_prompt_tokens,
                       num_new_tokens=num_new_tokens, num_rounds=num_rounds, progress=progress,
                       bandwidth_gbs=bandwidth_gbs, peak_flops_per_s=peaks)
    by_config = {e.config.name: [p for p in points if p.config == e.config.name] for e in engines}
    baseline = engines[0].config.name
    crossovers = {name: crossover_batch_size(by_config[baseline], pts) for name, pts in by_config.items()
                  if name != baseline}
    return SweepReport(bandwidth_gbs=bandwidth_gbs, peak_flops_per_s=peaks, num_threads=torch.get_num_threads(),
                       device=str(engines[0].device), points=tuple(points), crossovers=crossovers,
                       baseline=baseline)


def format_sweep_table(report: SweepReport) -> str:
    peaks = ", ".join(f"{name} {flops / 1e9:.1f}" for name, flops in report.peak_flops_per_s.items())
    lines = [
        f"device {report.device}; threads {report.num_threads}; memory bandwidth {report.bandwidth_gbs:.1f} GB/s; "
        f"matmul peak GFLOP/s: {peaks}",
        f"{'config':<12} {'weights':<9} {'batch':>5} {'decode tok/s':>12} {'TPOT ms':>8} {'e2e tok/s':>9} "
        f"{'BW roof':>9} {'FLOP roof':>9} {'of roof':>7} {'bound':<9}",
    ]
    for p in report.points:
        lines.append(
            f"{p.config:<12} {p.weights:<9} {p.batch_size:>5} {p.decode_tokens_per_s:>12.1f} {p.tpot_ms:>8.1f} "
            f"{p.tokens_per_s:>9.1f} {p.bandwidth_roofline_tokens_per_s:>9.0f} {p.compute_roofline_tokens_per_s:>9.0f} "
            f"{p.fraction_of_roofline:>6.0%} {p.bound:<9}"
        )
    for config in dict.fromkeys(p.config for p in report.points):
        ridge = next(p.ridge_batch_size for p in report.points if p.config == config)
        lines.append(f"ridge batch ({config}): " + (f"{ridge:.1f}" if ridge is not None
                                                    else "none (the KV cache keeps it bandwidth bound)"))
    for config, crossover in report.crossovers.items():
        lines.append(f"crossover ({config} vs {report.baseline}): " + (
            f"no longer faster from batch {crossover}" if crossover is not None
            else "faster at every measured batch size"))
    if any(p.fraction_of_roofline > 1 for p in report.points):
        lines.append("warning: a point beats its roofline: the measured peak or bandwidth understates this machine")
    lines.append("BW roof: batch x bandwidth / (weight bytes + batch x mean context x KV bytes per token); "
                 "FLOP roof: peak / (2 x weights + attention) FLOPs per token; of roof: decode tok/s / the lower")
    return "\n".join(lines)


def _check_sweep(engines: list[Engine], num_new_tokens: int) -> None:
    if not engines:
        raise ValueError("a sweep needs at least one engine")
    names = [e.config.name for e in engines]
    if len(set(names)) != len(names):
        raise ValueError(f"config names must differ within a sweep (points are keyed by name), got {names}")
    if num_new_tokens < 2:
        raise ValueError(
            f"num_new_tokens must be at least 2 (one prefill token, then decode steps), got {num_new_tokens}")
