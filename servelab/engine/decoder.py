"""The model's forward pass for the engine: servelab's own decoder (Llama's block and its families), or transformers'.

Both map (token ids, padding mask, positions, KV cache) to the last position's logits; engine.py
drives them the same way and never sees which one runs. Past 400 lines as one piece: the block's operations, its
cache layouts and the kernel each operation dispatches to change together.

`LlamaDecoder` computes the Llama block exactly as transformers defines it (RMSNorm, rotary positions,
grouped-query attention, SwiGLU MLP), and the families that differ from it by a bias, a q/k norm, a fused
projection, a sliding window or Gemma's norms, soft caps and GeGLU (Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3:
families.py says how each differs and what is refused; layers with a window or a soft cap take torch's attention,
the fused kernels knowing neither), with fewer, larger operations: q/k/v and gate/up are one matmul
each, dense weights are laid out once for the matmul kernel that serves them (linear.py), keys and values are written in place into caches allocated
ahead (kvcache.py), and a decode step's attention is one grouped matmul per layer (SDPA's CPU kernel is 3-4x
slower for one query over a long cache; with the servelab kernels, one fused kernel). It keeps its own copy of the packed weights: transformers'
model stays as loaded, for the naive reference, `generate` comparisons and the quality lab.

`TransformersDecoder` runs transformers' forward with its dynamic cache: any architecture, and what
`LlamaDecoder` does not cover (other architectures and activations; see families.unsupported_reason).
Does not know requests, sampling or stop conditions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol

import torch
import torch.nn.functional as F

from servelab.engine.families import (attention_scale, attention_softcap, family_of, layer_windows, positions_reason,
                                      rope_positions, rotary_tables, unsupported_reason)
from servelab.engine.kvcache import (CACHE_DTYPES, BatchKVCache, KVCache, PagedKVCache, StaticKVCache,
                                     TransformersBatchCache, TransformersKVCache, kv_block_bytes, new_cache)
from servelab.engine.kernels import BlockedKernel, load_blocked_kernel
from servelab.engine import flex_chunks
from servelab.engine import paged_attention as paged
from servelab.engine.linear import (BlockedLinear, BlockedMatmulLinear, Int4Linear, Int8Linear, LinearKernel, LinearKernelError,
                                    RowDispatchLinear, ServelabInt4Linear, add_projection, choose_linear_kernel,
                                    int4_int_rows, int4_modules_reason, measured_shapes)

Projection = Callable[[torch.Tensor], torch.Tensor]


class Decoder(Protocol):
    name: str

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        """A prefill's cache for a group of left-padded rows."""
        ...

    def new_batch_cache(self) -> BatchKVCache:
        """An empty running batch, which prefilled groups join."""
        ...

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                cache: KVCache | BatchKVCache) -> torch.Tensor:
        """input_ids, position_ids (B, T); attention_mask (B, cached + T) -> logits (B, V) of the last position.
        A prefill's cache takes T tokens per row; a running batch's one."""
        ...

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
               keep: int) -> torch.Tensor:
        """A left-padded prefill with no cache kept -> logits (B, keep, V) of its last `keep` positions."""
        ...


def build_decoder(model, *, choice: str, kv_cache_dtype: str, dtype: torch.dtype, device: torch.device,
                  linear_kernel: str, cache_dir: Path, int4_kernel: str = "auto", lm_head_weights: str = "auto",
                  int4_activations: str = "int8", paged_attention: str = "auto", kv_block_size: int = 16,
                  max_context_tokens: int | None = None) -> Decoder:
    """choice 'auto': servelab's decoder where it covers the model, else transformers'; 'transformers': always it.
    int4_kernel (AWQ models): 'auto' servelab's int4 kernel where it runs, else the loaded layers' own (ATen's int4
    matmul, joined, or a gptqmodel kernel); 'servelab' only it (refused with the reason where it cannot run);
    anything else the loaded layers' own. int4_activations:
    servelab's int4 kernel at few rows on int8 activations (integer dot products) or 'float' ones (fp32 FMAs).
    lm_head_weights 'int8': the output layer in int8 through servelab's kernel (refused where it cannot run).
    paged_attention: how the paged pool is read (paged_attention.choose)."""
    if lm_head_weights != "auto" and (reason := lm_head_reason(model, choice, device, cache_dir)) is not None:
        raise LinearKernelError(f"lm_head_weights {lm_head_weights!r} cannot run here: {reason}")
    int4_layers = [m for m in model.modules() if isinstance(getattr(m, "qweight", None), torch.Tensor)]
    int4 = None
    if choice == "auto" and unsupported_reason(model) is None:
        if int4_layers:
            int4 = _int4_kernel(int4_layers, int4_kernel, device, cache_dir, int4_activations == "float", dtype=dtype)
        if int4 is None:
            _warm_up_int4(model, int4_layers, device)
        dense = [m.weight for m in model.modules() if type(m) is torch.nn.Linear]
        kernel = choose_linear_kernel(linear_kernel, device=device, dtype=dtype, cache_dir=cache_dir,
                                      shapes=measured_shapes(dense) or ((64, 64),))
        int8_head = load_blocked_kernel(cache_dir) if lm_head_weights == "int8" else None
        decoder = LlamaDecoder(model, kv_cache_dtype=kv_cache_dtype, dtype=dtype, device=device, kernel=kernel,
                               int4=int4, int8_head=int8_head, paged_attention=paged_attention,
                               kv_block_size=kv_block_size, max_context_tokens=max_context_tokens)
        _pack_servelab_layers(m for layer in decoder.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)
                              if isinstance(p, JoinedModules) for m in p.modules)
        return decoder
    if paged_attention != "auto":
        raise paged.PagedAttentionError(f"paged_attention {paged_attention!r} needs servelab's decoder, which does not "
                                        f"cover this model: {unsupported_reason(model) or 'decoder: transformers'}")
    if int4_kernel == "servelab":
        raise LinearKernelError("awq.kernel 'servelab' needs servelab's decoder, which does not cover this model: "
                                f"{unsupported_reason(model) or 'decoder: transformers'}")
    _warm_up_int4(model, int4_layers, device)
    _pack_servelab_layers(int4_layers)
    return TransformersDecoder(model, kv_cache_dtype=kv_cache_dtype, dtype=dtype)


@dataclass(frozen=True)
class Int4Kernel:
    """servelab's int4 kernel for AWQ layers: the build, and up to how many rows it takes integer dot products."""

    blocked: BlockedKernel
    int_rows: int
    float_activations: bool = False  # fp32 FMAs on weights dequantised in registers, not int8 dot products
    amx: bool = False  # many rows on AMX tiles (bf16 activations on an AMX CPU), not torch's fp32 GEMM

    @property
    def label(self) -> str:
        above = "AMX bf16 tiles" if self.amx else "fp32 tiles"
        tiles = "" if self.int_rows >= 1 << 20 else f" up to {self.int_rows} rows, {above} above"
        streamed = "fp32 activations" if self.float_activations else self.blocked.module.int8_dot()
        return f"int4 {self.blocked.label} ({streamed}{tiles})"


