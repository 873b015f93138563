"""The model families servelab's decoder computes, and how each differs from Llama's block.

A family names its attention and MLP projections (separate q/k/v and gate/up modules, or one fused module whose
outputs are already laid out side by side), whether queries and keys pass a per-head RMSNorm before rotary
positions, Gemma's differences (norms scaled by 1 + weight, a norm on each branch's output, scaled embeddings,
soft-capped scores, rotary tables per layer type), and which rope types and attention windows its decoder matches
exactly.
`unsupported_reason` says, by name, what is refused. Does not know kernels, caches or requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LLAMA_QKV, LLAMA_GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


@dataclass(frozen=True)
class Family:
    """One architecture as servelab's decoder reads it from transformers' modules."""

    model_type: str
    qkv: tuple[str, ...] = LLAMA_QKV  # self_attn modules whose outputs side by side are q, k, v
    gate_up: tuple[str, ...] = LLAMA_GATE_UP  # mlp modules whose outputs side by side are gate, up
    has_qk_norm: bool = False  # q_norm / k_norm: RMSNorm over head_dim on each head, before rotary
    norm_adds_one: bool = False  # every RMSNorm scales by (1 + weight), in fp32, cast after the multiply (Gemma)
    # input_layernorm before attention, post_attention_layernorm on its output before the residual add, then
    # pre_feedforward_layernorm before the MLP and post_feedforward_layernorm on its output (Gemma 2 / 3); else
    # post_attention_layernorm is the norm before the MLP (Llama)
    sandwich_norms: bool = False
    scales_embeddings: bool = False  # embeddings x sqrt(hidden_size), the factor cast to the model's dtype (Gemma)
    # scores = tanh(scores / cap) x cap before the mask (config.attn_logit_softcapping): Gemma 2's attention applies
    # it; Gemma 3's config holds the field and its attention ignores it
    attention_softcap: bool = False
    rope_per_layer_type: bool = False  # `{layer_type}_inv_freq` / `_attention_scaling` on the rotary module (Gemma 3)
    activation_field: str = "hidden_act"  # the config field naming the gate's activation

    @property
    def mlp_norm(self) -> str:
        """The decoder layer's norm before the MLP."""
        return "pre_feedforward_layernorm" if self.sandwich_norms else "post_attention_layernorm"

    def qkv_modules(self, layer) -> list[torch.nn.Module]:
        return [getattr(layer.self_attn, name) for name in self.qkv]

    def gate_up_modules(self, layer) -> list[torch.nn.Module]:
        return [getattr(layer.mlp, name) for name in self.gate_up]


FAMILIES = {
    "llama": Family("llama"),
    "mistral": Family("mistral"),
    "qwen2": Family("qwen2"),  # NOTE: q/k/v biases: projection() joins them with the weights
    "qwen3": Family("qwen3", has_qk_norm=True),
    "phi3": Family("phi3", qkv=("qkv_proj",), gate_up=("gate_up_proj",)),
    "gemma2": Family("gemma2", norm_adds_one=True, sandwich_norms=True, scales_embeddings=True, attention_softcap=True,
                     activation_field="hidden_activation"),
    "gemma3_text": Family("gemma3_text", has_qk_norm=True, norm_adds_one=True, sandwich_norms=True,
                          scales_embeddings=True, rope_per_layer_type=True, activation_field="hidden_activation"),
}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gate's activations the decoder computes (GeGLU: gelu, tanh form)

# NOTE: transformers computes these rope types' inv_freq and attention_scaling once, at init: the decoder's cos / sin
# tables read both. 'dynamic' and 'longrope' change inv_freq with the longest position in a forward (and keys
# already cached keep the old rotation), so servelab serves them up to the length where nothing changes.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
BOUNDED_ROPE_TYPES = ("dynamic", "longrope")


def family_of(config) -> Family | None:
    return FAMILIES.get(config.model_type)


