"""Memory arithmetic: KV-cache bytes from the model shape, and the breakdown reported with a batch.

Pure: imports no torch, so the batcher (which budgets KV tokens) and the dashboard can use it.
Does not measure anything; servelab/engine/measure.py reads real tensors and the process.
"""

from __future__ import annotations

from dataclasses import dataclass

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
