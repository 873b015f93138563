"""Scale-out: one config's streams served by 1, 2, ... worker processes at once, on the same burst.

Knows how to start worker processes on a private copy of a config (a name of its own, so no other worker
takes part), warm them, send the same burst through the queue with each worker count in interleaved
rounds, and say how the work was shared and whether any request ran twice. Does not judge.
"""

from __future__ import annotations

import statistics
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from servelab.config import ServingConfig
from servelab.lab.bursts import BurstOutcome, filler_prompt, send_burst
from servelab.lab.runner import WorkerProcess, start_together
from servelab.analysis.stats import percentile
from servelab.queue.streams import RequestStreams
from servelab.request import SamplingParams
from servelab.runtime import Runtime


@dataclass(frozen=True)
class ScaleRow:
    num_workers: int
    round_index: int
    outcome: BurstOutcome


@contextmanager
def private_workers(config: ServingConfig, runtime: Runtime, *, count: int) -> Iterator[RequestStreams]:
    """`count` worker processes serving a private copy of the config (name `<name>-<random>`); -> its streams.
    They start together, each is awaited before any request is sent, and all stop on exit."""
    private = config.model_copy(update={"name": f"{config.name}-{uuid.uuid4().hex[:8]}"})
    with tempfile.TemporaryDirectory(prefix="servelab-scale-") as folder, ExitStack() as stack:
        path = Path(folder) / f"{private.name}.yaml"
        path.write_text(yaml.safe_dump(private.model_dump(mode="json"), sort_keys=False))
        start_together(stack, [WorkerProcess(path, runtime, f"scale-{private.name}-{i}") for i in range(count)])
        yield RequestStreams(runtime.redis, prefix=runtime.settings.key_prefix, config_name=private.name)


def count_order(counts: Sequence[int], round_index: int) -> list[int]:
    """Ascending in even rounds, descending in odd ones, so a machine's drift falls on every count alike."""
    return list(counts) if round_index % 2 == 0 else list(reversed(counts))


def bench_scale_out(config: ServingConfig, runtime: Runtime, *, worker_counts: Sequence[int], num_requests: int,
                    num_prompt_tokens: int, num_new_tokens: int, num_rounds: int,
                    progress=lambda message: None) -> list[ScaleRow]:
    """The same burst (bulk, every row exactly num_new_tokens) through 1..N workers of one config, per round."""
    prompts = [f"{i}. {filler_prompt(num_prompt_tokens)}" for i in range(num_requests)]
    sampling = SamplingParams(max_new_tokens=num_new_tokens, ignore_eos=True)
    rows = []
    for round_index in range(num_rounds):
        for count in count_order(worker_counts, round_index):
            progress(f"round {round_index + 1}/{num_rounds}: starting {count} worker(s)")
            with private_workers(config, runtime, count=count) as streams:
                # NOTE: a warm-up burst first: the first batches of a fresh process pay for lazy set-up
                send_burst(runtime, streams, prompts=prompts[:2 * count], sampling=SamplingParams(max_new_tokens=2))
                progress(f"round {round_index + 1}/{num_rounds}: {num_requests} requests through {count} worker(s)")
                rows.append(ScaleRow(count, round_index, send_burst(runtime, streams, prompts=prompts, sampling=sampling)))
    return rows


def format_scale_table(rows: list[ScaleRow]) -> str:
    counts = sorted({r.num_workers for r in rows})
    lines = [f"{'workers':>7} {'round':>5} {'tok/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'ran twice':>9}  requests per worker"]
    for r in sorted(rows, key=lambda r: (r.num_workers, r.round_index)):
        o = r.outcome
        shares = " ".join(str(n) for _, n in sorted(o.served_by.items()))
        lines.append(f"{r.num_workers:>7} {r.round_index + 1:>5} {o.tokens_per_s:>8.1f} {percentile(o.latencies_ms, 50):>8.0f} "
                     f"{percentile(o.latencies_ms, 99):>8.0f} {o.num_run_twice:>9}  {shares}")
    base = statistics.median(r.outcome.tokens_per_s for r in rows if r.num_workers == counts[0])
    for count in counts:
        tps = statistics.median(r.outcome.tokens_per_s for r in rows if r.num_workers == count)
        lines.append(f"{count} worker(s): {tps:.1f} tok/s (median of rounds), x{tps / base:.2f} against {counts[0]}")
    lines.append(f"requests that ran more than once, or have other than one result: "
                 f"{sum(r.outcome.num_run_twice for r in rows)} of {sum(r.outcome.num_requests for r in rows)}")
    return "\n".join(lines)
