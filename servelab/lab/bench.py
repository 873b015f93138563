"""Engine benchmark: this engine against transformers' own generate, side by side in one run.

Knows how to build equal-length prompts, time both engines in interleaved rounds (the machine is
shared and noisy, so only ratios from the same run mean anything), and hold decode speed against
the memory-bandwidth roofline; for `servelab bench queue`, start a worker process on a private copy of
a config and time one burst in-process and through the queue. Does not parse options or print: the CLI does.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from servelab.config import ServingConfig
from servelab.engine.engine import Engine
from servelab.analysis.roofline import weights_roofline
from servelab.analysis.stats import interleaved_medians
from servelab.lab.bursts import FILLER, send_burst
from servelab.lab.scaling import private_workers
from servelab.queue.streams import RequestStreams
from servelab.request import GenerationRequest, SamplingParams
from servelab.runtime import Runtime
from servelab.store.models import StreamKind


@dataclass(frozen=True)
class EngineBenchRow:
    config: str
    weights: str
    batch_size: int
    num_threads: int
    tokens_per_s: float  # this engine, output tokens over prefill + decode
    decode_tokens_per_s: float  # this engine, decode steps only
    hf_tokens_per_s: float  # transformers generate(use_cache=True), output tokens over its whole call
    roofline_tokens_per_s: float  # weights_roofline: batch x bandwidth / weight bytes read per decode step

    @property
    def ratio_to_hf(self) -> float:
        return self.tokens_per_s / self.hf_tokens_per_s

    @property
    def fraction_of_roofline(self) -> float:
        return self.decode_tokens_per_s / self.roofline_tokens_per_s

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio_to_hf": self.ratio_to_hf, "fraction_of_roofline": self.fraction_of_roofline}


def bench_requests(engine: Engine, batch_size: int, num_prompt_tokens: int, num_new_tokens: int) -> list[GenerationRequest]:
    ids = engine.tokenizer.encode(FILLER * (1 + num_prompt_tokens // 20), add_special_tokens=False)
    prompt = engine.tokenizer.decode(ids[:num_prompt_tokens])
    params = SamplingParams(max_new_tokens=num_new_tokens, ignore_eos=True)
    return [GenerationRequest(f"bench-{i}", prompt=prompt, params=params) for i in range(batch_size)]


def time_engine(engine: Engine, requests: list[GenerationRequest]) -> tuple[float, float]:
    """-> (output tokens/s over the whole batch, decode tokens/s)."""
    result = engine.generate(requests)
    num_tokens = sum(c.num_generated_tokens for c in result.completions)
    assert all(c.error is None for c in result.completions), [c.error for c in result.completions]
    return num_tokens / (result.timings.total_ms / 1e3), result.timings.decode_tok_s


@torch.inference_mode()
def time_hf_generate(engine: Engine, requests: list[GenerationRequest]) -> float:
    """transformers' generate on the same prompt ids, greedy, exactly max_new_tokens each."""
    ids = torch.tensor([engine.encode(r) for r in requests], device=engine.device)  # (B, T), equal lengths
    num_new = requests[0].params.max_new_tokens
    started = time.perf_counter()
    out = engine.model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new, min_new_tokens=num_new,
        do_sample=False, use_cache=True, pad_token_id=engine.pad_token_id,
    )
    elapsed = time.perf_counter() - started
    assert out.shape[1] == ids.shape[1] + num_new, out.shape
    return ids.shape[0] * num_new / elapsed


def bench_engines(
    engines: list[Engine], *, batch_sizes: list[int], num_prompt_tokens: int, num_new_tokens: int,
    num_rounds: int, bandwidth_gbs: float, progress=lambda message: None,
) -> list[EngineBenchRow]:
    """Interleaved rounds: every (engine, batch size) pair, ours then HF's, round after round; medians."""
    for engine in engines:  # warm-up: first calls pay for lazy initialisation
        warm = bench_requests(engine, 1, 8, 2)
        time_engine(engine, warm), time_hf_generate(engine, warm)

    def measure(cell: tuple[int, int]) -> tuple[float, float, float]:
        engine = engines[cell[0]]
        requests = bench_requests(engine, cell[1], num_prompt_tokens, num_new_tokens)
        return (*time_engine(engine, requests), time_hf_generate(engine, requests))

    cells = [(e_idx, batch_size) for e_idx in range(len(engines)) for batch_size in batch_sizes]
    medians = interleaved_medians(cells, measure, num_rounds=num_rounds, progress=progress,
                                  label=lambda cell: f"{engines[cell[0]].config.name} batch {cell[1]}")
    return [EngineBenchRow(engines[e].config.name, engines[e].config.weights, b, torch.get_num_threads(), ours, decode,
                           hf, weights_roofline(engines[e].step_weight_bytes, bandwidth_gbs, b))
            for (e, b), (ours, decode, hf) in medians.items()]


