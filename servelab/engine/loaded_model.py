"""What a loaded model is, whichever loader made it: LoadedModel, its cache shape, the device it runs on.

Knows the torch device a config names and the KV-cache shape read from a transformers config.
Does not know where model files come from, weight precisions or quantisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, PreTrainedModel
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
