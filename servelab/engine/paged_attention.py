"""Decode attention that reads the paged pool in place: PyTorch's FlexAttention, compiled (Triton kernels on CUDA, C++
on a CPU), over a pool laid out token-major (blocks, block_size, H_kv, D), each decode row's block table handed to the
kernel as its block mask's index list. Nothing is gathered: the kernel visits a row's blocks where they lie.

A row's table is the mask's list of blocks to visit; the mask's one rule reads the row's last block up to the new key's
column and every other block whole (the kernel splits a row's blocks between its thread blocks: lists of "full" blocks
would have it split the whole pool instead, CUDA's flex-decoding template tiling full blocks over every key). Rows are
padded to a few sizes (powers of two, at least MIN_ROWS) so that the kernel is compiled once per size, and every tensor
the kernel reads is a buffer of that size, updated in place each step: no recompilation from one step to the next,
and a CUDA graph of the step can capture them as they are.

`choose` picks the decode attention where the config leaves it to the machine (`paged_attention: auto`): servelab's
fused kernels on a CPU where they fit, and on CUDA FlexAttention or torch's gather and attention, whichever a timed
decode step at the model's shape finds faster. Does not know the model's layers (the decoder does), nor rows or plans.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from servelab.engine.model_files import ModelLoadError

if TYPE_CHECKING:
    from servelab.config import ServingConfig

log = logging.getLogger(__name__)

MIN_ROWS = 4  # NOTE: the smallest padded batch: sizes 1-4 share one compiled kernel; 3 extra query rows cost nothing
# that shows beside a layer's weights


class PagedAttentionError(ModelLoadError):
    """A paged attention asked for that cannot serve this model, cache or device (a config that cannot be served here):
    the message says why."""


def flex_reason(*, cache_dtype: torch.dtype, dtype: torch.dtype, head_dim: int, block_size: int,
                device: torch.device, group: int = 1) -> str | None:
    """Why FlexAttention cannot read this pool, or None."""
    if cache_dtype == torch.int8:
        return ("FlexAttention reads keys and values as they are stored, and an int8 KV cache needs its scales applied "
                "first (torch's gather dequantises them: paged_attention torch)")
    if cache_dtype != dtype:
        return (f"FlexAttention takes queries and keys in one dtype: the cache holds {cache_dtype} and the model computes "
                f"in {dtype} (set kv_cache_dtype: auto)")
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"FlexAttention's kernels take a head size that is a power of two of at least 16 (this model's: {head_dim})"
    if device.type == "cuda" and group & (group - 1):
        # NOTE: torch's flex-decoding kernel takes a power-of-two group (_use_flex_decoding); its other kernel reads keys
        # in tiles of 64 or more, wider than a block of 16
        return (f"FlexAttention's decode kernel on CUDA takes a power-of-two number of query heads per kv head (this "
                f"model's: {group})")
    if device.type == "cuda" and block_size % 16:
        # NOTE: a block is the kernel's tile of keys, and a GPU's matrix instructions take at least 16 of them
        return f"FlexAttention's GPU kernels read keys in tiles of 16 or more: kv_cache.block_size is {block_size}"
    return None


def flex_pool_blocks(*, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """The most blocks (the scratch block included) a pool FlexAttention reads on CUDA may hold: Triton's flex kernels
    (torch 2.11-2.13) compute a key's offset in 32 bits (its block's index times the block's slots, times the slot's
    H_kv x D), so one layer's keys seen as one sequence stay under 2**31 elements."""
    return (2**31 - 1) // (block_size * num_kv_heads * head_dim)


def padded_size(n: int, at_least: int) -> int:
    """The size n is computed at where a kernel compiles once per size: the next power of two, at least at_least."""
    return max(at_least, 1 << max(n - 1, 0).bit_length())


def padded_rows(num_rows: int) -> int:
    """The batch a step of num_rows decode rows is computed at: the next power of two, at least MIN_ROWS."""
    return padded_size(num_rows, MIN_ROWS)


