"""The KV cache's benchmarks in the `bench` group: `bench prefix` (prefix caching off against on, a batch job through
the Batch API of a stack the bench starts), `bench chunked` (running rows' inter-token time while a long
newcomer is prefilled, in the engine) and `bench kv-dtype` (cache precisions side by side: bytes per token, decode
speed at long contexts, greedy agreement).

Knows these commands' options, their checks and what they print. Does not know how anything is started or timed:
servelab/lab/prefix_bench.py, chunked_bench.py and kv_bench.py do. torch and the engine are imported inside.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from servelab.cli.options import (ConfigOption, ThreadsOption, fail, load_config, load_engines, parse_ints, progress,
                                  settings)


def bench_prefix(
    baseline: Annotated[Path, typer.Option(help="serving config YAML with prefix caching off")]
    = Path("configs/fp32-continuous-prefix-off.yaml"),
    candidate: Annotated[Path, typer.Option(help="serving config YAML with prefix caching on")]
    = Path("configs/fp32-continuous-prefix-on.yaml"),
    lines: Annotated[int, typer.Option(min=1, max=100_000, help="lines in the batch job")] = 200,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="tokens each line makes (EOS ignored)")] = 16,
    rounds: Annotated[int, typer.Option(min=1, help="rounds; the configs' order alternates")] = 1,
) -> None:
    """Prefix caching off against on: the same batch job (every line opens with the ~570-token system prompt of
    workloads/shared-prefix.yaml) through the Batch API of a stack this bench starts on throwaway storage, one
    worker per config; wall time of each job, their ratio, and the prefix-cache hit rate from each worker's
    /metrics. Run it where nothing else loads the CPU: both workers share this machine."""
    configs = [load_config(baseline), load_config(candidate)]
    if configs[0].name == configs[1].name:
        fail(f"--baseline and --candidate are both named {configs[0].name!r}: each config needs a stream of its own")
    if max_new_tokens > min(c.decoding.max_new_tokens for c in configs):
        fail(f"--max-new-tokens {max_new_tokens}: above a config's decoding.max_new_tokens")

    from servelab.analysis.verdict import changed_factors
    from servelab.lab.prefix_bench import PrefixBenchError, format_prefix_table, run_prefix_bench

    try:
        jobs = run_prefix_bench(settings(), [baseline, candidate], num_lines=lines, max_new_tokens=max_new_tokens,
                                num_rounds=rounds, progress=progress)
    except PrefixBenchError as exc:
        fail(str(exc))
    sides = ", ".join(f"{c.name} (prefix caching {'on' if c.uses_prefix_caching else 'off'}, {c.weights}, "
                      f"{c.batching.policy}, {c.num_threads or 'default'} thread(s))" for c in configs)
    typer.echo(f"a batch job of {lines} lines (one system prompt, a question each, {max_new_tokens} new tokens) per "
               f"config and round, {rounds} round(s); {sides}; {os.cpu_count()} CPUs")
    typer.echo(format_prefix_table(jobs, [c.name for c in configs]))
    changed = changed_factors(configs[0].model_dump(mode="json"), configs[1].model_dump(mode="json"))
    if changed != ["prefix caching"]:
        typer.echo(f"warning: the configs differ in {', '.join(changed) or 'nothing'} (change "
                   "kv_cache.prefix_caching alone to see what prefix caching does)")


def bench_chunked(
    config: ConfigOption = Path("configs/fp32-continuous.yaml"),
    max_prefill_tokens: Annotated[int | None, typer.Option(min=1, help="prompt tokens prefilled per step (the "
                                                           "config's batching.max_prefill_tokens by default)")] = None,
    rows: Annotated[int, typer.Option(min=1, help="rows decoding when the newcomer joins")] = 15,
    newcomer_tokens: Annotated[int, typer.Option(min=1, help="the newcomer's prompt tokens")] = 1_500,
    window: Annotated[int, typer.Option(min=2, help="decode steps measured with the rows alone")] = 32,
    rounds: Annotated[int, typer.Option(min=1, help="rounds; medians are printed")] = 3,
    threads: Annotated[int | None, typer.Option(min=1, max=256, help="torch threads (default: the config's)")] = None,
) -> None:
    """Chunked prefill in the engine: the running rows' p95 inter-token time while a long newcomer is prefilled,
    against the same rows alone, and the newcomer's TTFT; the per-step prompt budget is --max-prefill-tokens."""
    serving = load_config(config)
    if max_prefill_tokens is not None:
        serving = serving.model_copy(update={"batching": serving.batching.model_copy(
            update={"max_prefill_tokens": max_prefill_tokens})})

    from servelab.lab.chunked_bench import ChunkedBenchError, ChunkedShape, format_chunked_table, run_chunked_bench

    shape = ChunkedShape(num_rows=rows, newcomer_tokens=newcomer_tokens, window_steps=window)
    budget, limits = serving.batching.max_prefill_tokens, serving.decoding
    if rows + 1 > serving.batching.max_batch_size:
        fail(f"--rows {rows}: the rows and the newcomer need {rows + 1} rows; the config's batching.max_batch_size "
             f"is {serving.batching.max_batch_size}")
    if shape.rows_max_new_tokens(budget) > limits.max_new_tokens:
        fail(f"the rows must make up to {shape.rows_max_new_tokens(budget)} tokens (warm-up, --window {window}, one per "
             f"prefill step of {budget} tokens), above the config's decoding.max_new_tokens ({limits.max_new_tokens}): "
             "lower --window or --newcomer-tokens, or raise --max-prefill-tokens")
    if newcomer_tokens + 1 > limits.max_context_tokens:
        fail(f"--newcomer-tokens {newcomer_tokens}: the config's decoding.max_context_tokens is "
             f"{limits.max_context_tokens}")
    engine = load_engines([serving], threads)[0]
    try:
        result = run_chunked_bench(engine, shape, num_rounds=rounds, progress=progress)
    except ChunkedBenchError as exc:
        fail(str(exc))

    import torch

    typer.echo(f"config {serving.name} ({serving.weights}, {engine.kernel}), max_prefill_tokens {budget}, prefix "
               f"caching {'on' if serving.uses_prefix_caching else 'off'}, threads {torch.get_num_threads()}; {rows} "
               f"rows decoding, a {newcomer_tokens}-token newcomer joins; {rounds} round(s)")
    typer.echo(format_chunked_table(result))


