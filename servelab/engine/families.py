"""The model families servelab's decoder computes, and how each differs from Llama's block.

A family names its attention and MLP projections (separate q/k/v and gate/up modules, or one fused module whose
outputs are already laid out side by side), whether queries and keys pass a per-head RMSNorm before rotary
positions, and which of transformers' rope types and attention windows its decoder matches exactly.
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
}

# NOTE: transformers computes these rope types' inv_freq and attention_scaling once, at init: the decoder's cos / sin
# tables read both. 'dynamic' and 'longrope' change inv_freq with the longest position in a forward (and keys
# already cached keep the old rotation), so servelab serves them up to the length where nothing changes.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
BOUNDED_ROPE_TYPES = ("dynamic", "longrope")


def family_of(config) -> Family | None:
    return FAMILIES.get(config.model_type)


def rope_type(model) -> str:
    return getattr(model.model.rotary_emb, "rope_type", "default")


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
    if family_of(config) is None:
        return f"architecture {config.model_type!r} (servelab's decoder covers {', '.join(map(repr, FAMILIES))})"
    if config.hidden_act != "silu":
        return f"activation {config.hidden_act!r}"
    rope = rope_type(model)
    if rope not in STATIC_ROPE_TYPES + BOUNDED_ROPE_TYPES:
        return f"rope type {rope!r}"
    if (partial := (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)) != 1.0:
        return f"partial rotary positions (partial_rotary_factor {partial}: the kernels rotate whole heads)"
    window = sliding_window(config)
    if window is not None and window < (positions := rope_positions(model)):
        return (f"sliding window of {window} tokens below the {positions} positions served (servelab's decoder "
                "attends to every cached key; served where the window reaches every position)")
    if set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(set(config.layer_types))}"
    return None
