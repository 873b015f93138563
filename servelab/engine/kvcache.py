"""The KV cache of a batch: transformers' dynamic cache, in the config's cache precision.

Knows one thing beyond transformers: a layer that stores keys and values in a dtype other than the
model's compute dtype (e.g. a bf16 cache under fp32 weights), so cache precision can be compared on
its own. Attention reads the stored values back in the compute dtype. Does not know batches.
"""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer

CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class StoredDtypeLayer(DynamicLayer):
    """A dynamic layer whose keys and values (B, H_kv, T, D) are kept in `storage_dtype`."""

    def __init__(self, storage_dtype: torch.dtype) -> None:
        super().__init__()
        self.storage_dtype = storage_dtype
        self.compute_dtype = storage_dtype

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.compute_dtype = key_states.dtype
        self.keys = self.keys.to(self.storage_dtype)
        self.values = self.values.to(self.storage_dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states.to(self.storage_dtype)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(self.storage_dtype)], dim=-2)
        # NOTE: the new token too is read back from storage precision: the model sees what the cache holds.
        return self.keys.to(self.compute_dtype), self.values.to(self.compute_dtype)


def new_cache(model_config, num_layers: int, kv_cache_dtype: str, compute_dtype: torch.dtype) -> Cache:
    storage = CACHE_DTYPES.get(kv_cache_dtype, compute_dtype)
    if storage == compute_dtype:
        return DynamicCache(config=model_config)
    return Cache(layers=[StoredDtypeLayer(storage) for _ in range(num_layers)])


def cache_bytes_per_element(kv_cache_dtype: str, compute_dtype: torch.dtype) -> int:
    return torch.finfo(CACHE_DTYPES.get(kv_cache_dtype, compute_dtype)).bits // 8
