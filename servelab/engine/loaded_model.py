"""What a loaded model is, whichever loader made it: LoadedModel, its cache shape, the device it runs on.

Knows the torch device a config names, the KV-cache shape read from a transformers config, and which of
transformers' attentions its model class takes.
Does not know where model files come from, weight precisions or quantisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from servelab.memory import ModelShape
from servelab.engine.model_files import ModelLoadError


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    folder: str
    shape: ModelShape
    load_s: float


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but torch sees no CUDA device here")
    return torch.device(device)


def model_shape(hf_config: AutoConfig) -> ModelShape:
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    return ModelShape(
        num_layers=hf_config.num_hidden_layers,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        vocab_size=hf_config.vocab_size,
    )


def attention_for(folder: str | Path) -> str:
    """transformers' attention for this model's own forward (the reference, the transformers decoder): SDPA where the
    model class takes it, else its eager attention (Gemma 2: SDPA has no soft cap, and transformers refuses it)."""
    try:
        config = AutoConfig.from_pretrained(folder)
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except (OSError, ValueError, KeyError):
        return "sdpa"  # NOTE: the load that follows says what is wrong with the folder
    return "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"
