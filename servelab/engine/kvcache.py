"""The KV cache of a batch, in the config's cache precision, behind one interface for the engine.

A batch is served in two kinds of cache. A prefill fills a group of newcomers' cache in one forward
(`StaticKVCache` for servelab's decoder, `TransformersKVCache` for transformers'); the group then joins
the running batch's cache (`TransformersBatchCache`: transformers' dynamic cache, left-padded to a shared
width), which rows leave between decode steps. servelab's decoder serves its running batch from
`PagedKVCache` instead: a pool of fixed-size blocks each row reads through its block table (blocks.py keeps
the tables and the prefix cache), written in place by every forward, prefill chunks and decode steps alike. Both can store keys and values
in a dtype narrower than the compute dtype (e.g. a bf16 cache under fp32 weights), so cache precision can
be compared on its own; attention reads them back in the compute dtype. servelab's caches also hold int8 keys and
values: each kv head's D values of a token quantised symmetrically with one fp32 scale (`quantize_heads`), in the
paged pool as int8 tensors beside (blocks, H_kv, block_size) scales that the fused decode kernel reads as they are;
torch paths (prefill chunks, other devices) dequantise the columns they read. Does not know requests.
Past 400 lines as one piece: every cache here stores, quantises and lays out its tensors as the decoder's kernels read
them, behind the one interface the engine calls.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer


CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
SCALE_DTYPE = torch.float32  # an int8 cache's scale per token and kv head


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> int8 (..., D) and fp32 scales (...): per vector, scale = max |x| / 127 and x (127 / max |x|)
    rounded half to even, so x ~ q x scale (an all-zero vector: scale 0). The same bits as blocked.cpp's
    quantize_head, which quantises what a decode step writes."""
    x = x.float()
    top = x.abs().amax(dim=-1)
    # NOTE: a tensor over a tensor: torch turns `127.0 / top` into 127 x (1 / top), which rounds differently
    inv = torch.where(top > 0, torch.full_like(top, 127.0) / top, torch.zeros_like(top))
    q = torch.round(x * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, top / 127.0


def dequantize_heads(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 (..., D) and scales (...) -> fp32 (..., D)."""
    return q.float() * scales.unsqueeze(-1)


def kv_block_bytes(*, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """A paged block's keys and values over every layer, in bytes: int8 adds its fp32 scale per token and kv head."""
    per_head = head_dim * dtype.itemsize + (SCALE_DTYPE.itemsize if dtype == torch.int8 else 0)
    return 2 * num_layers * num_kv_heads * block_size * per_head


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


def cache_bytes_per_element(kv_cache_dtype: str, compute_dtype: torch.dtype, head_dim: int | None = None) -> float:
    """Bytes per cached key or value element; int8 counts its scale (4 bytes per head_dim elements)."""
    if kv_cache_dtype == "int8":
        if head_dim is None:
            raise ValueError("an int8 cache's bytes per element depend on head_dim (one fp32 scale per head_dim values)")
        return 1 + SCALE_DTYPE.itemsize / head_dim
    return torch.finfo(CACHE_DTYPES.get(kv_cache_dtype, compute_dtype)).bits // 8


class KVCache(Protocol):
    """A prefill's cache: a group of left-padded rows, filled by one forward, then joined to a BatchKVCache."""

    @property
    def allocated_bytes(self) -> int: ...


class StaticKVCache:
    """(B, H_kv, capacity, D) keys and values per layer, columns [0, end) hold tokens: a prefill's cache.
    quantized: keys and values pass through int8 (quantised per token and kv head, then dequantised, held in dtype),
    so a prefill attends to what an int8 paged cache would hold (a prefill's logits for the quality lab)."""

    def __init__(self, *, num_layers: int, batch_size: int, num_kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, quantized: bool = False) -> None:
        self.quantized = quantized
        shape = (batch_size, num_kv_heads, capacity, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.end = 0

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write T new columns (B, H_kv, T, D) after the held ones; -> every held column plus these, as
        views in the storage dtype."""
        stop = self.end + keys.shape[2]
        if stop > self.keys[layer].shape[2]:
            raise RuntimeError(f"KV cache capacity {self.keys[layer].shape[2]} exceeded ({stop} columns)")
        if self.quantized:
            keys, values = dequantize_heads(*quantize_heads(keys)), dequantize_heads(*quantize_heads(values))
        self.keys[layer][:, :, self.end:stop] = keys
        self.values[layer][:, :, self.end:stop] = values
        # NOTE: views in the storage dtype; attention reads them in the compute dtype (decoder.py)
        return self.keys[layer][:, :, :stop], self.values[layer][:, :, :stop]

    def advance(self, num_columns: int) -> None:
        """After every layer has appended: the new columns are held."""
        self.end += num_columns

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class TransformersKVCache:
    """transformers' cache object, for its forward, with the engine's interface."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache

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


class BatchKVCache(Protocol):
    """The running batch's cache: rows join (prefilled elsewhere) and leave between decode steps."""

    @property
    def num_rows(self) -> int: ...

    @property
    def num_tokens(self) -> int:
        """Token columns held over all rows (padding included where the layout holds it)."""
        ...

    @property
    def allocated_bytes(self) -> int: ...

    def next_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For one new token per row: (attention mask (B, S) over the held columns and the new one,
        positions (B, 1) of the new tokens)."""
        ...

    def join(self, prefilled: KVCache, attention_mask: torch.Tensor, *, num_columns: int, max_rows: int) -> None:
        """Append the rows of a prefilled cache (left-padded, attention_mask (b, T)) after the held ones;
        num_columns: the most columns any row will hold, newcomers included; max_rows: the most rows
        the batch may reach (how far room may grow ahead)."""
        ...

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (ascending indices); the others' space is free at once."""
        ...


def padded_tables(tables: list[list[int]], width: int, pad: int) -> torch.Tensor:
    """(rows, width) int32 on the host: each row's blocks, then `pad` up to the width. Filled through numpy: a list
    of lists through torch.tensor took 1.25 ms at 64 rows of 128 columns (a step's block tables on CUDA, where they
    are as wide as the longest row may be; Zen 3 EPYC), this 0.15 ms."""
    host = np.full((len(tables), width), pad, dtype=np.int32)
    for b, table in enumerate(tables):
        host[b, :len(table)] = table
    return torch.from_numpy(host)


class PagedKVCache:
    """servelab's running batch: the pool's keys and values, per layer (blocks, H_kv, block_size, D) (layout 'HND', what
    servelab's fused CPU kernels read) or (blocks, block_size, H_kv, D) ('NHD', token-major: one sequence of slots, each
    holding every kv head's key, what FlexAttention reads in place), in the cache precision; which block holds which
    row's columns is the scheduler's pool's books (scheduler/blocks.py), handed in as each plan's block tables. An int8
    pool also holds key_scales and value_scales per layer (blocks, H_kv, block_size) fp32 (`quantize_heads`); a float
    pool's are empty lists.

    The tensors reach as far into the pool as the highest block handed out, grown by half again (copied) when
    a block past them is taken: memory follows what the rows hold, up to the pool's size (on a GPU, sized from its free
    memory, and token-major, for kernels compiled for the pool's size, the whole pool is allocated at the first reach).
    A block is written before it is read (a row reads only its own columns).
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, num_blocks: int, block_size: int, layout: str = "HND") -> None:
        assert layout in ("HND", "NHD"), layout
        assert layout == "HND" or dtype != torch.int8, "an int8 pool is laid out for servelab's fused kernels (HND)"
        self.layout = layout
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.num_blocks, self._block_size = num_blocks, block_size  # the pool's size: how far the tensors may grow
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.key_scales: list[torch.Tensor] = []  # int8 only
        self.value_scales: list[torch.Tensor] = []
        self._allocated: int | None = None  # allocated_bytes, until reach() grows the tensors

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.int8

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's key and value scales (int8), or (None, None)."""
        return (self.key_scales[layer], self.value_scales[layer]) if self.quantized else (None, None)

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def scratch_block(self) -> int:
        """A token-major pool's block past the pool's own, which no table names: a padded row of a decode step
        (graphs.py) writes its key there and reads only it."""
        assert self.layout == "NHD", "only a token-major pool has a scratch block"
        return self.num_blocks

    @property
    def num_allocated_blocks(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def allocated_bytes(self) -> int:
        """The pool tensors' bytes, summed once after each reach() that grows them (a step reads this; summing 60-120
        tensors took about 0.08 ms of every step under cProfile, int4 batch 1, AVX2 EPYC)."""
        if self._allocated is None:
            self._allocated = sum(t.numel() * t.element_size()
                                  for t in (*self.keys, *self.values, *self.key_scales, *self.value_scales))
        return self._allocated

    @property
    def block_bytes(self) -> int:
        return kv_block_bytes(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                              block_size=self.block_size, dtype=self.dtype)

    def reach(self, tables: list[list[int]], *, expected: int = 0) -> None:
        """The tensors hold every block these tables name (grown, the held blocks copied, when one is past them);
        expected: blocks the running rows will reach by their end, so a batch that grows is copied once, at
        admission, not in the middle of its decode steps."""
        needed = max(max((max(t) for t in tables if t), default=-1) + 1, min(expected, self.num_blocks))
        have = self.num_allocated_blocks
        if needed <= have:
            return
        blocks = min(self.num_blocks, max(needed, have + have // 2))
        if self.device.type == "cuda" or self.layout == "NHD":
            # NOTE: a GPU's pool is sized to its free memory (memory.pool_blocks): growing by copying would need the old
            # and the new tensors at once, past what is free, so the whole pool is allocated at its first reach
            blocks = self.num_blocks + (self.layout == "NHD")  # and a token-major pool's scratch block
        shape = ((blocks, self.num_kv_heads, self.block_size, self.head_dim) if self.layout == "HND"
                 else (blocks, self.block_size, self.num_kv_heads, self.head_dim))
        # NOTE: zeros, not empty: no column is read before it is written, but a dump or a comparison of the pool
        # then never meets stale bits or NaN
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        for old, new in zip((*self.keys, *self.values), (*keys, *values)):
            new[:have] = old
        self.keys, self.values, self._allocated = keys, values, None
        if self.quantized:
            scales = [torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=self.device) for _ in range(2 * self.num_layers)]
            for old, new in zip((*self.key_scales, *self.value_scales), scales):
                new[:have] = old
            self.key_scales, self.value_scales = scales[:self.num_layers], scales[self.num_layers:]

    def table_tensor(self, tables: list[list[int]]) -> torch.Tensor:
        """(rows, the most blocks a row holds) int32 on the device, short rows padded with block 0 (never read)."""
        return padded_tables(tables, max((len(t) for t in tables), default=1) or 1, 0).to(self.device)

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """keys, values (T, H_kv, D) into the columns at (blocks, offsets) (T,) each (int8: quantised per token and
        kv head)."""
        at = self._at(blocks, offsets)
        if self.quantized:
            (k, ks), (v, vs) = quantize_heads(keys), quantize_heads(values)
            self.keys[layer][at], self.key_scales[layer][at] = k, ks
            self.values[layer][at], self.value_scales[layer][at] = v, vs
            return
        self.keys[layer][at] = keys.to(self.dtype)
        self.values[layer][at] = values.to(self.dtype)

    def _at(self, blocks: torch.Tensor, offsets: torch.Tensor) -> tuple:
        """The index of the columns at (blocks, offsets) in a layer's tensors: their (..., S, H_kv, D) entries."""
        return (blocks, offsets) if self.layout == "NHD" else (blocks, slice(None), offsets)

    def read(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The columns at (blocks, offsets) (..., S) -> keys, values (..., H_kv, S, D) in the storage dtype (int8:
        dequantised to fp32, these columns only)."""
        at = self._at(blocks, offsets)
        k, v = self.keys[layer][at], self.values[layer][at]  # (..., S, H_kv, D)
        if self.quantized:
            k, v = dequantize_heads(k, self.key_scales[layer][at]), dequantize_heads(v, self.value_scales[layer][at])
        return k.transpose(-2, -3), v.transpose(-2, -3)

    def read_blocks(self, layer: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows' whole blocks, table (B, nb) -> keys, values (B, H_kv, nb x block_size, D) in the storage dtype: a
        gather of whole blocks (contiguous copies), then one transpose copy; columns past a row's end are masked
        by the caller."""
        B, nb = table.shape
        if self.layout == "NHD":  # (B, nb, block_size, H_kv, D): a slot's heads are together, one transpose copy
            k = self.keys[layer][table].reshape(B, nb * self.block_size, self.num_kv_heads, self.head_dim)
            v = self.values[layer][table].reshape(B, nb * self.block_size, self.num_kv_heads, self.head_dim)
            return k.transpose(1, 2), v.transpose(1, 2)
        k, v = self.keys[layer][table], self.values[layer][table]  # (B, nb, H_kv, block_size, D)
        if self.quantized:  # NOTE: the torch path (no fused kernel): these rows' blocks dequantised, for this layer
            k = dequantize_heads(k, self.key_scales[layer][table])
            v = dequantize_heads(v, self.value_scales[layer][table])
        k = k.transpose(1, 2).reshape(B, self.num_kv_heads, nb * self.block_size, self.head_dim)
        v = v.transpose(1, 2).reshape(B, self.num_kv_heads, nb * self.block_size, self.head_dim)
        return k, v


class TransformersBatchCache:
    """transformers' running batch: its dynamic cache with rows left-padded to a shared width, the padding
    mask and each row's position. A newcomer group is left-padded (or pads the held rows) to the wider of the
    two and concatenated; leading columns no row uses are trimmed when rows leave."""

    def __init__(self) -> None:
        self.cache: TransformersKVCache | None = None
        self.attention_mask: torch.Tensor | None = None  # (B, S) 1/0
        self.positions: torch.Tensor | None = None  # (B,) position of each row's last held token

    @property
    def num_rows(self) -> int:
        return 0 if self.attention_mask is None else self.attention_mask.shape[0]

    @property
    def num_tokens(self) -> int:
        return 0 if self.attention_mask is None else self.attention_mask.numel()

    @property
    def allocated_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.allocated_bytes

    def next_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: transformers' forward appends the new column itself; the mask and positions follow it here.
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones((self.num_rows, 1))], dim=-1)
        self.positions = self.positions + 1
        return self.attention_mask, self.positions.view(-1, 1)

    def join(self, prefilled: KVCache, attention_mask: torch.Tensor, *, num_columns: int, max_rows: int) -> None:
        assert isinstance(prefilled, TransformersKVCache)
        positions = attention_mask.sum(dim=1) - 1
        if self.cache is None:
            self.cache, self.attention_mask, self.positions = prefilled, attention_mask, positions
            return
        width = max(self.attention_mask.shape[1], attention_mask.shape[1])
        held_layers, new_layers = self.cache.cache.layers, prefilled.cache.layers
        for held, new in zip(held_layers, new_layers):
            for name in ("keys", "values"):
                joined = torch.cat([_pad_left(getattr(held, name), width), _pad_left(getattr(new, name), width)])
                setattr(held, name, joined)
        self.attention_mask = torch.cat([_pad_left(self.attention_mask, width, dim=1),
                                         _pad_left(attention_mask, width, dim=1)])
        self.positions = torch.cat([self.positions, positions])

    def keep(self, rows: list[int]) -> None:
        if not rows:
            self.cache = self.attention_mask = self.positions = None
            return
        keep = torch.tensor(rows, dtype=torch.long, device=self.attention_mask.device)
        self.cache.select_rows(keep)
        self.attention_mask, self.positions = self.attention_mask[keep], self.positions[keep]
        num_pad_columns = int(self.attention_mask.any(dim=0).int().argmax())  # leading columns no row uses
        if num_pad_columns:
            self.attention_mask = self.attention_mask[:, num_pad_columns:]
            self.cache.drop_leading_columns(num_pad_columns)


def _pad_left(t: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """Zeros before the columns of t along dim, up to width."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