def format_engine_table(rows: list[EngineBenchRow], *, bandwidth_gbs: float, kernels: dict[str, str]) -> str:
    lines = [
        f"memory bandwidth (measured): {bandwidth_gbs:.1f} GB/s; threads: {rows[0].num_threads if rows else '-'}",
        f"{'config':<12} {'weights':<9} {'batch':>5} {'tok/s':>9} {'HF tok/s':>9} {'ratio':>6} "
        f"{'decode tok/s':>12} {'roofline':>9} {'of roof':>7}",
    ]
    for r in rows:
        lines.append(
            f"{r.config:<12} {r.weights:<9} {r.batch_size:>5} {r.tokens_per_s:>9.1f} {r.hf_tokens_per_s:>9.1f} "
            f"{r.ratio_to_hf:>5.2f}x {r.decode_tokens_per_s:>12.1f} {r.roofline_tokens_per_s:>9.0f} "
            f"{r.fraction_of_roofline:>6.0%}"
        )
    lines.append("roofline: batch x bandwidth / weight bytes (every decode step reads all weights once)")
    lines += [f"kernel {name}: {kernel}" for name, kernel in kernels.items()]
    return "\n".join(lines)


# Each step of the engine's speed work, as settings of one serving config; `servelab bench steps` measures
# them side by side so docs/performance.md's gains come from one run (servelab/engine/decoder.py, linear.py).
STEPS: tuple[tuple[str, dict[str, str]], ...] = (
    ("transformers forward, dynamic cache", {"decoder": "transformers"}),
    ("servelab decoder, torch F.linear", {"decoder": "auto", "linear_kernel": "torch"}),
    ("+ oneDNN pre-packed weights", {"decoder": "auto", "linear_kernel": "onednn"}),
    ("+ servelab AVX2 kernels", {"decoder": "auto", "linear_kernel": "servelab-avx2"}),
    ("+ servelab AVX-512 kernels", {"decoder": "auto", "linear_kernel": "servelab-avx512"}),
    ("auto (measured per batch size)", {"decoder": "auto", "linear_kernel": "auto"}),
)


@dataclass(frozen=True)
class StepRow:
    step: str
    batch_size: int
    tokens_per_s: float  # output tokens over prefill + decode
    decode_tokens_per_s: float
    roofline_tokens_per_s: float  # weights_roofline: batch x bandwidth / weight bytes


def bench_steps(
    engines: dict[str, Engine], *, batch_sizes: list[int], num_prompt_tokens: int, num_new_tokens: int,
    num_rounds: int, bandwidth_gbs: float, progress=lambda message: None,
) -> list[StepRow]:
    """Interleaved rounds over (batch size, step); medians. Every engine serves the same config but one setting."""
    for engine in engines.values():
        time_engine(engine, bench_requests(engine, 2, 8, 2))  # warm-up
    cells = [(step, batch_size) for batch_size in batch_sizes for step in engines]
    medians = interleaved_medians(
        cells, lambda cell: time_engine(engines[cell[0]], bench_requests(engines[cell[0]], cell[1], num_prompt_tokens,
                                                                         num_new_tokens)),
        num_rounds=num_rounds, progress=progress, label=lambda cell: f"batch {cell[1]}: {cell[0]}")
    return [StepRow(step, b, tokens, decode, weights_roofline(engines[step].step_weight_bytes, bandwidth_gbs, b))
            for (step, b), (tokens, decode) in medians.items()]


def format_steps_table(rows: list[StepRow], *, header: str) -> str:
    lines = [header, f"{'batch':>5} {'step':<38} {'tok/s':>8} {'decode':>8} {'x prev':>7} {'x first':>7} {'of roof':>7}"]
    for batch_size in dict.fromkeys(r.batch_size for r in rows):
        batch_rows = [r for r in rows if r.batch_size == batch_size]
        for i, r in enumerate(batch_rows):
            prev, first = batch_rows[max(i - 1, 0)], batch_rows[0]
            lines.append(f"{r.batch_size:>5} {r.step:<38} {r.tokens_per_s:>8.1f} {r.decode_tokens_per_s:>8.1f} "
                         f"{r.decode_tokens_per_s / prev.decode_tokens_per_s:>6.2f}x "
                         f"{r.decode_tokens_per_s / first.decode_tokens_per_s:>6.2f}x "
                         f"{r.decode_tokens_per_s / r.roofline_tokens_per_s:>6.0%}")
    lines.append("x prev / x first: decode tok/s against the step above / the first step; "
                 "of roof: decode tok/s over batch x bandwidth / weight bytes")
    return "\n".join(lines)


@dataclass(frozen=True)
class PathTiming:
    """One serving path over the same burst of requests: throughput and client-observed latency."""

    path: str
    num_requests: int
    output_tokens: int
    wall_s: float
    latencies_ms: tuple[float, ...]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def latency_percentile_ms(self, q: float) -> float:
        return nearest_rank(self.latencies_ms, q)


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The value at rank q % of the sorted values (no interpolation: a latency someone saw), q in 0..100."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def time_in_process(engine: Engine, requests: list[GenerationRequest], max_batch_size: int) -> PathTiming:
    """The engine called directly, the burst cut into batches of max_batch_size, one after another."""
    started = time.perf_counter()
    latencies, num_tokens = [], 0
    for i in range(0, len(requests), max_batch_size):
        result = engine.generate(requests[i:i + max_batch_size])
        done_ms = (time.perf_counter() - started) * 1e3
        latencies += [done_ms] * len(result.completions)
        num_tokens += sum(c.num_generated_tokens for c in result.completions)
    return PathTiming("in-process", len(requests), num_tokens, time.perf_counter() - started, tuple(latencies))


