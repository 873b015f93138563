"""KV cache precisions side by side (`bench kv-dtype`): what a retained token costs, how fast a decode step runs at
long contexts, and how often greedy decoding keeps the full-precision cache's tokens.

One engine per cache precision (the same config otherwise). Bytes per retained token are measured, not computed:
the paged pool's tensor storage (keys, values and an int8 cache's scales) and the process's resident memory grown
by creating and filling it, each over the token columns it holds. Decode speed: each row's context is one real
prompt prefilled once per engine and copied into every row's own blocks (no block shared, so every row's step reads
its own bytes), then timed decode steps of the whole batch through the decoder's paged forward. Agreement: greedy
completions of chat prompts (EOS ignored), position by position against the first precision's.
Does not know the CLI: servelab/cli/cache_bench.py prints these.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from statistics import median
from typing import Callable

import torch

from servelab.engine.decoder import LlamaDecoder, PagedBatch
from servelab.engine.engine import Engine
from servelab.request import ChatMessage, GenerationRequest, SamplingParams
from servelab.resident import return_freed_memory, status_bytes


class KVBenchError(ValueError):
    """A bench that cannot run as asked (an engine without servelab's paged cache)."""


@dataclass
class KVDtypeResult:
    name: str  # the cache precision as the config names it
    storage_bytes_per_token: float = 0.0  # the pool's tensors over its token columns
    resident_bytes_per_token: float = 0.0  # resident memory grown by the filled pool, over its token columns
    tok_s: dict[int, list[float]] = field(default_factory=dict)  # batch size -> decode tok/s per round
    identical_tokens: float | None = None  # share of generated positions equal to the first precision's
    before_divergence: float | None = None  # share of generated tokens before a row's first differing one
    identical_rows: float | None = None  # share of completions equal whole


@torch.inference_mode()
def _prefilled_row(engine: Engine, prompt_ids: list[int], span: int) -> tuple[list[torch.Tensor], int]:
    """One row of `span` blocks prefilled with prompt_ids (a single chunk) -> its blocks' tensors per pool list (keys,
    values, then an int8 cache's scales) and the token its logits pick."""
    decoder: LlamaDecoder = engine.decoder
    bs = engine.runner.block_size
    cache = decoder.new_paged_cache(num_blocks=span, block_size=bs)
    n = len(prompt_ids)
    table = list(range(-(-n // bs)))  # NOTE: one row alone: its blocks are the pool's first
    cache.reach([table], expected=span)
    batch = PagedBatch(torch.tensor(prompt_ids), torch.arange(n), cache.table_tensor([table]), 0,
                       ((0, 0, n),), torch.tensor([n - 1]))
    token = int(decoder.forward_paged(batch, cache).argmax(-1))
    return [t.clone() for t in (*cache.keys, *cache.values, *cache.key_scales, *cache.value_scales)], token


@torch.inference_mode()
def time_decode(engine: Engine, source: list[torch.Tensor], first_token: int, *, num_rows: int, context: int,
                num_steps: int, warmup: int = 2) -> tuple[float, float, float]:
    """num_rows rows holding `context` columns each (source copied into every row's blocks), then num_steps decode
    steps -> (decode tok/s over the steps after warm-up, pool storage bytes and resident bytes grown per column)."""
    decoder: LlamaDecoder = engine.decoder
    bs = engine.runner.block_size
    span = -(-(context + num_steps) // bs)  # every column the steps will write is in a row's blocks from the start
    gc.collect()
    return_freed_memory()
    before = status_bytes("VmRSS")
    cache = decoder.new_paged_cache(num_blocks=num_rows * span, block_size=bs)
    tables = [list(range(r * span, (r + 1) * span)) for r in range(num_rows)]  # each row's own blocks, in turn
    cache.reach(tables, expected=num_rows * span)
    index = torch.tensor(tables, dtype=torch.long)  # (rows, span)
    for pool, held in zip((*cache.keys, *cache.values, *cache.key_scales, *cache.value_scales), source):
        pool[index.view(-1)] = held.repeat(num_rows, *([1] * (held.dim() - 1)))
    columns = num_rows * span * bs
    resident = (status_bytes("VmRSS") - before) / columns
    storage = cache.allocated_bytes / columns
    table = cache.table_tensor(tables)
    tokens = torch.full((num_rows,), first_token, dtype=torch.long)
    start = 0.0
    for step in range(num_steps):
        if step == warmup:
            start = time.perf_counter()
        positions = torch.full((num_rows,), context + step, dtype=torch.long)
        logits = decoder.forward_paged(PagedBatch(tokens, positions, table, num_rows, (), torch.arange(num_rows)), cache)
        tokens = logits.argmax(-1)
    elapsed = time.perf_counter() - start
    del cache
    return num_rows * (num_steps - warmup) / elapsed, storage, resident


def agreement(reference: list[tuple[int, ...]], other: list[tuple[int, ...]]) -> tuple[float, float, float]:
    """Greedy completions against the reference's -> (share of positions equal, share of tokens before each row's
    first difference, share of rows equal whole)."""
    total = sum(len(r) for r in reference)
    equal = sum(a == b for r, o in zip(reference, other) for a, b in zip(r, o))
    prefix = sum(next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), min(len(r), len(o)))
                 for r, o in zip(reference, other))
    return equal / total, prefix / total, sum(r == o for r, o in zip(reference, other)) / len(reference)


def run_kv_dtype_bench(engines: dict[str, Engine], *, context_ids: list[int], batch_sizes: list[int],
                       num_steps: int, prompts: list[str], new_tokens: int, num_rounds: int,
                       progress: Callable[[str], None] = lambda _: None) -> list[KVDtypeResult]:
    """engines: cache precision -> engine, the first the reference for agreement."""
    for name, engine in engines.items():
        if not isinstance(engine.decoder, LlamaDecoder) or not engine.runner.block_size:
            raise KVBenchError(f"kv_cache_dtype {name}: the bench needs servelab's decoder and its paged cache "
                               f"({engine.decoder.name} decoder serves this model)")
    results = {name: KVDtypeResult(name) for name in engines}
    context = len(context_ids)
    span = -(-(context + num_steps) // next(iter(engines.values())).runner.block_size)
    prefilled = {}
    for name, engine in engines.items():
        progress(f"{name}: prefilling a {context}-token context")
        prefilled[name] = _prefilled_row(engine, context_ids, span)
    order = list(engines)
    for round_ in range(num_rounds):
        for name in (order if round_ % 2 == 0 else order[::-1]):  # NOTE: alternated, so drift hits both ends
            for rows in batch_sizes:
                progress(f"round {round_ + 1}: {name}, {rows} rows x {context} tokens")
                tok_s, storage, resident = time_decode(engines[name], *prefilled[name], num_rows=rows, context=context,
                                                       num_steps=num_steps)
                result = results[name]
                result.tok_s.setdefault(rows, []).append(tok_s)
                if rows == max(batch_sizes):
                    result.storage_bytes_per_token, result.resident_bytes_per_token = storage, resident
    del prefilled
    if prompts:
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        requests = [GenerationRequest(f"p{i}", messages=(ChatMessage("user", p),), params=params)
                    for i, p in enumerate(prompts)]
        completions = {}
        for name, engine in engines.items():
            progress(f"{name}: greedy completions of {len(prompts)} prompts x {new_tokens} tokens")
            completions[name] = [c.token_ids for c in engine.generate(requests).completions]
        reference = completions[order[0]]
        for name in order:
            result = results[name]
            result.identical_tokens, result.before_divergence, result.identical_rows = agreement(reference,
                                                                                                 completions[name])
    return [results[name] for name in order]


def format_kv_dtype_table(results: list[KVDtypeResult], batch_sizes: list[int]) -> str:
    base = results[0]
    head = ["cache", "B/token (tensors)", "B/token (RSS)", "x first"]
    head += [f"tok/s @{b}" for b in batch_sizes] + [f"x first @{b}" for b in batch_sizes]
    head += ["same tokens", "before 1st diff", "same rows"]
    lines = [" | ".join(head)]
    for r in results:
        speeds = [median(r.tok_s[b]) for b in batch_sizes]
        ratios = [median(r.tok_s[b]) / median(base.tok_s[b]) for b in batch_sizes]
        cells = [r.name, f"{r.storage_bytes_per_token:,.0f}", f"{r.resident_bytes_per_token:,.0f}",
                 f"{r.storage_bytes_per_token / base.storage_bytes_per_token:.3f}"]
        cells += [f"{s:.1f}" for s in speeds] + [f"x{x:.2f}" for x in ratios]
        cells += ["-" if r.identical_tokens is None else f"{100 * r.identical_tokens:.1f} %",
                  "-" if r.before_divergence is None else f"{100 * r.before_divergence:.1f} %",
                  "-" if r.identical_rows is None else f"{100 * r.identical_rows:.1f} %"]
        lines.append(" | ".join(cells))
    return "\n".join(lines)