KV_DTYPES = ("auto", "fp32", "bf16", "fp16", "int8")


def bench_kv_dtype(
    config: ConfigOption = Path("configs/fp32-continuous.yaml"),
    dtypes: Annotated[str, typer.Option(help="comma-separated kv_cache_dtype values, the first the reference")]
    = "fp32,bf16,int8",
    batch_sizes: Annotated[str, typer.Option(help="comma-separated decode batch sizes")] = "16,64",
    context: Annotated[int, typer.Option(min=16, help="tokens each row holds when the timed steps start")] = 1_488,
    steps: Annotated[int, typer.Option(min=3, help="decode steps per measurement (the first 2 are warm-up)")] = 16,
    prompts: Annotated[int, typer.Option(min=0, help="chat prompts for greedy agreement (0: none)")] = 32,
    new_tokens: Annotated[int, typer.Option(min=1, help="tokens per greedy completion (EOS ignored)")] = 64,
    rounds: Annotated[int, typer.Option(min=1, help="rounds, the precisions' order alternating; medians")] = 2,
    threads: ThreadsOption = None,
) -> None:
    """KV cache precisions on one config, side by side: bytes per retained token measured from the pool's tensors
    and the process's resident memory, decode tok/s with every row holding --context tokens (one real prompt's keys
    and values, copied into each row's own blocks), and greedy tokens identical to the first precision's."""
    serving = load_config(config)
    names = [d.strip() for d in dtypes.split(",") if d.strip()]
    bad = [d for d in names if d not in KV_DTYPES]
    if len(names) < 2 or bad or len(set(names)) != len(names):
        fail(f"--dtypes {dtypes!r}: give two or more distinct values of {', '.join(KV_DTYPES)}")
    sizes = parse_ints(batch_sizes, "--batch-sizes")
    if context + steps > serving.decoding.max_context_tokens:
        fail(f"--context {context} + --steps {steps}: above the config's decoding.max_context_tokens "
             f"({serving.decoding.max_context_tokens})")
    if new_tokens > serving.decoding.max_new_tokens:
        fail(f"--new-tokens {new_tokens}: above the config's decoding.max_new_tokens ({serving.decoding.max_new_tokens})")

    import torch

    from servelab.analysis.workload import builtin_prompts
    from servelab.lab.kv_bench import KVBenchError, format_kv_dtype_table, run_kv_dtype_bench

    engines = load_engines([serving.model_copy(update={"kv_cache_dtype": d, "name": f"{serving.name}-kv-{d}"})
                            for d in names], threads)
    text_ids = engines[0].tokenizer.encode(" ".join(builtin_prompts("library") + builtin_prompts("chat")))
    context_ids = (text_ids * -(-context // len(text_ids)))[:context]  # the prompt sets' text, repeated as needed
    chat = builtin_prompts("chat")[:prompts]
    try:
        results = run_kv_dtype_bench(dict(zip(names, engines)), context_ids=context_ids, batch_sizes=sizes,
                                     num_steps=steps, prompts=chat, new_tokens=new_tokens, num_rounds=rounds,
                                     progress=progress)
    except KVBenchError as exc:
        fail(str(exc))
    typer.echo(f"config {serving.name} ({serving.weights}, {engines[0].kernel}), threads {torch.get_num_threads()}, "
               f"block_size {serving.kv_cache.block_size}; decode: rows x {context} tokens held, {steps - 2} timed "
               f"steps, {rounds} round(s), medians; agreement: {len(chat)} chat prompts x {new_tokens} greedy tokens "
               f"against {names[0]}'s; bytes per token column of the {max(sizes)}-row pool")
    typer.echo(format_kv_dtype_table(results, sizes))