def _int4_kernel(layers: list[torch.nn.Module], choice: str, device: torch.device, cache_dir: Path,
                 float_activations: bool = False, *, dtype: torch.dtype) -> Int4Kernel | None:
    if choice not in ("auto", "servelab"):
        return None
    reason = (next((r for m in layers if (r := int4_modules_reason([m])) is not None), None) if device.type == "cpu"
              else f"servelab's int4 kernel is for CPUs (device {device})")
    blocked = None
    if reason is None:
        blocked = load_blocked_kernel(cache_dir)
        reason = blocked.reason if blocked.module is None else None
    if reason is not None:
        if choice == "servelab":
            raise LinearKernelError(f"awq.kernel 'servelab' cannot run here: {reason}")
        return None
    group = layers[0].in_features // layers[0].scales.shape[0]
    per_layer = {(m.out_features, m.in_features) for m in layers[:7]}  # one decoder layer's shapes
    int_rows = int4_int_rows(blocked, cache_dir, tuple(sorted(per_layer)), group, float_activations, dtype=dtype)
    amx = dtype == torch.bfloat16 and blocked.module.amx_rows() > 0
    return Int4Kernel(blocked, int_rows, float_activations, amx)


@torch.inference_mode()
def _warm_up_int4(model, layers: list[torch.nn.Module], device: torch.device) -> None:
    """gptqmodel's CPU int4 layers repack their weights for ATen on their first forward: done here, so that the
    one-off cost lands in the load and not in the first request's TTFT (and Int4Linear can join them). servelab's own
    layers pack without a forward (_pack_servelab_layers)."""
    from servelab.engine.awq.native import AwqAtenLinear

    if device.type == "cpu" and any(getattr(m, "linear_mode", "") is None and not isinstance(m, AwqAtenLinear)
                                    for m in layers):
        model(input_ids=torch.ones((1, 1), dtype=torch.long, device=device))


def _pack_servelab_layers(called: Iterable[torch.nn.Module]) -> None:
    """servelab's int4 layers that a decoder calls as they are (all of them under transformers' forward; under
    servelab's, those it did not join: a bias, say) packed for ATen now, not in the first request."""
    from servelab.engine.awq.native import AwqAtenLinear

    for m in called:
        if isinstance(m, AwqAtenLinear):
            m.pack()


def lm_head_reason(model, choice: str, device: torch.device, cache_dir: Path) -> str | None:
    """Why the output layer cannot be served in int8 here, or None."""
    if choice != "auto" or (reason := unsupported_reason(model)) is not None:
        return f"it needs servelab's decoder ({'decoder: transformers' if choice != 'auto' else reason})"
    if device.type != "cpu":
        return f"servelab's int8 kernel is for CPUs (device {device})"
    blocked = load_blocked_kernel(cache_dir)
    if blocked.module is None:
        return blocked.reason
    if type(model.lm_head) is not torch.nn.Linear or model.lm_head.bias is not None or model.lm_head.in_features % 4:
        return "the output layer is not a plain linear layer with a multiple of 4 inputs"
    return None


class TransformersDecoder:
    """transformers' own forward over its dynamic cache."""

    name = "transformers"

    def __init__(self, model, *, kv_cache_dtype: str, dtype: torch.dtype) -> None:
        if kv_cache_dtype == "int8":
            raise ValueError("kv_cache_dtype 'int8' needs servelab's decoder (its paged cache); transformers' decoder "
                             f"serves this model ({unsupported_reason(model) or 'decoder: transformers'}): set "
                             "kv_cache_dtype to auto, fp32, bf16 or fp16")
        self.model, self.kv_cache_dtype, self.dtype = model, kv_cache_dtype, dtype

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        config = self.model.config
        return TransformersKVCache(new_cache(config, config.num_hidden_layers, self.kv_cache_dtype, self.dtype))

    def new_batch_cache(self) -> BatchKVCache:
        return TransformersBatchCache()

    def forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        held = cache.cache if isinstance(cache, TransformersBatchCache) else cache
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=held.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    def logits(self, input_ids, attention_mask, position_ids, keep: int) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False, logits_to_keep=keep).logits


def projection(modules: list[torch.nn.Module], kernel: LinearKernel, int4: Int4Kernel | None = None) -> Projection:
    """One matmul for one projection, or for several of the same input (q/k/v, gate/up), outputs side by side."""
    if int4 is not None and int4_modules_reason(modules) is None:
        return ServelabInt4Linear(int4.blocked, modules, int4.int_rows, int4.float_activations)
    if all(type(m) is torch.nn.Linear for m in modules):
        weight = torch.cat([m.weight for m in modules]) if len(modules) > 1 else modules[0].weight  # (sum N_i, K)
        biases = [m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in modules]
        bias = torch.cat(biases) if any(m.bias is not None for m in modules) else None
        return kernel.make(weight, bias)
    if Int4Linear.covers(modules):
        return Int4Linear(modules)
    return JoinedModules(modules)