@dataclass
class _Buffers:
    """What the kernel reads for one padded batch, updated in place each step (the block mask holds them)."""

    query: torch.Tensor  # (rows, H, 1, D) the decode rows' rotated queries, padded rows zero
    fill: torch.Tensor  # (rows,) int64 the new key's offset in its block: the last block is read up to it
    last_block: torch.Tensor  # (rows,) int64 the block the new key goes to
    count: torch.Tensor  # (rows, 1, 1) int32 the blocks the row reads (its last included)
    blocks: torch.Tensor  # (rows, 1, 1, width) int32 the row's block table
    mask: object  # torch.nn.attention.flex_attention.BlockMask over the buffers above


@dataclass(frozen=True)
class FlexStep:
    """One step's decode rows, prepared once for every layer: where each new key goes (block, offset) (B,) each, and the
    buffers of its padded batch."""

    num_rows: int
    new_blocks: torch.Tensor
    new_offsets: torch.Tensor
    buffers: _Buffers


class FlexReader:
    """FlexAttention compiled for one model's heads over token-major pools (PagedKVCache layout 'NHD') of one block
    size, and the buffers of each padded size it has met. max_positions: the longest row (CUDA's mask index lists are
    as wide as its blocks)."""

    name = "flex"

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, block_size: int,
                 dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.block_size, self.dtype, self.device = scale, block_size, dtype, device
        self.max_blocks = -(-max_positions // block_size)
        # NOTE: one compiled kernel per padded size, pool size and model, decode's and chunks' together (dynamo counts
        # them per function, process-wide): the CPU dry run of check-gpu with flex compiles 11, the GPU check's two
        # shapes and int4 part a few dozen
        allow_recompiles(128)
        self._flex = torch.compile(flex_attention, dynamic=False)
        self._buffers: dict[tuple[int, ...], object] = {}

    def width(self, num_pool_blocks: int) -> int:
        """How many blocks the mask's index lists hold: a CPU's kernel wants them as wide as the pool, CUDA's only as
        wide as the longest table a row may have."""
        return num_pool_blocks if self.device.type == "cpu" else min(num_pool_blocks, self.max_blocks)


class FlexDecode(FlexReader):
    """The decode rows' attention of one step over a token-major pool, one kernel call per layer."""

    def prepare(self, lengths: torch.Tensor, table: torch.Tensor, num_pool_blocks: int) -> FlexStep:
        """lengths (B,) int64: the column each row's new key goes to (the columns it keeps before it); table (B, nb)
        int32: its blocks, padded with block 0 -> the step every layer's call reads."""
        B, nb = table.shape
        buffers = self._buffers_for(padded_rows(B), num_pool_blocks)
        if nb > buffers.blocks.shape[-1]:
            raise PagedAttentionError(f"a row holds {nb} blocks, past the {buffers.blocks.shape[-1]} FlexAttention's "
                                      "block mask was sized for")
        last = (lengths // self.block_size).view(B, 1)
        new_blocks = table.long().gather(1, last).view(B)
        new_offsets = lengths % self.block_size
        buffers.blocks[:B, 0, 0, :nb] = table
        buffers.count[:B, 0, 0] = last.view(B) + 1
        buffers.last_block[:B] = new_blocks
        buffers.fill[:B] = new_offsets
        # NOTE: padded rows read column 0 of block 0 (their output is dropped)
        buffers.count[B:], buffers.blocks[B:, 0, 0, 0], buffers.last_block[B:], buffers.fill[B:] = 1, 0, 0, 0
        return FlexStep(B, new_blocks, new_offsets, buffers)

    def attend(self, step: FlexStep, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """queries (B, H, D) rotated; keys / values: one layer's pool (blocks, block_size, H_kv, D), the rows' new keys
        already written -> (B, H x D)."""
        B, H, D = step.num_rows, self.num_heads, self.head_dim
        buffers = step.buffers
        buffers.query[:B, :, 0] = queries
        # NOTE: the pool seen as one sequence of slots, (1, H_kv, blocks x block_size, D): a view, strided by H_kv x D
        k = keys.view(-1, self.num_kv_heads, D).transpose(0, 1).unsqueeze(0)
        v = values.view(-1, self.num_kv_heads, D).transpose(0, 1).unsqueeze(0)
        # NOTE: past dynamo's recompile limit it would run flex_attention eagerly, which takes the mask function as the
        # whole truth (it ignores the block lists) while this one holds only the last block's rule: a wrong result.
        # So an error there, for this call only
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            out = self._flex(buffers.query, k, v, block_mask=buffers.mask, scale=self.scale,
                             enable_gqa=H != self.num_kv_heads)  # (rows, H, 1, D)
        return out[:B, :, 0].reshape(B, H * D)

    def _buffers_for(self, rows: int, num_pool_blocks: int) -> _Buffers:
        key = (rows, num_pool_blocks)
        if key not in self._buffers:
            from torch.nn.attention.flex_attention import BlockMask

            width = self.width(num_pool_blocks)
            ints = dict(dtype=torch.int32, device=self.device)
            fill = torch.zeros(rows, dtype=torch.long, device=self.device)
            last_block = torch.zeros(rows, dtype=torch.long, device=self.device)
            bs = self.block_size

            def row_mask(b, h, q_idx, kv_idx):  # in the blocks the row lists: all but the last whole, it up to the key
                return (kv_idx // bs != last_block[b]) | (kv_idx % bs <= fill[b])

            count, blocks = torch.ones((rows, 1, 1), **ints), torch.zeros((rows, 1, 1, width), **ints)
            # NOTE: every listed block goes through the mask (none is "full"); a CPU's kernel is given an empty list of
            # full blocks all the same: inductor's C++ decoding template (a pool of 512 slots a row or more) reads
            # that list unconditionally and does not compile without it
            full = ((torch.zeros((rows, 1, 1), **ints), torch.zeros((rows, 1, 1, width), **ints))
                    if self.device.type == "cpu" else (None, None))
            mask = BlockMask.from_kv_blocks(count, blocks, *full, BLOCK_SIZE=(128, bs), mask_mod=row_mask,
                                            seq_lengths=(1, num_pool_blocks * bs), compute_q_blocks=False)
            query = torch.zeros((rows, self.num_heads, 1, self.head_dim), dtype=self.dtype, device=self.device)
            self._buffers[key] = _Buffers(query, fill, last_block, count, blocks, mask)
        return self._buffers[key]


def allow_recompiles(limit: int) -> None:
    """Room for a compiled kernel per padded size and pool size (dynamo's limit is per function, process-wide)."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), limit))


def time_decode(attend: Callable[[], object], device: torch.device, *, repeats: int = 20) -> float:
    """Median seconds of one call, after two calls that compile and warm it (synchronised on CUDA)."""
    from servelab.hardware import sync

    for _ in range(2):
        attend()
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        attend()
        sync(device)
        times.append(time.perf_counter() - started)
    times.sort()
    return times[len(times) // 2]


def measure_decode_choices(*, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, block_size: int,
                           dtype: torch.dtype, device: torch.device, torch_attention: Callable[..., torch.Tensor],
                           num_rows: int = 32, columns: int = 1024) -> dict[str, float]:
    """Seconds of one decode attention call for num_rows rows of `columns` keys each, per way to read a pool: FlexAttention
    in place ('flex') from a token-major pool, and ('torch') the decoder's torch path: its pool's whole blocks gathered
    (PagedKVCache.read_blocks), then torch_attention(q (B, H, 1, D), keys, values, mask (B, S) bool), the decoder's own
    (LlamaDecoder._attend).
    The same random keys in both pools."""
    from servelab.engine.kvcache import PagedKVCache

    blocks_per_row = -(-columns // block_size)
    num_blocks = num_rows * blocks_per_row + 1
    generator = torch.Generator(device="cpu").manual_seed(0)
    pools = {layout: PagedKVCache(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                                  device=device, num_blocks=num_blocks, block_size=block_size, layout=layout)
             for layout in ("NHD", "HND")}
    for pool in pools.values():
        pool.reach([[num_blocks - 1]])
    for name in ("keys", "values"):
        random = torch.randn((num_blocks, block_size, num_kv_heads, head_dim), generator=generator).to(device, dtype)
        getattr(pools["NHD"], name)[0][:num_blocks] = random
        getattr(pools["HND"], name)[0][:] = random.transpose(1, 2)
    order = torch.randperm(num_blocks - 1, generator=generator)[:num_rows * blocks_per_row] + 1
    table = order.view(num_rows, blocks_per_row).to(device=device, dtype=torch.int32)
    lengths = torch.full((num_rows,), columns - 1, dtype=torch.long, device=device)
    queries = torch.randn((num_rows, num_heads, head_dim), generator=generator).to(device, dtype)
    flex = FlexDecode(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale,
                      block_size=block_size, dtype=dtype, device=device, max_positions=blocks_per_row * block_size)
    flat = pools["NHD"]
    mask = torch.arange(blocks_per_row * block_size, device=device)[None, :] <= lengths[:, None]

    def by_flex():
        step = flex.prepare(lengths, table, flat.num_allocated_blocks)
        return flex.attend(step, queries, flat.keys[0], flat.values[0])

    def by_torch():
        keys, values = pools["HND"].read_blocks(0, table.long())
        return torch_attention(queries[:, :, None], keys, values, mask)

    with torch.inference_mode():  # NOTE: as a serving step calls it (grad mode compiles another kernel)
        return {"flex": time_decode(by_flex, device), "torch": time_decode(by_torch, device)}


def choose(option: str, *, fused_fits: bool, device: torch.device, flex_why_not: str | None,
           measure: Callable[[], dict[str, float]]) -> tuple[str, str]:
    """The decode attention the config's `paged_attention` asks, and why: (name, reason). 'servelab': the fused CPU
    kernels; 'flex'; 'torch'. Refused by name where the asked one cannot serve."""
    if option == "servelab":
        if not fused_fits:
            raise PagedAttentionError("paged_attention 'servelab' cannot serve here: servelab's fused attention runs on "
                                      f"a CPU, in fp32 or bf16, for head sizes a multiple of 16 (device {device})")
        return "servelab", "asked"
    if option == "flex":
        if flex_why_not is not None:
            raise PagedAttentionError(f"paged_attention 'flex' cannot serve here: {flex_why_not}")
        if device.type == "cuda":  # NOTE: compiled and timed at load, so a kernel that cannot compile is refused here
            seconds, error = measured(measure)
            if seconds is None:
                raise PagedAttentionError("paged_attention 'flex' cannot serve here: FlexAttention could not be "
                                          f"compiled or run: {error}")
            return "flex", f"asked; {figures(seconds)}"
        return "flex", "asked"
    if option == "torch":
        return "torch", "asked"
    if fused_fits:
        return "servelab", "servelab's fused kernels serve this CPU"
    if device.type != "cuda":
        return "torch", f"no fused kernel for this model or dtype on {device}; FlexAttention is measured on CUDA only"
    if flex_why_not is not None:
        return "torch", flex_why_not
    seconds, error = measured(measure)
    if seconds is None:  # NOTE: a compiler missing or failing (Triton, inductor): torch serves
        return "torch", f"FlexAttention could not be compiled or run here: {error}"
    name = min(seconds, key=seconds.get)
    log.info("paged attention on %s: %s (%s)", device, name, figures(seconds))
    return name, f"measured at load, {figures(seconds)}"


def measured(measure: Callable[[], dict[str, float]]) -> tuple[dict[str, float] | None, str]:
    """The measurement's seconds, or None and its error's first line (FlexAttention failing to compile, say)."""
    try:
        return measure(), ""
    except Exception as exc:  # noqa: BLE001 - Triton's and inductor's errors are of many kinds
        return None, first_line(exc)


def figures(seconds: dict[str, float], what: str = "one layer's decode attention") -> str:
    """A measurement's seconds per way, as the reasons and logs print them."""
    return f"{what}: " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in sorted(seconds.items()))


def config_reason(config: ServingConfig, device: torch.device) -> str | None:
    """Why the config's paged_attention cannot serve on this device whatever the model, or None (what depends on the
    model, a head size say, is refused when the decoder is built)."""
    if config.paged_attention == "auto":
        return None
    if config.decoder != "auto":
        return "it needs servelab's decoder (decoder: transformers)"
    if config.paged_attention == "servelab" and device.type != "cpu":
        return f"servelab's fused attention kernels are for CPUs (device {device})"
    if config.paged_attention == "flex" and config.kv_cache_dtype == "int8":
        return flex_reason(cache_dtype=torch.int8, dtype=torch.float32, head_dim=64, block_size=16, device=device)
    if config.paged_attention == "flex":
        return flex_reason(cache_dtype=torch.float32, dtype=torch.float32, head_dim=64,
                           block_size=config.kv_cache.block_size, device=device)
    return None


def first_line(exc: BaseException) -> str:
    """An exception's first line (its type's name where it has no message), at most 200 characters."""
    return ((str(exc).splitlines() or [""])[0] or type(exc).__name__)[:200]
