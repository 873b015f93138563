"""Memory arithmetic: KV-cache bytes from the model shape, the breakdown reported with a batch, and the paged pool's
blocks (a config's, or what a device's free memory holds).

Pure: imports no torch, so the batcher (which budgets KV tokens) and the dashboard can use it.
Does not measure anything; servelab/engine/measure.py reads real tensors and the process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servelab.config import ServingConfig

BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "int4": 0.5}


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    def kv_bytes_per_token(self, bytes_per_element: float) -> float:
        """Keys and values of one retained token across all layers: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    def kv_cache_bytes(self, num_tokens: int, bytes_per_element: float) -> int:
        return int(self.kv_bytes_per_token(bytes_per_element) * num_tokens)


@dataclass(frozen=True)
class MemoryBreakdown:
    weight_bytes: int  # parameters and buffers, by real tensor storage, shared storage counted once
    kv_cache_bytes: int  # peak during the batch, from the model shape and the retained tokens
    kv_cache_allocated_bytes: int  # peak during the batch, summed over the cache tensors themselves
    peak_working_bytes: int  # peak above what was resident when the batch started (activations etc.)
    peak_process_bytes: int  # CUDA: peak allocated; CPU: the process's resident high-water mark
    device: str
    kv_cache_tokens: int = 0  # retained tokens at the KV peak (kv_cache_bytes = these x bytes per token)
    kv_block_size: int = 0  # tokens per block of the paged cache; 0: not paged (transformers' decoder)
    kv_blocks_shared: int = 0  # at the KV peak: blocks two or more rows read (counted once in kv_cache_bytes)
    kv_blocks_private: int = 0  # at the KV peak: blocks one row holds

    def as_dict(self) -> dict[str, int | str]:
        return dict(self.__dict__)


# What a GPU's pool leaves free: activations (a prefill chunk's MLP, the logits, attention's gathers), the allocator's
# fragments and other tensors of the process. NOTE: 10 % of the device, at least 2 GiB: a 512-token chunk of an 8B
# model's MLP in bf16 takes about 45 MiB, the logits of 256 rows 125 MiB; the rest is headroom for what is unmeasured
DEVICE_RESERVE_FRACTION = 0.10
DEVICE_RESERVE_MIN_BYTES = 2 * 2**30


def device_reserve_bytes(total_bytes: int) -> int:
    """The bytes of a device's memory its KV pool leaves free."""
    return max(DEVICE_RESERVE_MIN_BYTES, int(total_bytes * DEVICE_RESERVE_FRACTION))


DEFAULT_GPU_MEMORY_SHARE = 0.9


def memory_pool_blocks(free_bytes: int, block_bytes: int, *, cap_bytes: int | None, reserve_bytes: int,
                       share_bytes: int | None = None) -> int:
    """The blocks of block_bytes that free_bytes holds once reserve_bytes are kept back, at most share_bytes (what is
    left of this process's share of the device) and cap_bytes' worth (max_kv_cache_mib); 0 where nothing is left
    (pool_blocks still keeps one lone request's)."""
    room = max(free_bytes - reserve_bytes, 0)
    if share_bytes is not None:
        room = max(min(room, share_bytes), 0)
    if cap_bytes is not None:
        room = min(room, cap_bytes)
    return room // block_bytes


def pool_blocks(config: ServingConfig, block_bytes: int, block_size: int, *,
                device_memory: tuple[int, int, int] | None = None,
                memory_share: float = DEFAULT_GPU_MEMORY_SHARE) -> int:
    """The paged cache's blocks: max_kv_cache_mib of them, else max_batch_tokens' worth; on a GPU (device_memory: its
    free and total bytes and this process's own, once the weights are on it) what its free memory holds less a
    reserve, within this process's share of the device (memory_share of its total, less what it holds already) and
    capped by max_kv_cache_mib (`memory_pool_blocks`); never fewer than one request of max_context_tokens needs (a lone
    request is always served).

    NOTE: processes that share one GPU (several gpu-workers, a plan's baseline and candidates at once) must split it
    with SERVELAB_GPU_MEMORY_SHARE: each sizes its pool from its share, so two starting at once cannot both take the
    free memory; the lab and `servelab up` do not set it for them yet."""
    batching = config.batching
    cap = batching.max_kv_cache_mib * 2**20 if batching.max_kv_cache_mib is not None else None
    if device_memory is not None:
        # NOTE: max_batch_tokens does not size a GPU's pool (its default, 16,384 tokens, is a CPU's figure): the memory
        # left after the weights does, as vLLM's gpu_memory_utilization does
        free, total, own = device_memory
        blocks = memory_pool_blocks(free, block_bytes, cap_bytes=cap, reserve_bytes=device_reserve_bytes(total),
                                    share_bytes=int(memory_share * total) - own)
    else:
        blocks = -(-batching.max_batch_tokens // block_size)
        if cap is not None:
            blocks = min(blocks, cap // block_bytes)
    lone = -(-config.decoding.max_context_tokens // block_size)
    if (window := kv_window(config)) is not None:  # a windowed row holds no more than its sinks, window and a chunk
        lone = min(lone, window[0] + window[1] + 2 + -(-batching.max_prefill_tokens // block_size))
    return max(blocks, lone)


def kv_window(config: ServingConfig) -> tuple[int, int] | None:
    """(sink blocks, window blocks) a row keeps under kv_cache.eviction: window; None: every block."""
    kv = config.kv_cache
    return (kv.sink_blocks, kv.window_blocks) if kv.eviction == "window" else None