class JoinedModules:
    """Other quantised layers keep their own kernels; each runs, the outputs are joined."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.modules = modules

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.modules[0](x) if len(self.modules) == 1 else torch.cat([m(x) for m in self.modules], dim=-1)


def projection_tensors(p) -> list[torch.Tensor]:
    """The tensors a projection reads, whichever kernel serves it."""
    if isinstance(p, JoinedModules):
        return [t for m in p.modules for t in (*m.parameters(), *m.buffers())]
    if isinstance(p, RowDispatchLinear):
        return [t for linear in p.linears for t in projection_tensors(linear)]
    if isinstance(p, (ServelabInt4Linear, Int8Linear)):
        return p.tensors()
    if isinstance(p, Int4Linear):
        return [p.weight, p.scales_and_zeros]
    return [t for t in (p.weight, p.bias) if t is not None]


def _lossless_bf16_head(head: torch.nn.Linear, kernel: LinearKernel, dtype: torch.dtype) -> BlockedLinear | None:
    """An fp32 output layer whose values all are bf16 values (a checkpoint stored in bf16 and loaded as fp32,
    as AWQ checkpoints store it) is laid out in bf16 for servelab's kernel, fp32 activations and logits: the
    same products and sums, half the bytes a step reads."""
    weight = getattr(head, "weight", None)
    if (kernel.blocked is None or dtype != torch.float32 or type(head) is not torch.nn.Linear or head.bias is not None
            or weight.device.type != "cpu" or weight.shape[1] % 2 or not torch.equal(weight, weight.bfloat16().float())):
        return None
    return BlockedLinear(kernel.blocked, weight.detach().bfloat16(), None)


def _own(t: torch.Tensor) -> torch.Tensor:
    """A copy in the process's own memory: transformers' tensors may be views into the mapped checkpoint file,
    which stays mapped (and resident) while any one of them lives."""
    return t.detach().clone()


def _blocked_layout(p) -> BlockedLinear | Int8Linear | None:
    """The one blocked layout a projection serves every batch size from, if it has one."""
    if isinstance(p, Int8Linear):
        return p
    linears = p.linears if isinstance(p, RowDispatchLinear) else [p]
    layouts = {id(x.blocked if isinstance(x, BlockedMatmulLinear) else x): x.blocked if isinstance(x, BlockedMatmulLinear) else x
               for x in linears if isinstance(x, (BlockedLinear, BlockedMatmulLinear))}
    return next(iter(layouts.values())) if len(layouts) == 1 and all(
        isinstance(x, (BlockedLinear, BlockedMatmulLinear)) for x in linears) else None


def release_copied_weights(model: torch.nn.Module, decoder: Decoder) -> int:
    """Empty the model's tensors that servelab's decoder holds a copy of (its layouts, norms, the embedding), so
    a serving process keeps one copy (transformers' forward then needs a fresh load: Engine.model does that).
    -> bytes released. Layers the decoder reads in place (F.linear, ATen int4) are kept; int4 layers it joined on a
    GPU were freed as they were joined (Int4Linear) and are counted here."""
    if not isinstance(decoder, LlamaDecoder):
        return 0
    held = {t.untyped_storage().data_ptr() for t in decoder.tensors() if t.layout == torch.strided}
    released = sum(getattr(m, "freed_bytes", 0) for m in model.modules())  # NOTE: int4 layers freed when joined
    for module in model.modules():
        tensors = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
        if any(t.untyped_storage().data_ptr() in held for t in tensors.values()):
            continue
        for name, tensor in tensors.items():
            released += tensor.untyped_storage().nbytes()
            empty = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
            setattr(module, name, torch.nn.Parameter(empty, requires_grad=False)
                    if isinstance(tensor, torch.nn.Parameter) else empty)
    model.servelab_released = True  # NOTE: an Engine refuses to build on this model again
    return released


@dataclass(frozen=True)
class PagedBatch:
    """One forward over the paged cache. Tokens (N,): first `num_decode` decode rows (one token each, at column
    positions[b] of their row), then each prefill chunk's tokens; block_table (rows, blocks) int32 holds the decode
    rows' tables, then the chunks'. positions: each token's position, which is also its column.

    With a window (kv_cache.eviction: window): each row's table lists the blocks it keeps (its first window[0]
    blocks, then the blocks from the first one its token attends to); a decode row's new key goes to column
    lengths[b] of that table (its position less the evicted columns) and is rotated at its own position; a chunk's
    row dropped chunk_evicted[j] blocks after its sinks, and its tokens attend to the sinks and the window behind
    each one's block (keys keep the positions they were written at)."""

    input_ids: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64
    block_table: torch.Tensor  # (num_decode + len(chunks), blocks) int32
    num_decode: int
    chunks: tuple[tuple[int, int, int], ...]  # (first token's index in N, first column, tokens) per chunk row
    logit_rows: torch.Tensor  # (K,) indices into N of the tokens whose next-token logits are wanted
    lengths: torch.Tensor | None = None  # (num_decode,) int64 columns each decode row keeps; None: its position
    window: tuple[int, int] | None = None  # (sink blocks, window blocks) kept per row; None: every block
    chunk_evicted: tuple[int, ...] = ()  # per chunk: blocks its row dropped after its sinks

    @property
    def decode_lengths(self) -> torch.Tensor:
        """(num_decode,) the column each decode row's new key goes to (the columns it keeps before it)."""
        return self.lengths if self.lengths is not None else self.positions[:self.num_decode]

    def chunk_places(self, j: int, bs: int) -> tuple[torch.Tensor, ...]:
        """A chunk's (blocks, offsets) of its new columns and of every column its row keeps up to its last, and those
        columns' positions (with a window the evicted blocks' columns are left out)."""
        offset, start, num_tokens = self.chunks[j]
        table = self.block_table[self.num_decode + j].long()
        columns = torch.arange(start + num_tokens, device=table.device)
        index = columns // bs
        if self.window is not None and (evicted := self.chunk_evicted[j]):
            sink = self.window[0]
            columns = columns[(index < sink) | (index >= sink + evicted)]
            index = columns // bs
            index = torch.where(index < sink, index, index - evicted)
        blocks, offsets = table[index], columns % bs
        return blocks[-num_tokens:], offsets[-num_tokens:], blocks, offsets, columns

    def decode_places(self, bs: int) -> tuple[torch.Tensor, ...]:
        """The decode rows' new column (block, offset) (B,) each, their block tables cut to the longest row's blocks
        (B, nb), and the mask of their columns (B, nb x block_size)."""
        lengths = self.decode_lengths
        num_blocks = int(lengths.max()) // bs + 1
        table = self.block_table[:self.num_decode, :num_blocks].long()
        new_blocks = table.gather(1, (lengths // bs).view(-1, 1)).view(-1)
        mask = torch.arange(num_blocks * bs, device=table.device)[None, :] <= lengths[:, None]
        return new_blocks, lengths % bs, table, mask

    def decode_key_positions(self, bs: int, num_columns: int) -> torch.Tensor:
        """(num_decode, num_columns) the position each decode row's kept column was written at: its column, or past
        the sink blocks its column plus the columns window eviction dropped."""
        columns = torch.arange(num_columns, device=self.positions.device)[None, :]
        if self.lengths is None or self.window is None:
            return columns
        dropped = (self.positions[:self.num_decode] - self.lengths)[:, None]
        return torch.where(columns < self.window[0] * bs, columns, columns + dropped)


def _dense_stack_part(p, dtype: torch.dtype) -> tuple[BlockedLinear, int] | None:
    """A dense projection's servelab layout in the model's dtype, taking the residual, and the most rows servelab's
    kernel serves it at (`auto` may hand more rows to torch); None where another kernel serves its few rows."""
    linear, rows = (p.linears[0], p.max_rows[0]) if isinstance(p, RowDispatchLinear) else (p, 1 << 62)
    if isinstance(linear, BlockedLinear) and linear.takes_residual and linear.weight.dtype == dtype:
        return linear, rows
    return None


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    qkv: Projection
    o: Projection
    mlp_norm: torch.Tensor
    gate_up: Projection
    down: Projection
    q_norm: torch.Tensor | None = None  # (D,) Qwen3's / Gemma 3's per-head norms of queries and keys, before rotary
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # Gemma's norms on the attention and MLP outputs, before the residual
    post_mlp_norm: torch.Tensor | None = None
    rotary: str = ""  # the layer's rotary tables (families.rotary_tables: per layer type for Gemma 3)
    window: int | None = None  # sliding window in tokens (a query sees keys at positions > its own - window)
    softcap: float | None = None  # attention scores soft-capped: tanh(scores / cap) x cap (Gemma 2)
    fused: bool = True  # the fused attention kernels compute it (they know no window and no soft cap)


class LlamaDecoder:
    """servelab's forward of Llama's block and its families: fused projections, packed weights, a pre-allocated
    cache."""

    name = "servelab"

    def __init__(self, model, *, kv_cache_dtype: str, dtype: torch.dtype, device: torch.device,
                 kernel: LinearKernel, int4: Int4Kernel | None = None, int8_head: BlockedKernel | None = None,
                 paged_attention: str = "auto", kv_block_size: int = 16, max_context_tokens: int | None = None) -> None:
        config = model.config
        self.kernel, self.int4 = kernel, int4
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.scale = attention_scale(config)  # query_pre_attn_scalar ** -0.5 (Gemma), else head_dim ** -0.5
        self.embed_dim = config.hidden_size
        self.vocab_size = model.lm_head.out_features  # the logits' width
        self.dtype, self.device = dtype, device
        self.cache_dtype = CACHE_DTYPES.get(kv_cache_dtype, dtype)
        body = model.model
        family = family_of(config)
        # NOTE: Gemma's norms scale by 1 + weight in fp32 and cast after: the weights are held as fp32 1 + w, exactly
        # what transformers multiplies by (in fp32 that is Llama's norm on the folded weight)
        norm = (lambda module: module.weight.detach().float() + 1) if family.norm_adds_one else (
            lambda module: _own(module.weight))
        self.final_norm = norm(body.norm)
        # NOTE: transformers multiplies the embedding by sqrt(hidden_size) cast to the weights' dtype (Gemma)
        self.embed_scale = (torch.tensor(config.hidden_size ** 0.5).to(dtype) if family.scales_embeddings else None)
        self.logit_softcap = getattr(config, "final_logit_softcapping", None)
        tied = model.lm_head.weight is body.embed_tokens.weight
        head_kernel = kernel.for_tied_head() if tied else kernel
        self.lm_head = (Int8Linear(int8_head, model.lm_head.weight) if int8_head is not None
                        else _lossless_bf16_head(model.lm_head, head_kernel, dtype)
                        or projection([model.lm_head], head_kernel))
        # NOTE: with tied weights and the head in servelab's blocked layout, a token's embedding is read from
        # that layout (a strided gather of one row per token): the table is then held once, not twice
        self.embed_from_head = _blocked_layout(self.lm_head) if tied else None
        self.embed = None if self.embed_from_head else _own(body.embed_tokens.weight)  # (V, C)
        layer_types = getattr(config, "layer_types", None) or [""] * len(body.layers)
        softcap = attention_softcap(config)
        self.layers = [
            _Layer(
                attn_norm=norm(layer.input_layernorm),
                qkv=projection(family.qkv_modules(layer), kernel, int4),
                o=projection([layer.self_attn.o_proj], kernel, int4),
                mlp_norm=norm(getattr(layer, family.mlp_norm)),
                gate_up=projection(family.gate_up_modules(layer), kernel, int4),
                down=projection([layer.mlp.down_proj], kernel, int4),
                q_norm=norm(layer.self_attn.q_norm) if family.has_qk_norm else None,
                k_norm=norm(layer.self_attn.k_norm) if family.has_qk_norm else None,
                post_attn_norm=norm(layer.post_attention_layernorm) if family.sandwich_norms else None,
                post_mlp_norm=norm(layer.post_feedforward_layernorm) if family.sandwich_norms else None,
                rotary=kind if family.rope_per_layer_type else "", window=window, softcap=softcap,
                fused=window is None and softcap is None,
            )
            for layer, kind, window in zip(body.layers, layer_types, layer_windows(model))
        ]
        blocked = kernel.blocked.module if kernel.blocked is not None else None
        # NOTE: an int8 cache is read by the fused step as it is stored; decode_attention (unpaged) only ever meets
        # float keys (a prefill cache holds int8's values dequantised, the torch path dequantises what it reads)
        fits = (self.head_dim % 16 == 0 and self.num_heads // self.num_kv_heads <= 16
                and self.dtype in (torch.float32, torch.bfloat16)
                and self.cache_dtype in (torch.float32, torch.bfloat16, torch.int8)
                and self.head_dim <= 256)  # the kernel's key and query buffers
        self.decode_attention = blocked.decode_attention if blocked is not None and fits else None
        # NOTE: a decode step's rotary positions, cache write and attention as one kernel call per layer: at batch 1
        # the dozen small operations it replaces cost as much as reading a layer's int4 weights
        self.decode_step_attention = blocked.decode_step_attention if self.decode_attention is not None else None
        # NOTE: a prompt chunk's rotary positions, cache writes and causal attention as one kernel call per layer, on
        # servelab's threads, reading only the columns each tile of tokens sees (SDPA with the chunk's mask computes
        # the whole T x S product, and torch's rotary and cache writes barely gain from a second thread); a window
        # that hides columns keeps torch's operations and SDPA with its mask
        self.prefill_step_attention = blocked.prefill_step_attention if self.decode_attention is not None else None
        norm_fits = blocked is not None and config.hidden_size % 16 == 0 and self.dtype in (torch.float32, torch.bfloat16)
        # NOTE: Gemma's order in bf16 (normalise and scale in fp32, then cast) is not the kernel's (cast, then scale)
        self.head_norm = _rms_norm_in_fp32 if family.norm_adds_one else _rms_norm  # q / k norms, over head_dim
        gemma_bf16 = family.norm_adds_one and self.dtype != torch.float32
        self.rms_norm = blocked.rms_norm if norm_fits and not gemma_bf16 else self.head_norm
        self.gelu = getattr(config, family.activation_field) == "gelu_pytorch_tanh"
        self.silu_mul = _gelu_tanh_mul if self.gelu else blocked.silu_mul if norm_fits else _silu_mul
        self._stack = None  # DecodeStack, built on first use; False where it does not fit
        self._stack_rows = 0  # the most rows a step takes through it (a dense projection's servelab row range)
        # NOTE: transformers' inv_freq and attention_scaling as its rope type computed them at init, over the positions
        # where they stay so (families.rope_positions); a position past them is refused by name
        self.positions_reason = positions_reason(model)
        positions = torch.arange(rope_positions(model), device=device, dtype=torch.float32)
        self.rotary = {}  # per families.rotary_tables key: (cos, sin) (P, D) each
        for kind, (inv_freq, scaling) in rotary_tables(model).items():
            freqs = positions[:, None] * inv_freq.to(device=device, dtype=torch.float32)[None, :]  # (P, D/2)
            angles = torch.cat([freqs, freqs], dim=-1)  # (P, D), as transformers' rotary embedding lays it out
            self.rotary[kind] = ((angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype))
        self.cos, self.sin = self.rotary.get("full_attention", next(iter(self.rotary.values())))
        self.fuses_every_layer = all(layer.fused for layer in self.layers)
        # NOTE: how the paged pool is read: servelab's fused kernels (CPU), FlexAttention in place, or torch's gather;
        # `auto` measures the last two on CUDA (paged_attention.choose), for prompt chunks too (flex_chunks.choose)
        self.paged_attention, self.paged_attention_reason = paged.choose(
            paged_attention, fused_fits=self.decode_step_attention is not None, device=device,
            flex_why_not=paged.flex_reason(cache_dtype=self.cache_dtype, dtype=dtype, head_dim=self.head_dim,
                                           block_size=kv_block_size, device=device,
                                           group=self.num_heads // self.num_kv_heads),
            measure=lambda: self.measure_paged_attention(kv_block_size))
        if self.paged_attention != "servelab":
            self.decode_step_attention = self.prefill_step_attention = None
        self._flex: dict[tuple[type, int], paged.FlexReader] = {}  # decode's and chunks', by block size
        # NOTE: the longest row FlexAttention's index lists must hold (the config's context, within the rotary tables)
        self.max_context = min(max_context_tokens or self.cos.shape[0], self.cos.shape[0])
        # NOTE: prompt chunks read a token-major pool in place too, where FlexAttention serves them (timed on CUDA)
        self.chunk_attention, self.chunk_attention_reason = flex_chunks.choose(
            self.paged_attention, device=device, asked=paged_attention == "flex",
            measure=lambda: self.measure_chunk_attention(kv_block_size))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the decoder holds: weights in their layouts, embeddings, norms, rotary tables."""
        tables = [t for pair in self.rotary.values() for t in pair]
        return [*([self.embed] if self.embed is not None else []), *tables, *self.step_tensors()]

    def step_tensors(self) -> list[torch.Tensor]:
        """The weights a decode step reads in full (the embedding and rotary tables only a row per token)."""
        out = [self.final_norm, *projection_tensors(self.lm_head)]
        for layer in self.layers:
            out += [layer.attn_norm, layer.mlp_norm, *(n for n in (layer.q_norm, layer.k_norm, layer.post_attn_norm,
                                                                    layer.post_mlp_norm) if n is not None)]
            for p in (layer.qkv, layer.o, layer.gate_up, layer.down):
                out += projection_tensors(p)
        return out

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        quantized = self.cache_dtype == torch.int8
        return StaticKVCache(num_layers=len(self.layers), batch_size=batch_size, num_kv_heads=self.num_kv_heads,
                             capacity=capacity, head_dim=self.head_dim, dtype=self.dtype if quantized else self.cache_dtype,
                             device=self.device, quantized=quantized)

    def new_paged_cache(self, *, num_blocks: int, block_size: int) -> PagedKVCache:
        # NOTE: FlexAttention reads a token-major pool (a slot's heads together) in place; the fused kernels and torch's
        # gathers read the default layout
        return PagedKVCache(num_layers=len(self.layers), num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                            dtype=self.cache_dtype, device=self.device, num_blocks=num_blocks, block_size=block_size,
                            layout="NHD" if self.paged_attention == "flex" else "HND")

    def flex(self, block_size: int) -> paged.FlexDecode:
        """FlexAttention's decode over pools of this block size (its compiled kernels and buffers)."""
        return self._flex_reader(paged.FlexDecode, block_size)

    def chunks(self, block_size: int) -> flex_chunks.FlexChunks:
        """FlexAttention's prompt chunks over pools of this block size (its compiled kernels and buffers)."""
        return self._flex_reader(flex_chunks.FlexChunks, block_size)

    def _flex_reader(self, kind: type, block_size: int):
        if (kind, block_size) not in self._flex:
            self._flex[kind, block_size] = kind(
                num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, scale=self.scale,
                block_size=block_size, dtype=self.dtype, device=self.device, max_positions=self.max_context)
        return self._flex[kind, block_size]

    def measure_chunk_attention(self, block_size: int, **size) -> dict[str, float]:
        """Seconds of one layer's prompt-chunk attention read by FlexAttention in place and by torch's gather (this
        decoder's own attention), at this model's heads (flex_chunks.measure_chunk_choices; size: tokens, cached)."""
        return flex_chunks.measure_chunk_choices(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, scale=self.scale,
            block_size=block_size, dtype=self.dtype, device=self.device,
            torch_attention=lambda q, keys, values, visible: self._torch_attention(q, keys, values, visible,
                                                                                   self.layers[0].softcap), **size)

    def measure_paged_attention(self, block_size: int, **size) -> dict[str, float]:
        """Seconds of one layer's decode attention read by FlexAttention and by torch's path (this decoder's own
        attention), at this model's heads (paged_attention.measure_decode_choices; size: num_rows, columns)."""
        return paged.measure_decode_choices(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, scale=self.scale,
            block_size=block_size, dtype=self.dtype, device=self.device,
            torch_attention=lambda q, keys, values, mask: self._attend(q, keys, values, mask, self.layers[0]), **size)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return kv_block_bytes(num_layers=len(self.layers), num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                              block_size=block_size, dtype=self.cache_dtype)

    def _hidden(self, input_ids, attention_mask, position_ids, cache: StaticKVCache,
                window: tuple[int, int, int] | None = None) -> torch.Tensor:
        B, T = input_ids.shape
        H, H_kv, D = self.num_heads, self.num_kv_heads, self.head_dim
        self._check_positions(position_ids)
        h = self._embed(input_ids)  # (B, T, C)
        rotary = {kind: (cos[position_ids].unsqueeze(2), sin[position_ids].unsqueeze(2))  # (B, T, 1, D) each
                  for kind, (cos, sin) in self.rotary.items()}
        mask = _attention_mask(attention_mask, T)
        if window is not None and T > 1:
            mask = _window_mask(mask, attention_mask, position_ids, window)
        for i, layer in enumerate(self.layers):
            qkv = self._qk_norm(layer, layer.qkv(self.rms_norm(h, layer.attn_norm, self.eps)).view(B, T, H + 2 * H_kv, D))
            qk = _rotate(qkv[:, :, : H + H_kv], *rotary[layer.rotary])  # queries and keys rotated together
            q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)  # (B, H, T, D), (B, H_kv, T, D)
            keys, values = cache.append(i, k, qkv[:, :, H + H_kv:].transpose(1, 2))  # (B, H_kv, S, D)
            seen = mask if layer.window is None else _sliding_mask(mask, attention_mask.shape[1], T, layer.window)
            h = self._add_attention(layer, self._attend(q, keys, values, seen, layer), h)  # attended: (B, T, H x D)
            h = self._add_mlp(layer, h)
        cache.advance(T)
        return h

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = (self.embed_from_head.rows(input_ids).to(self.dtype) if self.embed_from_head is not None
             else F.embedding(input_ids, self.embed))
        return h if self.embed_scale is None else h * self.embed_scale

    def _add_attention(self, layer: _Layer, attended: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h + o(attended), the add fused into the matmul where the kernel takes it; Gemma's post-attention norm sits
        between the projection and the add, so there the add is torch's."""
        if layer.post_attn_norm is None:
            return add_projection(layer.o, attended, h)
        return h + self.rms_norm(layer.o(attended), layer.post_attn_norm, self.eps)

    def _add_mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        """h + the MLP of its norm (SwiGLU or GeGLU), Gemma's post-feedforward norm before the add."""
        gated = self.silu_mul(layer.gate_up(self.rms_norm(h, layer.mlp_norm, self.eps)))
        if layer.post_mlp_norm is None:
            return add_projection(layer.down, gated, h)
        return h + self.rms_norm(layer.down(gated), layer.post_mlp_norm, self.eps)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm, the output layer and Gemma's final soft cap: tanh(logits / cap) x cap."""
        logits = self.lm_head(self.rms_norm(h, self.final_norm, self.eps))
        if self.logit_softcap is None:
            return logits
        return torch.tanh(logits / self.logit_softcap) * self.logit_softcap

    def _qk_norm(self, layer: _Layer, qkv: torch.Tensor) -> torch.Tensor:
        """qkv (..., H + 2 H_kv, D) with each query and key head RMS-normed over D (Qwen3's and Gemma 3's q_norm /
        k_norm, each in its family's norm), before any kernel rotates them; other families' as it is."""
        if layer.q_norm is None:
            return qkv
        H, H_kv = self.num_heads, self.num_kv_heads
        norm = self.head_norm
        return torch.cat([norm(qkv[..., :H, :], layer.q_norm, self.eps),
                          norm(qkv[..., H:H + H_kv, :], layer.k_norm, self.eps), qkv[..., H + H_kv:, :]], dim=-2)

    def _check_positions(self, positions: torch.Tensor) -> None:
        if positions.numel() and (last := int(positions.max())) >= self.cos.shape[0]:
            raise ValueError(f"position {last} is past the {self.cos.shape[0]} positions servelab's decoder serves for "
                             f"this model ({self.positions_reason}): set decoding.max_context_tokens to at most "
                             f"{self.cos.shape[0]}, or decoder: transformers")

    def forward_paged(self, batch: PagedBatch, cache: PagedKVCache, *, positions_checked: bool = False) -> torch.Tensor:
        """One forward over the paged cache: the decode rows' tokens, then the prefill chunks', in one pass through
        the weights -> logits (len(batch.logit_rows), V) of the tokens named there. positions_checked: the caller
        checked them on the host (a CUDA graph's step reads no value back)."""
        if not positions_checked:
            self._check_positions(batch.positions)
        h = self._embed(batch.input_ids).view(-1, 1, self.embed_dim)  # (N, 1, C)
        if not batch.chunks and self.decode_step_attention is not None and self.fuses_every_layer:
            h = self._decode_hidden(h, batch, cache)
        else:
            h = self._mixed_hidden(h, batch, cache)
        h = h.view(h.shape[0], -1)[batch.logit_rows].contiguous()
        if not h.shape[0]:  # NOTE: only prompt chunks that do not complete their prompt: nothing samples
            return h.new_empty((0, self.vocab_size))
        return self._head(h)  # (K, V)

    def _decode_hidden(self, h: torch.Tensor, batch: PagedBatch, cache: PagedKVCache) -> torch.Tensor:
        """A decode step, h (B, 1, C): per layer a norm, four matmuls (the residual adds fused into two), the fused
        attention step over the paged cache and SwiGLU's activation: eight kernel calls, or one call for every layer
        where servelab's kernels serve every projection at these rows (DecodeStack in blocked.cpp: the same kernels
        in the same order)."""
        B, H, H_kv, D = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        positions, lengths, table = batch.positions, batch.decode_lengths, batch.block_table
        if (stack := self._decode_stack()) is not None and B <= self._stack_rows:
            out = stack.step(h.reshape(B, -1).contiguous(), self.cos, self.sin, positions, cache.keys, cache.values,
                             lengths, table, cache.key_scales, cache.value_scales)
            return out.view(B, 1, -1)
        for i, layer in enumerate(self.layers):
            qkv = self._qk_norm(layer, layer.qkv(self.rms_norm(h, layer.attn_norm, self.eps)).view(B, H + 2 * H_kv, D))
            attended = self.decode_step_attention(qkv, *self.rotary[layer.rotary], positions, cache.keys[i],
                                                  cache.values[i], lengths, table, H, self.scale,
                                                  *cache.scales(i))  # (B, H x D)
            h = self._add_mlp(layer, self._add_attention(layer, attended.view(B, 1, H * D), h))
        return h

    def _mixed_hidden(self, h: torch.Tensor, batch: PagedBatch, cache: PagedKVCache) -> torch.Tensor:
        """Decode rows and prefill chunks together, h (N, 1, C): the projections over every token at once; the
        decode rows' attention through the fused kernel, FlexAttention or torch, each chunk's through the fused prefill
        kernel, FlexAttention in place or SDPA over the columns its row holds gathered (its cached prefix, earlier
        chunks, itself, causal). Where the stack
        serves (see _decode_stack) and the fused kernels take every row, every layer in one call."""
        N, H, H_kv, D = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        Bd = batch.num_decode
        bs = cache.block_size
        places = [batch.chunk_places(j, bs) for j in range(len(batch.chunks))]
        if ((stack := self._decode_stack()) is not None and N <= self._stack_rows
                and all(self._fuses(place, start, num_tokens, batch.window, bs)
                        for (_, start, num_tokens), place in zip(batch.chunks, places))):
            # NOTE: every layer in one call, the same kernels in the same order (DecodeStack.mixed in blocked.cpp)
            out = stack.mixed(h.view(N, -1), self.cos, self.sin, batch.positions, cache.keys, cache.values, Bd,
                              batch.decode_lengths, batch.block_table[:Bd], list(batch.chunks),
                              [batch.block_table[Bd + j] for j in range(len(batch.chunks))], cache.key_scales,
                              cache.value_scales)
            return out.view(N, 1, -1)
        rotary = {kind: (cos[batch.positions].view(N, 1, 1, D), sin[batch.positions].view(N, 1, 1, D))
                  for kind, (cos, sin) in self.rotary.items()}
        in_place = self.decode_step_attention is not None or self.paged_attention == "flex"
        decode_places = batch.decode_places(bs) if Bd and not (in_place and self.fuses_every_layer) else None
        flex = (self.flex(bs).prepare(batch.decode_lengths, batch.block_table[:Bd], cache.num_allocated_blocks)
                if Bd and self.paged_attention == "flex" else None)
        chunk_steps = self._chunk_steps(batch, places, cache)
        for i, layer in enumerate(self.layers):
            qkv = self._qk_norm(layer, layer.qkv(self.rms_norm(h, layer.attn_norm, self.eps)).view(N, H + 2 * H_kv, D))
            cos, sin = rotary[layer.rotary]
            parts = []
            if Bd and layer.fused and self.decode_step_attention is not None:
                parts.append(self.decode_step_attention(qkv[:Bd], *self.rotary[layer.rotary], batch.positions[:Bd],
                                                        cache.keys[i], cache.values[i], batch.decode_lengths,
                                                        batch.block_table[:Bd], H, self.scale, *cache.scales(i)))
            elif Bd and layer.fused and flex is not None:
                parts.append(self._flex_decode(qkv[:Bd], cos[:Bd], sin[:Bd], cache, i, flex))
            elif Bd:
                parts.append(self._torch_decode(qkv[:Bd], cos[:Bd], sin[:Bd], cache, i, decode_places, layer, batch))
            for j, ((offset, start, num_tokens), place) in enumerate(zip(batch.chunks, places)):
                rows = slice(offset, offset + num_tokens)
                parts.append(self._chunk_attention(qkv[rows], cos[rows], sin[rows], cache, i, place, start,
                                                   batch.window, bs, batch.positions[rows], batch.block_table[Bd + j],
                                                   layer, chunk_steps[j]))
            attended = torch.cat(parts) if len(parts) > 1 else parts[0]
            h = self._add_mlp(layer, self._add_attention(layer, attended.view(N, 1, H * D), h))
        return h

    def _chunk_steps(self, batch: PagedBatch, places, cache: PagedKVCache) -> list[flex_chunks.ChunkStep | None]:
        """Per chunk, its FlexAttention step where prompt chunks read the pool in place and this one's columns are its
        row's 0.. start + T - 1 (nothing evicted; see _fuses), else None (torch's gather)."""
        steps: list[flex_chunks.ChunkStep | None] = [None] * len(batch.chunks)
        if self.chunk_attention != "flex":
            return steps
        bs, slots = cache.block_size, {}  # NOTE: chunks of one padded size in one step each have their own buffers
        for j, ((_, start, num_tokens), place) in enumerate(zip(batch.chunks, places)):
            if self._fuses(place, start, num_tokens, batch.window, bs):
                size = flex_chunks.padded_tokens(num_tokens)
                slots[size] = slot = slots.get(size, -1) + 1
                steps[j] = self.chunks(bs).prepare(batch.block_table[batch.num_decode + j], start, num_tokens,
                                                   cache.num_allocated_blocks, slot)
        return steps

    def _chunk_attention(self, x, cos, sin, cache: PagedKVCache, layer: int, place, start: int,
                         window: tuple[int, int] | None, bs: int, positions: torch.Tensor,
                         table: torch.Tensor, spec: _Layer, step: flex_chunks.ChunkStep | None = None) -> torch.Tensor:
        """x (T, H + 2 H_kv, D) of one row's chunk at columns start.. (positions (T,) int64, the row's block table
        (blocks,) int32) -> attention out (T, H x D): the fused kernel, FlexAttention in place (step) or torch's gather.
        A layer with a sliding window or a soft cap (spec) takes torch's operations: its queries see keys at positions >
        their own - window."""
        T, H, H_kv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        new_blocks, new_offsets, blocks, offsets, key_positions = place
        if spec.fused and self.prefill_step_attention is not None and self._fuses(place, start, T, window, bs):
            return self.prefill_step_attention(x, *self.rotary[spec.rotary], positions, cache.keys[layer],
                                               cache.values[layer], table, start, H, self.scale, *cache.scales(layer))
        qk = _rotate(x[:, : H + H_kv].unsqueeze(0), cos.view(1, T, 1, D), sin.view(1, T, 1, D))[0]  # (T, H + H_kv, D)
        cache.write(layer, new_blocks, new_offsets, qk[:, H:], x[:, H + H_kv:])
        if spec.fused and step is not None:
            return self.chunks(bs).attend(step, qk[:, :H], cache.keys[layer], cache.values[layer])
        keys, values = cache.read(layer, blocks, offsets)  # (H_kv, S, D)
        query_positions = torch.arange(start, start + T, device=x.device)
        visible = key_positions[None, :] <= query_positions[:, None]
        if window is not None:  # each token sees the sinks and the window behind its own block
            key_blocks = (key_positions // bs)[None, :]
            visible &= (key_blocks < window[0]) | (key_blocks >= (query_positions // bs - window[1])[:, None])
        if spec.window is not None:
            visible &= key_positions[None, :] > query_positions[:, None] - spec.window
        out = self._torch_attention(qk[:, :H].transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                    visible[None, None], spec.softcap)  # (1, H, T, D)
        return out[0].transpose(0, 1).reshape(T, H * D)

    @staticmethod
    def _fuses(place, start: int, T: int, window: tuple[int, int] | None, bs: int) -> bool:
        """Whether a chunk's attention fits servelab's fused kernel: each token sees every column up to its own,
        nothing evicted (the columns are the row's 0.. start + T - 1) and no window, or one that still reaches back to
        the sink blocks."""
        return place[4].shape[0] == start + T and (window is None or (start + T - 1) // bs - window[1] <= window[0])

    def _torch_decode(self, x, cos, sin, cache: PagedKVCache, layer: int, place, spec: _Layer,
                      batch: PagedBatch) -> torch.Tensor:
        """Decode rows without the fused kernel (another device or dtype, a sliding window, a soft cap): plain torch
        gathers from the pool."""
        B, H, H_kv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        new_blocks, new_offsets, table, mask = place
        qk = _rotate(x[:, : H + H_kv].unsqueeze(1), cos.view(B, 1, 1, D), sin.view(B, 1, 1, D))[:, 0]  # (B, H + H_kv, D)
        cache.write(layer, new_blocks, new_offsets, qk[:, H:], x[:, H + H_kv:])
        keys, values = cache.read_blocks(layer, table)  # (B, H_kv, nb x block_size, D)
        if spec.window is not None:  # keyed by position: a column's, less what window eviction dropped before it
            key_positions = batch.decode_key_positions(cache.block_size, mask.shape[1])  # (B, S)
            mask = mask & (key_positions > batch.positions[:B, None] - spec.window)
        return self._attend(qk[:, :H].unsqueeze(2), keys, values, mask, spec).view(B, H * D)

    def _flex_decode(self, x, cos, sin, cache: PagedKVCache, layer: int, step: paged.FlexStep) -> torch.Tensor:
        """Decode rows through FlexAttention reading the pool in place: rotary and the new keys' writes in torch, then
        one kernel call over every row's blocks."""
        B, H, H_kv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qk = _rotate(x[:, : H + H_kv].unsqueeze(1), cos.view(B, 1, 1, D), sin.view(B, 1, 1, D))[:, 0]  # (B, H + H_kv, D)
        cache.write(layer, step.new_blocks, step.new_offsets, qk[:, H:], x[:, H + H_kv:])
        return self.flex(cache.block_size).attend(step, qk[:, :H], cache.keys[layer], cache.values[layer])

    def forward(self, input_ids, attention_mask, position_ids, cache: StaticKVCache) -> torch.Tensor:
        h = self._hidden(input_ids, attention_mask, position_ids, cache)
        return self._head(h[:, -1, :].contiguous())  # (B, V)

    def _decode_stack(self):
        """Every layer as one kernel call (a decode step's, or a step with prompt chunks where the fused attention
        takes each), where the norms and attention are servelab's and every projection is servelab's int4 kernel, or
        every one servelab's dense kernel on weights in the model's dtype (up to the rows `auto` measured it fastest
        at: _stack_rows), without bias, padding or q/k norm: built on the first forward (after any change to a projection's
        int_rows), else None."""
        if self._stack is None:
            projections = [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            blocked = self.kernel.blocked.module if self.kernel.blocked is not None else None
            self._stack = False
            # NOTE: the stack knows no q/k norm (Qwen3), no sliding window, soft cap or other attention scale, no norm
            # between a projection and its residual add and no GeGLU (Gemma)
            if (blocked is None or self.decode_step_attention is None or self.rms_norm != blocked.rms_norm
                    or self.layers[0].q_norm is not None or not self.fuses_every_layer or self.gelu
                    or self.layers[0].post_attn_norm is not None or self.scale != self.head_dim ** -0.5):
                return None
            if all(isinstance(p, ServelabInt4Linear) and p.takes_residual for p in projections):
                parts = {id(p): (p.packed, p.scales, p.zeros, p.group_size, p.int_rows, p.float_activations)
                         for p in projections}
                self._stack_rows = 1 << 62  # NOTE: the int4 kernel picks its own path by rows (int_rows)
            elif all(dense := [_dense_stack_part(p, self.dtype) for p in projections]):
                empty = torch.empty(0)
                parts = {id(p): (linear.weight, empty, empty, 0, rows, False)
                         for p, (linear, rows) in zip(projections, dense)}
                self._stack_rows = min(rows for _, rows in dense)
            else:
                return None
            self._stack = blocked.DecodeStack(self.num_heads, self.num_kv_heads, self.head_dim, self.eps)
            for layer in self.layers:
                self._stack.add_layer(layer.attn_norm, layer.mlp_norm,
                                      *(parts[id(p)] for p in (layer.qkv, layer.o, layer.gate_up, layer.down)))
        return self._stack or None

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
               keep: int, window: tuple[int, int, int] | None = None) -> torch.Tensor:
        """A prefill's logits at its last `keep` positions (B, keep, V), through the kernels that serve. window:
        (sink blocks, window blocks, block size): each token attends as under kv_cache.eviction: window (the quality
        lab scores a windowed config so: the same mask the paged cache applies, in one forward)."""
        cache = self.new_cache(input_ids.shape[0], input_ids.shape[1])
        h = self._hidden(input_ids, attention_mask, position_ids, cache, window)[:, -keep:, :].contiguous()
        return self._head(h)

    def _attend(self, q, keys, values, mask, layer: _Layer) -> torch.Tensor:
        """q (B, H, T, D), keys / values (B, H_kv, S, D), mask as _attention_mask gives it -> (B, T, H x D)."""
        B, H, T, D = q.shape
        if T == 1 and layer.fused and self.decode_attention is not None:  # servelab's kernel: one pass per kv head
            return self.decode_attention(q[:, :, 0], keys, values, mask, self.scale).view(B, 1, H * D)
        if T == 1 and mask is not None:
            mask = mask[:, None, None, :]  # (B, 1, 1, S)
        return self._torch_attention(q, keys, values, mask, layer.softcap).transpose(1, 2).reshape(B, T, H * D)

    def _torch_attention(self, q, keys, values, mask, softcap: float | None) -> torch.Tensor:
        """q (B, H, T, D), keys / values (B, H_kv, S, D), mask bool (B, 1, T, S) or None -> (B, H, T, D): SDPA for
        several queries; else (one query, or soft-capped scores, which SDPA has no place for) transformers' eager
        attention, the query heads of a group sharing one matmul against their kv head's keys."""
        B, H, T, D = q.shape
        H_kv, S = keys.shape[1], keys.shape[2]
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        if T > 1 and softcap is None:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True)
        scores = torch.matmul(q.reshape(B, H_kv, H // H_kv * T, D), keys.transpose(-1, -2)) * self.scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.view(B, H_kv, H // H_kv, T, S)
        if mask is not None:
            scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype).view(B, H_kv, H // H_kv * T, S)
        return torch.matmul(probs, values).view(B, H, T, D)


def _attention_mask(attention_mask: torch.Tensor, T: int) -> torch.Tensor | None:
    """(B, S) 1/0 over the cached columns and these T -> None when nothing is hidden; for one new token
    (decode) bool (B, S); for T tokens (prefill) bool (B, 1, T, S), causal."""
    S = attention_mask.shape[1]
    if T == 1:
        return None if bool(attention_mask.all()) else attention_mask.bool()
    query_pos = torch.arange(S - T, S, device=attention_mask.device)[:, None]  # (T, 1)
    key_pos = torch.arange(S, device=attention_mask.device)[None, :]  # (1, S)
    visible = (key_pos <= query_pos)[None, None] & attention_mask.bool()[:, None, None, :]  # (B, 1, T, S)
    # NOTE: a padding query sees itself, so no row of scores is all -inf (softmax would give NaN, and NaN
    # values under a zero weight would still poison real rows). Real queries never see padding.
    return visible | (key_pos == query_pos)[None, None]


def _window_mask(mask: torch.Tensor | None, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 window: tuple[int, int, int]) -> torch.Tensor:
    """A prefill's mask (B, 1, T, S) narrowed to what window eviction keeps: a key is seen when it is in the first
    `sink` blocks of positions or at most `window` blocks behind the query's own block (positions, not columns)."""
    sink, blocks, bs = window
    B, S = attention_mask.shape
    T = position_ids.shape[1]
    keys = torch.zeros((B, S), dtype=position_ids.dtype, device=position_ids.device)
    keys[:, S - T:] = position_ids  # NOTE: a prefill with no cache: its columns are its tokens
    key_blocks, query_blocks = (keys // bs)[:, None, None, :], (position_ids // bs)[:, None, :, None]
    kept = (key_blocks < sink) | (key_blocks >= query_blocks - blocks)  # (B, 1, T, S)
    if mask is None:
        query = torch.arange(S - T, S, device=keys.device)[:, None]
        mask = (torch.arange(S, device=keys.device)[None, :] <= query)[None, None]
    # NOTE: a padding query keeps seeing itself (no all -inf row); its own column is always kept
    return mask & (kept | (torch.arange(S, device=keys.device)[None, :] == torch.arange(S - T, S, device=keys.device)[:, None]))


def _sliding_mask(mask: torch.Tensor | None, S: int, T: int, window: int) -> torch.Tensor:
    """_attention_mask's mask for T queries over S columns of a cache without eviction (a row's columns are its
    positions, shifted by its padding) narrowed to the keys less than `window` positions behind each query."""
    query = torch.arange(S - T, S, device=mask.device if mask is not None else None)[:, None]
    near = torch.arange(S, device=query.device)[None, :] > query - window  # (T, S)
    if T == 1:
        return near if mask is None else mask & near  # (B or 1, S)
    return mask & near[None, None]  # (B, 1, T, S)


def _rms_norm_in_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma RMSNorm with its 1 + w folded into an fp32 weight: normalised and scaled in fp32, then
    cast back."""
    return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)


def _gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU: gelu (tanh approximation, transformers' gelu_pytorch_tanh) of the gate times up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalised in fp32, cast back, then scaled by the weight."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on (B, T, heads, D) with cos / sin (B, T, 1, D), halves rotated as transformers does."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