def rope_type(model) -> str:
    """The rope type; with tables per layer type (Gemma 3), the full-attention layers'."""
    kind = getattr(model.model.rotary_emb, "rope_type", "default")
    return kind.get("full_attention", "default") if isinstance(kind, dict) else kind


def rope_types(model) -> list[str]:
    """Every rope type the model's layers use."""
    kind = getattr(model.model.rotary_emb, "rope_type", "default")
    return sorted(set(kind.values())) if isinstance(kind, dict) else [kind]


def rotary_tables(model) -> dict[str, tuple[torch.Tensor, float]]:
    """Per layer type (Gemma 3: `{layer_type}_inv_freq`, `_attention_scaling`), or one entry '' for every layer:
    transformers' inv_freq (D/2,) and attention scaling as its rope type computed them at init."""
    rotary = model.model.rotary_emb
    if family_of(model.config).rope_per_layer_type:
        return {kind: (getattr(rotary, f"{kind}_inv_freq"), getattr(rotary, f"{kind}_attention_scaling"))
                for kind in sorted(set(model.config.layer_types))}
    return {"": (rotary.inv_freq, rotary.attention_scaling)}


def layer_windows(model) -> list[int | None]:
    """Each layer's token window (a query sees keys at positions > its own - window), None where it attends to
    every earlier position or where its window reaches every position served (it hides nothing)."""
    config = model.config
    window = sliding_window(config)
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    hides = window is not None and window < rope_positions(model)
    return [window if hides and kind == "sliding_attention" else None for kind in layer_types]


def attention_scale(config) -> float:
    """The factor on q.k: query_pre_attn_scalar ** -0.5 where the config has one (Gemma), else head_dim ** -0.5."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return float(getattr(config, "query_pre_attn_scalar", None) or head_dim) ** -0.5


def attention_softcap(config) -> float | None:
    family = family_of(config)
    return getattr(config, "attn_logit_softcapping", None) if family is not None and family.attention_softcap else None


def rope_positions(model) -> int:
    """How many positions (0 ..) the decoder's rotary tables hold: where servelab matches transformers exactly.
    'dynamic' recomputes its frequencies past max_position_embeddings; 'longrope' switches to its long factor past
    original_max_position_embeddings."""
    config = model.config
    if rope_type(model) == "longrope":
        original = ((getattr(config, "rope_parameters", None) or {}).get("original_max_position_embeddings")
                    or getattr(config, "original_max_position_embeddings", None))
        return int(original or config.max_position_embeddings)
    return int(config.max_position_embeddings)


def positions_reason(model) -> str:
    """What happens past rope_positions, for the error that refuses a position there."""
    rope = rope_type(model)
    if rope in BOUNDED_ROPE_TYPES:
        return (f"rope type {rope!r}: transformers changes its frequencies for every position of a forward that "
                "reaches past it, and keys already cached keep the old rotation")
    return "max_position_embeddings"


def sliding_window(config) -> int | None:
    """The token window of the model's sliding-window layers (a query sees the last `window` keys, itself
    included), or None when every layer attends to the whole sequence."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


def unsupported_reason(model) -> str | None:
    """Why servelab's decoder cannot run this model exactly as transformers does, or None when it can."""
    config = model.config
    if (family := family_of(config)) is None:
        return f"architecture {config.model_type!r} (servelab's decoder covers {', '.join(map(repr, FAMILIES))})"
    if (activation := getattr(config, family.activation_field)) not in ACTIVATIONS:
        return f"activation {activation!r}"
    for rope in rope_types(model):
        if rope not in STATIC_ROPE_TYPES + (() if family.rope_per_layer_type else BOUNDED_ROPE_TYPES):
            return f"rope type {rope!r}"
    if getattr(config, "use_bidirectional_attention", None):
        return "bidirectional attention (use_bidirectional_attention)"
    if (partial := (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)) != 1.0:
        return f"partial rotary positions (partial_rotary_factor {partial}: the kernels rotate whole heads)"
    if set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(set(config.layer_types))}"
    return None
