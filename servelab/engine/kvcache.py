"""The KV cache of a batch, in the config's cache precision, behind one interface for the engine.

`StaticKVCache` (servelab's decoder): every layer's keys and values in tensors allocated once for the
batch's capacity, written in place; rows leave by compaction, leading padding columns by moving a start
index. `TransformersKVCache`: transformers' dynamic cache, for its forward. Both can store keys and values
in a dtype narrower than the compute dtype (e.g. a bf16 cache under fp32 weights), so cache precision can
be compared on its own; attention reads them back in the compute dtype. Does not know requests.
"""

from __future__ import annotations

from typing import Protocol

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


class KVCache(Protocol):
    @property
    def num_columns(self) -> int:
        """Token columns held per row (padding included): the attention mask's width."""
        ...

    @property
    def allocated_bytes(self) -> int: ...

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep only these rows (indices), in this order."""
        ...

    def drop_leading_columns(self, num_columns: int) -> None: ...


class StaticKVCache:
    """(B, H_kv, capacity, D) keys and values per layer; columns [start, end) hold tokens."""

    def __init__(self, *, num_layers: int, batch_size: int, num_kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch_size, num_kv_heads, capacity, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.start = self.end = 0

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write T new columns (B, H_kv, T, D) after the held ones; -> every held column plus these, as
        views in the storage dtype."""
        stop = self.end + keys.shape[2]
        if stop > self.keys[layer].shape[2]:
            raise RuntimeError(f"KV cache capacity {self.keys[layer].shape[2]} exceeded ({stop} columns)")
        self.keys[layer][:, :, self.end:stop] = keys
        self.values[layer][:, :, self.end:stop] = values
        # NOTE: views in the storage dtype; attention reads them in the compute dtype (decoder.py)
        return self.keys[layer][:, :, self.start:stop], self.values[layer][:, :, self.start:stop]

    def advance(self, num_columns: int) -> None:
        """After every layer has appended: the new columns are held."""
        self.end += num_columns

    @property
    def num_columns(self) -> int:
        return self.end - self.start

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def select_rows(self, keep: torch.Tensor) -> None:
        # NOTE: a copy, so the memory of finished rows is returned; it happens once per retirement, not per token.
        self.keys = [t.index_select(0, keep) for t in self.keys]
        self.values = [t.index_select(0, keep) for t in self.values]

    def drop_leading_columns(self, num_columns: int) -> None:
        self.start += num_columns


class TransformersKVCache:
    """transformers' cache object, for its forward, with the engine's interface."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache

    @property
    def num_columns(self) -> int:
        return self.cache.get_seq_length()

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in cache_tensors(self.cache))

    def select_rows(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)

    def drop_leading_columns(self, num_columns: int) -> None:
        for layer in self.cache.layers:
            layer.keys = layer.keys[:, :, num_columns:, :]  # (B, H_kv, T, D)
            layer.values = layer.values[:, :, num_columns:, :]


def cache_tensors(cache: Cache) -> list[torch.Tensor]:
    tensors = []
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                tensors.append(t)
    return tensors
