"""Prompt chunks' attention reading the paged pool in place: PyTorch's FlexAttention over the token-major pool
(blocks, block_size, H_kv, D) that FlexDecode reads, one chunk row per call, its block table handed to the kernel as
the block mask's index lists. A chunk's tokens see their row's columns up to their own (its cached prefix, earlier
chunks, itself, causal); nothing is gathered.

The pool is one sequence of slots to the kernel, and a slot's column in its row is not its place in the pool: the mask
maps a slot's block to the block's index in the row's table (a per-pool-block buffer, far past any column for blocks the
row does not hold), so a shared prefix block is read where it lies whichever rows list it. Chunks are padded to a few
sizes (powers of two, at least MIN_TOKENS) so that the kernel compiles once per size, and every tensor it reads is a
buffer of that size updated in place.

`choose` picks how chunks read the pool where decode rows read it through FlexAttention: in place, or torch's gather
of the row's columns (the decoder's own path), whichever a timed chunk at the model's shape finds faster on CUDA.
Rows with window eviction or a sliding window keep the gather (their visibility is not causal by column).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from servelab.engine.paged_attention import (FlexReader, PagedAttentionError, figures, measured, padded_size,
                                             time_decode)

log = logging.getLogger(__name__)

MIN_TOKENS = 16  # NOTE: the smallest padded chunk: a prompt's last few tokens share one compiled kernel
Q_BLOCK = 128  # NOTE: the block mask's tile of queries (a shorter chunk is one tile), as FlexDecode's
FAR = 1 << 40  # NOTE: a block the row does not hold maps past every column: no query sees it


def padded_tokens(num_tokens: int) -> int:
    """The query length a chunk of num_tokens is computed at: the next power of two, at least MIN_TOKENS."""
    return padded_size(num_tokens, MIN_TOKENS)


def kernel_options(device: torch.device, block_size: int, tokens: int) -> dict[str, int | bool]:
    """Tiles for CUDA's FlexAttention kernel, for a chunk padded to `tokens`: its tile of keys must divide the mask's
    block of keys (a pool block, 16 tokens by default, narrower than the kernel's default tile), and its tile of
    queries the mask's (Q_BLOCK). The main kernel always: the decoding kernel torch picks for fewer than 128 queries
    tiles queries times the heads of a group, which need not divide Q_BLOCK. A CPU's kernel picks its own."""
    if device.type != "cuda":
        return {}
    return {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": min(64, tokens), "BLOCK_N": min(block_size & -block_size, 64)}


@dataclass
class _Buffers:
    """What the kernel reads for one padded chunk, updated in place each step (the block mask holds them)."""

    query: torch.Tensor  # (1, H, tokens, D) the chunk's rotated queries, padded tokens zero
    start: torch.Tensor  # (1,) int64 the chunk's first column
    column_of: torch.Tensor  # (pool blocks,) int64 each block's first column in the row, FAR where the row lacks it
    count: torch.Tensor  # (1, 1, query tiles) int32 the blocks each tile of queries reads
    blocks: torch.Tensor  # (1, 1, query tiles, width) int32 the row's block table
    mask: object  # torch.nn.attention.flex_attention.BlockMask over the buffers above


@dataclass(frozen=True)
class ChunkStep:
    """One chunk's attention, prepared once for every layer: its tokens and the buffers of its padded size."""

    num_tokens: int
    buffers: _Buffers


class FlexChunks(FlexReader):
    """Prompt chunks' attention over a token-major pool, one kernel call per chunk per layer."""

    def prepare(self, table: torch.Tensor, start: int, num_tokens: int, num_pool_blocks: int,
                slot: int = 0) -> ChunkStep:
        """table (blocks,) int32: the row's blocks (padded past the ones it holds); start: the chunk's first column;
        slot: the chunk's place among the step's chunks of this padded size (each has its own buffers) -> the step
        every layer's call reads."""
        tokens, bs = padded_tokens(num_tokens), self.block_size
        buffers = self._buffers_for(tokens, num_pool_blocks, slot)
        held = (start + num_tokens - 1) // bs + 1  # the blocks the chunk's last token reads
        width = buffers.blocks.shape[-1]
        if held > width or held > table.shape[0]:
            raise PagedAttentionError(f"a chunk reads {held} blocks, past the {min(width, table.shape[0])} its block "
                                      "table or FlexAttention's block mask holds")
        row = table[:held]
        buffers.column_of.fill_(FAR)
        buffers.column_of[row.long()] = torch.arange(held, device=self.device) * bs
        buffers.start.fill_(start)
        buffers.blocks[0, 0, :, :held] = row
        # NOTE: each tile of queries reads the blocks up to its last real token's (a tile of padding only: up to the
        # chunk's last token's, its output dropped)
        last = (torch.arange(1, buffers.count.shape[-1] + 1, device=self.device) * Q_BLOCK).clamp(max=num_tokens) - 1
        buffers.count[0, 0] = ((start + last) // bs + 1).clamp(min=1).to(torch.int32)
        return ChunkStep(num_tokens, buffers)

    def attend(self, step: ChunkStep, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """queries (T, H, D) rotated; keys / values: one layer's pool (blocks, block_size, H_kv, D), the chunk's keys
        already written -> (T, H x D)."""
        T, H, D = step.num_tokens, self.num_heads, self.head_dim
        buffers = step.buffers
        buffers.query[0, :, :T] = queries.transpose(0, 1)
        k = keys.view(-1, self.num_kv_heads, D).transpose(0, 1).unsqueeze(0)  # (1, H_kv, slots, D): a view
        v = values.view(-1, self.num_kv_heads, D).transpose(0, 1).unsqueeze(0)
        # NOTE: as FlexDecode.attend: eager flex_attention would read the mask function alone, a wrong result
        options = kernel_options(self.device, self.block_size, buffers.query.shape[2]) or None
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            out = self._flex(buffers.query, k, v, block_mask=buffers.mask, scale=self.scale,
                             enable_gqa=H != self.num_kv_heads, kernel_options=options)
        return out[0, :, :T].transpose(0, 1).reshape(T, H * D)

    def _buffers_for(self, tokens: int, num_pool_blocks: int, slot: int) -> _Buffers:
        key = (tokens, num_pool_blocks, slot)
        if key not in self._buffers:
            from torch.nn.attention.flex_attention import BlockMask

            width = self.width(num_pool_blocks)
            tiles = -(-tokens // Q_BLOCK)
            ints = dict(dtype=torch.int32, device=self.device)
            start = torch.zeros(1, dtype=torch.long, device=self.device)
            column_of = torch.full((num_pool_blocks,), FAR, dtype=torch.long, device=self.device)
            bs = self.block_size

            def causal_in_row(b, h, q_idx, kv_idx):  # a slot's column in the row, up to the query's own
                return column_of[kv_idx // bs] + kv_idx % bs <= start[0] + q_idx

            count, blocks = torch.ones((1, 1, tiles), **ints), torch.zeros((1, 1, tiles, width), **ints)
            # NOTE: every listed block goes through the mask; a CPU's kernel is given an empty list of full blocks (its
            # templates read that list unconditionally, as FlexDecode's note says)
            full = ((torch.zeros((1, 1, tiles), **ints), torch.zeros((1, 1, tiles, width), **ints))
                    if self.device.type == "cpu" else (None, None))
            mask = BlockMask.from_kv_blocks(count, blocks, *full, BLOCK_SIZE=(Q_BLOCK, bs), mask_mod=causal_in_row,
                                            seq_lengths=(tokens, num_pool_blocks * bs), compute_q_blocks=False)
            query = torch.zeros((1, self.num_heads, tokens, self.head_dim), dtype=self.dtype, device=self.device)
            self._buffers[key] = _Buffers(query, start, column_of, count, blocks, mask)
        return self._buffers[key]


def measure_chunk_choices(*, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, block_size: int,
                          dtype: torch.dtype, device: torch.device, torch_attention: Callable[..., torch.Tensor],
                          tokens: int = 256, cached: int = 768) -> dict[str, float]:
    """Seconds of one chunk's attention, `tokens` queries after `cached` columns its row holds, per way to read the
    pool: FlexAttention in place ('flex') and ('torch') the decoder's path: the row's columns gathered
    (PagedKVCache.read), then torch_attention(q (1, H, T, D), keys (1, H_kv, S, D), values, visible (1, 1, T, S)
    bool)."""
    from servelab.engine.kvcache import PagedKVCache

    columns = cached + tokens
    num_blocks = -(-columns // block_size) + 1
    generator = torch.Generator(device="cpu").manual_seed(0)
    pool = PagedKVCache(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device,
                        num_blocks=num_blocks, block_size=block_size, layout="NHD")
    pool.reach([[num_blocks - 1]])
    for name in ("keys", "values"):
        random = torch.randn((pool.num_allocated_blocks, block_size, num_kv_heads, head_dim), generator=generator)
        getattr(pool, name)[0][:] = random.to(device, dtype)
    table = (torch.randperm(num_blocks - 1, generator=generator) + 1).to(device=device, dtype=torch.int32)
    queries = torch.randn((tokens, num_heads, head_dim), generator=generator).to(device, dtype)
    chunks = FlexChunks(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale,
                        block_size=block_size, dtype=dtype, device=device, max_positions=columns)
    every = torch.arange(columns, device=device)
    blocks, offsets = table.long()[every // block_size], every % block_size
    visible = every[None, :] <= torch.arange(cached, columns, device=device)[:, None]

    def by_flex():
        step = chunks.prepare(table, cached, tokens, pool.num_allocated_blocks)
        return chunks.attend(step, queries, pool.keys[0], pool.values[0])

    def by_torch():
        keys, values = pool.read(0, blocks, offsets)  # (H_kv, S, D)
        return torch_attention(queries.transpose(0, 1)[None], keys[None], values[None], visible[None, None])

    with torch.inference_mode():
        return {"flex": time_decode(by_flex, device), "torch": time_decode(by_torch, device)}


def choose(decode: str, *, device: torch.device, asked: bool,
           measure: Callable[[], dict[str, float]]) -> tuple[str, str]:
    """How prompt chunks read the pool, and why: (name, reason); 'flex' in place, else the decode path's own ('servelab'
    fused, or 'torch' gathers). In place only where decode rows read the token-major pool through FlexAttention; on
    CUDA timed at load (asked for: refused by name where it cannot compile; auto: the faster, torch where flex
    fails)."""
    if decode != "flex":
        return decode, "as the decode rows"
    if device.type != "cuda":
        return "flex", "as the decode rows"
    seconds, error = measured(measure)
    if seconds is None:
        if asked:
            raise PagedAttentionError(f"paged_attention 'flex' cannot serve here: prompt chunks' FlexAttention could "
                                      f"not be compiled or run: {error}")
        return "torch", f"FlexAttention could not be compiled or run for prompt chunks: {error}"
    timings = figures(seconds, "one layer's 256-token chunk")
    name = "flex" if asked else min(seconds, key=seconds.get)
    log.info("prompt chunks on %s: %s (%s)", device, name, timings)
    return name, f"{'asked' if asked else 'measured at load'}, {timings}"