def time_queue_path(runtime: Runtime, streams: RequestStreams, requests: list[GenerationRequest], *,
                    kind: StreamKind) -> PathTiming:
    """The same burst through the full path: the rows committed and their ids added (one transaction, one
    pipelined XADD), a worker process reading the stream, claiming, serving and storing, the notifications."""
    assert len({r.params for r in requests}) == 1, "a burst shares one sampling"
    outcome = send_burst(runtime, streams, prompts=[r.prompt for r in requests], sampling=requests[0].params, kind=kind)
    return PathTiming("queue", outcome.num_requests, outcome.output_tokens, outcome.wall_s, outcome.latencies_ms)


@dataclass(frozen=True)
class QueueBench:
    """One config of `bench queue`: its engine in this process, and a worker process serving a private copy."""

    engine: Engine
    streams: RequestStreams


@contextmanager
def start_queue_bench(config: ServingConfig, runtime: Runtime) -> Iterator[QueueBench]:
    """The config's engine here and one worker process for it, stopped on exit. Raises ModelLoadError when the
    config's model does not load (before any process is started).
    NOTE: a process of its own, as deployed: the bench's client and in-process engine never share its GIL."""
    engine = Engine.from_config(config, runtime.settings)
    with private_workers(config, runtime, count=1) as streams:
        yield QueueBench(engine, streams)


def time_queue_rounds(
    benches: list[QueueBench], runtime: Runtime, *, num_requests: int, num_prompt_tokens: int, num_new_tokens: int,
    num_rounds: int, kind: StreamKind = StreamKind.BULK, progress=lambda message: None,
) -> list[list[tuple[PathTiming, PathTiming]]]:
    """Per config, one (in-process, queue) pair per round on the same burst; the configs interleaved round
    after round, since only pairs measured close together on a shared machine compare."""
    burst = bench_requests(benches[0].engine, num_requests, num_prompt_tokens, num_new_tokens)
    for bench in benches:  # warm-up, both paths
        time_in_process(bench.engine, burst[:2], bench.engine.config.batching.max_batch_size)
        time_queue_path(runtime, bench.streams, burst[:2], kind=kind)
    pairs: list[list[tuple[PathTiming, PathTiming]]] = [[] for _ in benches]
    for round_idx in range(num_rounds):
        for bench, config_pairs in zip(benches, pairs):
            progress(f"round {round_idx + 1}/{num_rounds}: {bench.engine.config.name}")
            config_pairs.append((time_in_process(bench.engine, burst, bench.engine.config.batching.max_batch_size),
                                 time_queue_path(runtime, bench.streams, burst, kind=kind)))
    return pairs


def format_queue_table(rows: list[tuple[PathTiming, PathTiming]]) -> str:
    """One block per round; each pair was measured back to back on the same burst."""
    lines = [f"{'path':<11} {'requests':>8} {'tok/s':>8} {'p50 ms':>8} {'p99 ms':>8}"]
    for direct, queued in rows:
        for t in (direct, queued):
            lines.append(f"{t.path:<11} {t.num_requests:>8} {t.tokens_per_s:>8.1f} "
                         f"{t.latency_percentile_ms(50):>8.0f} {t.latency_percentile_ms(99):>8.0f}")
        lines.append(f"{'ratio':<11} {'':>8} {queued.tokens_per_s / direct.tokens_per_s:>7.2f}x "
                     f"{queued.latency_percentile_ms(50) / direct.latency_percentile_ms(50):>7.2f}x "
                     f"{queued.latency_percentile_ms(99) / direct.latency_percentile_ms(99):>7.2f}x")
    lines.append("ratio = queue / in-process: tok/s below 1x and latency above 1x are the cost of the queue")
    return "\n".join(lines)


def format_queue_comparison(names: list[str], pairs: list[list[tuple[PathTiming, PathTiming]]]) -> str:
    """Queue-path throughput and p50 latency of every config against the first, median over rounds."""
    def median_of(config_pairs, what):
        return statistics.median(what(queued) for _, queued in config_pairs)

    base_tps = median_of(pairs[0], lambda t: t.tokens_per_s)
    base_p50 = median_of(pairs[0], lambda t: t.latency_percentile_ms(50))
    lines = [f"through the queue, against {names[0]} (median of rounds):",
             f"{'config':<24} {'tok/s':>8} {'x':>7} {'p50 ms':>8} {'x':>7}"]
    for name, config_pairs in zip(names, pairs):
        tps, p50 = median_of(config_pairs, lambda t: t.tokens_per_s), median_of(config_pairs, lambda t: t.latency_percentile_ms(50))
        lines.append(f"{name:<24} {tps:>8.1f} {tps / base_tps:>6.2f}x {p50:>8.0f} {p50 / base_p50:>6.2f}x")
    return "\n".join(lines)
