"""Runners: each executes a scheduler's plan on one model, one forward per step, and samples. `PagedRunner` serves
servelab's decoder from a paged pool (the plan's block tables, chunked prefill, window eviction); the transformers
forward is the second runner (dense_runner.py), behind the same call; a CUDA runner slots in the same way.

A runner keeps per-request decoding state by id (decoding.py) and the figures of a stretch of steps (`take_stats`);
it holds no waiting or running sets and decides nothing: which rows run, how many tokens each computes, which
blocks they use and who leaves are the plan's (servelab.scheduler). Does not know queues or databases.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field

import torch

from servelab.engine import flex_chunks, measure
from servelab.engine.decoder import PagedBatch
from servelab.engine.decoding import Decodings
from servelab.engine.graphs import DecodeGraphs
from servelab.engine.kvcache import PagedKVCache
from servelab.memory import MemoryBreakdown, ModelShape
from servelab.outputs import BatchTimings, Completion, StepOutput
from servelab.scheduler.blocks import BlockManager
from servelab.scheduler.scheduler import SchedulerOutput
from servelab.scheduler.state import ScheduledRequest

log = logging.getLogger(__name__)


@dataclass
class StepMeter:
    """What a stretch of steps did, from the first step after `take_stats` to the next call."""

    peak: measure.PeakMemory
    started_at_s: float = field(default_factory=time.time)
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    num_rows_per_step: list[int] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preempted: int = 0
    peak_cache_tokens: int = 0
    peak_cache_allocated_bytes: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    kv_blocks_shared: int = 0
    kv_blocks_private: int = 0

    def plan(self, plan: SchedulerOutput) -> None:
        """A plan's own figures: its preemptions and its first admissions' prefix-cache look-ups."""
        self.num_preempted += len(plan.preempted)
        self.num_prefix_query_tokens += plan.num_prefix_query_tokens
        self.num_prefix_hit_tokens += plan.num_prefix_hit_tokens

    def step(self, elapsed_ms: float, *, num_sampled: int, num_prefill_tokens: int, num_decode_tokens: int) -> None:
        # NOTE: a mixed step's time is shared by its tokens: the prompt tokens' part is prefill, the decode rows' decode
        prefill_share = num_prefill_tokens / max(num_prefill_tokens + num_decode_tokens, 1)
        self.prefill_ms += elapsed_ms * prefill_share
        self.decode_ms += elapsed_ms * (1 - prefill_share)
        self.num_rows_per_step.append(num_sampled)
        self.num_prefill_tokens += num_prefill_tokens
        self.num_decode_tokens += num_decode_tokens

    def cache(self, num_tokens: int, allocated_bytes: int, *, num_shared_blocks: int = 0, block_size: int = 0) -> None:
        """After a forward, before rows leave: the cache at its fullest so far (a shared block counted once)."""
        if num_tokens > self.peak_cache_tokens:
            self.peak_cache_tokens = num_tokens
            if block_size:
                self.kv_blocks_shared = num_shared_blocks
                self.kv_blocks_private = num_tokens // block_size - num_shared_blocks
        self.peak_cache_allocated_bytes = max(self.peak_cache_allocated_bytes, allocated_bytes)


class Runner:
    """What every runner shares: the decoding state by id, the meter, cancelling and the figures."""

    block_size = 0  # tokens per block of a paged cache; 0: not paged

    def __init__(self, decoder, decodings: Decodings, *, shape: ModelShape, kv_bytes_per_element: float,
                 weight_bytes: int, device: torch.device) -> None:
        self.decoder, self.decodings, self.shape, self.device = decoder, decodings, shape, device
        self.kv_bytes_per_element, self.weight_bytes = kv_bytes_per_element, weight_bytes
        self._meter: StepMeter | None = None

    def execute(self, plan: SchedulerOutput) -> StepOutput:
        raise NotImplementedError

    def prepare(self, pool: BlockManager | None, max_rows: int) -> None:
        """Before a scheduler of this pool serves up to max_rows rows at once: whatever is built once (nothing here)."""

    def cancel(self, rows: list[ScheduledRequest]) -> list[Completion]:
        """Rows that leave for good before they finish (their client left): their completions, `cancelled`."""
        return self.decodings.cancel(rows)

    def drop(self, request_ids: list[str]) -> None:
        """Forget rows that left without a completion from this runner (a claim lost, a stopping worker's)."""
        self.decodings.close(request_ids)

    def meter(self) -> StepMeter:
        if self._meter is None:
            self._meter = StepMeter(peak=measure.PeakMemory(self.device).__enter__())
        return self._meter

    def take_stats(self) -> tuple[BatchTimings, MemoryBreakdown]:
        """The timings and memory of the steps since the last call; the next step starts a new stretch."""
        meter, self._meter = self.meter(), None
        meter.peak.__exit__(None, None, None)
        timings = BatchTimings(
            prefill_ms=meter.prefill_ms, decode_ms=meter.decode_ms, num_rows_per_step=tuple(meter.num_rows_per_step),
            num_prefill_tokens=meter.num_prefill_tokens, num_decode_tokens=meter.num_decode_tokens,
            num_preempted=meter.num_preempted, started_at_s=meter.started_at_s, finished_at_s=time.time(),
            num_prefix_query_tokens=meter.num_prefix_query_tokens, num_prefix_hit_tokens=meter.num_prefix_hit_tokens)
        memory = MemoryBreakdown(
            weight_bytes=self.weight_bytes,
            kv_cache_bytes=self.shape.kv_cache_bytes(meter.peak_cache_tokens, self.kv_bytes_per_element),
            kv_cache_allocated_bytes=meter.peak_cache_allocated_bytes, peak_working_bytes=meter.peak.working_bytes,
            peak_process_bytes=meter.peak.peak_bytes, device=str(self.device), kv_cache_tokens=meter.peak_cache_tokens,
            kv_block_size=self.block_size, kv_blocks_shared=meter.kv_blocks_shared,
            kv_blocks_private=meter.kv_blocks_private)
        return timings, memory


class PagedRunner(Runner):
    """servelab's decoder over a paged pool: one forward per step holds the decode rows (one token each) and the
    prompt chunks, reading and writing the blocks the plan's tables name. graph_rows: a step of only decode rows, up
    to this many, read through FlexAttention, runs from buffers of a padded size (graphs.py), replayed from a CUDA graph
    on CUDA; 0: never."""

    def __init__(self, decoder, decodings: Decodings, *, block_size: int, num_blocks: int, graph_rows: int = 0,
                 **figures) -> None:
        super().__init__(decoder, decodings, **figures)
        self.block_size, self.num_blocks, self.graph_rows = block_size, num_blocks, graph_rows
        self._graphs: weakref.WeakKeyDictionary[BlockManager, DecodeGraphs] = weakref.WeakKeyDictionary()
        self.prepared: tuple[list[int], float] | None = None  # the sizes prepare built, and its seconds
        # NOTE: one set of pool tensors per scheduler's pool (a worker's, or the engine's own for add / step), so two
        # schedulers driving this runner in turn never read each other's blocks as their cached prefixes
        self._caches: weakref.WeakKeyDictionary[BlockManager, PagedKVCache] = weakref.WeakKeyDictionary()

    def cache(self, pool: BlockManager) -> PagedKVCache:
        """The KV tensors of this pool's blocks."""
        assert pool.block_size == self.block_size, f"a pool of {pool.block_size}-token blocks on a runner of {self.block_size}"
        if pool not in self._caches:
            self._caches[pool] = self.decoder.new_paged_cache(num_blocks=pool.num_blocks, block_size=pool.block_size)
        return self._caches[pool]

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepOutput:
        meter = self.meter()
        meter.plan(plan)
        if not plan.rows:
            return StepOutput((), ())
        started, started_at_s = time.perf_counter(), time.time()
        self.decodings.open(plan.rows, admitted=plan.admitted, started=started, started_at_s=started_at_s)
        cache = self.cache(plan.pool)
        cache.reach([r.block_table for r in plan.rows], expected=plan.num_expected_blocks)
        if (graphs := self._graphs_for(plan, cache)) is not None:
            sampled, bs = list(plan.decode), self.block_size
            logits = graphs.run([r.token_ids[r.num_computed_tokens] for r in sampled],
                                [r.num_computed_tokens for r in sampled],
                                [r.num_computed_tokens - r.num_evicted_blocks * bs for r in sampled],
                                [r.block_table for r in sampled])
        else:
            batch, sampled = self._batch(plan, cache)
            logits = self.decoder.forward_paged(batch, cache)
        meter.cache(plan.num_used_blocks * self.block_size, cache.allocated_bytes,
                    num_shared_blocks=plan.num_shared_blocks, block_size=self.block_size)
        out = self.decodings.sample(logits, sampled) if sampled else StepOutput((), ())
        meter.step((time.perf_counter() - started) * 1e3, num_sampled=len(sampled),
                   num_prefill_tokens=sum(n for _, n in plan.chunks), num_decode_tokens=len(plan.decode))
        return out

    @torch.inference_mode()
    def prepare(self, pool: BlockManager | None, max_rows: int) -> None:
        """Before a scheduler of this pool serves: capture the decode steps of up to max_rows rows that will replay
        from CUDA graphs (each padded size's FlexAttention compiled then, not in the middle of serving); a no-op where
        no step replays a graph (the CPU, torch's attention)."""
        if pool is None or not self._replays():
            return
        started = time.perf_counter()
        sizes = self._graphs_of(pool, self.cache(pool)).prepare(max_rows)
        chunks = self._compile_chunks(pool)
        self.prepared = (sizes, time.perf_counter() - started)
        log.info("decode steps of %s rows%s prepared in %.1f s", ", ".join(map(str, sizes)),
                 f" and prompt chunks of {', '.join(map(str, chunks))} tokens" if chunks else "", self.prepared[1])

    def _compile_chunks(self, pool: BlockManager) -> list[int]:
        """Where prompt chunks read the pool in place: each padded chunk size up to the pool's chunk budget compiled
        now, by an attention call that reads only the scratch block (its output dropped) -> the sizes."""
        if self.decoder.chunk_attention != "flex" or not pool.chunk_tokens:
            return []
        cache, chunks = self.cache(pool), self.decoder.chunks(self.block_size)
        queries = torch.zeros((1, self.decoder.num_heads, self.decoder.head_dim), dtype=self.decoder.dtype,
                              device=self.device)
        # NOTE: no chunk is longer than a row may be (the blocks the mask lists), whatever the chunk budget
        longest = min(pool.chunk_tokens, chunks.width(cache.num_allocated_blocks) * self.block_size)
        top = flex_chunks.padded_tokens(longest)
        sizes = [flex_chunks.MIN_TOKENS << k for k in range((top // flex_chunks.MIN_TOKENS).bit_length())]
        for size in sizes:
            tokens = min(size, longest)  # NOTE: the padded size's kernel, for as many tokens as a chunk may have
            table = torch.full((-(-tokens // self.block_size),), cache.scratch_block, dtype=torch.int32,
                               device=self.device)
            step = chunks.prepare(table, 0, tokens, cache.num_allocated_blocks)
            chunks.attend(step, queries.expand(tokens, -1, -1), cache.keys[0], cache.values[0])
        return sizes

    def graphs_summary(self) -> str:
        """Which padded decode steps ran from CUDA graphs, and which could not be captured (and why)."""
        if not self.graph_rows:
            return "no CUDA graphs (off, or not CUDA with FlexAttention)"
        captured = sorted({rows for g in self._graphs.values() for rows in g.captured})
        failed = {rows: why for g in self._graphs.values() for rows, why in g.failed.items()}
        text = (f"decode steps replayed from CUDA graphs at {', '.join(map(str, captured))} rows" if captured
                else "no CUDA graph captured yet")
        if self.prepared is not None and captured:
            text += f" ({', '.join(map(str, self.prepared[0]))} captured before serving, in {self.prepared[1]:.1f} s)"
        return text + "".join(f"; {rows} rows eager: {why}" for rows, why in sorted(failed.items()))

    def _graphs_for(self, plan: SchedulerOutput, cache: PagedKVCache) -> DecodeGraphs | None:
        """The padded steps of this pool, where this plan is one: only decode rows, few enough, FlexAttention serving
        every layer; else None (an eager forward)."""
        if plan.chunks or not self._replays():
            return None
        graphs = self._graphs_of(plan.pool, cache)
        return graphs if graphs.fits(len(plan.decode), [r.block_table for r in plan.decode]) else None

    def _replays(self) -> bool:
        """Whether decode-only steps run from padded buffers (graphs on, FlexAttention serving every layer)."""
        return bool(self.graph_rows) and self.decoder.paged_attention == "flex" and self.decoder.fuses_every_layer

    def _graphs_of(self, pool: BlockManager, cache: PagedKVCache) -> DecodeGraphs:
        if pool not in self._graphs:
            self._graphs[pool] = DecodeGraphs(self.decoder, cache, max_rows=self.graph_rows,
                                              capture=self.device.type == "cuda")
        return self._graphs[pool]

    def _batch(self, plan: SchedulerOutput, cache: PagedKVCache) -> tuple[PagedBatch, list[ScheduledRequest]]:
        """The plan as one forward's inputs: the decode rows' last tokens, then each chunk's tokens -> the batch and
        the rows whose next token its logits give (in logit order)."""
        ids, positions, chunk_spans, logit_rows, sampled = [], [], [], [], []
        for i, r in enumerate(plan.decode):
            ids.append(r.token_ids[r.num_computed_tokens])
            positions.append(r.num_computed_tokens)
            logit_rows.append(i)
            sampled.append(r)
        for r, n in plan.chunks:
            first, start = len(ids), r.num_computed_tokens
            ids += r.token_ids[start:start + n]
            positions += range(start, start + n)
            chunk_spans.append((first, start, n))
            if n == r.num_pending_tokens:  # its prompt completes: its last token's logits give its next token
                logit_rows.append(len(ids) - 1)
                sampled.append(r)
        window = plan.pool.window
        # NOTE: a decode row's new key goes to the column after those it keeps (its evicted blocks' columns left out)
        lengths = [r.num_computed_tokens - r.num_evicted_blocks * self.block_size for r in plan.decode]
        tensor = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        batch = PagedBatch(tensor(ids), tensor(positions), cache.table_tensor([r.block_table for r in plan.rows]),
                           len(plan.decode), tuple(chunk_spans), tensor(logit_rows),
                           lengths=tensor(lengths) if window else None, window=window,
                           chunk_evicted=tuple(r.num_evicted_blocks for r, _ in plan.chunks))
        return batch, sampled
