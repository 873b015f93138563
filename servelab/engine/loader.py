"""Loads a serving config's model and tokenizer onto its device: the one place the weights pick the loader.

`weights: awq-int4` goes to the AWQ loader (servelab.engine.awq); fp32 / bf16 / fp16 load the dense
transformers model here. Knows the weight precisions, the thread count, and that a context longer than the model's
positions is refused. Does not know decoding; where model files come from is servelab.engine.model_files, what a
loaded model is servelab.engine.loaded_model.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

from servelab.config import ServingConfig
from servelab.engine.loaded_model import LoadedModel, attention_for, model_shape, resolve_device
from servelab.engine.model_files import (
    ModelLoadError,
    declared_quantization,
    ensure_bundled_folder,
    file_lock,
    resolve_model_folder,
)
from servelab.settings import Settings, available_cores

# NOTE: re-exported: engine, cli, linear, kernels, lab, bench and tests import these from here.
__all__ = [
    "DTYPES", "LoadedModel", "ModelLoadError", "apply_threads", "attention_for", "check_context_length", "ensure_bundled_folder",
    "file_lock", "load_dense_model", "load_model", "model_shape", "resolve_device", "resolve_model_folder",
]

log = logging.getLogger(__name__)
# NOTE: transformers' "Loading weights" bar on every load (a worker, the lab's quality step) says nothing a user acts on
transformers_logging.disable_progress_bar()

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_threads(config: ServingConfig, settings: Settings) -> int:
    """torch's threads (servelab's kernels run on them too): the config's num_threads, else SERVELAB_NUM_THREADS,
    else every core this process may run on (its CPU affinity, capped by a CPU quota)."""
    torch.set_num_threads(config.num_threads or settings.num_threads or available_cores())
    return torch.get_num_threads()


def load_model(config: ServingConfig, settings: Settings) -> LoadedModel:
    if config.weights == "awq-int4":
        from servelab.engine.awq import load_awq_model  # NOTE: gptqmodel is heavy; import only for AWQ

        loaded = load_awq_model(config, settings)
    else:
        loaded = load_dense_model(config, settings)
    check_context_length(config, loaded)
    return loaded


def check_context_length(config: ServingConfig, loaded: LoadedModel) -> None:
    """A context longer than the model's positions is refused: positions past max_position_embeddings were never
    trained, and servelab's decoder builds its rotary table up to it."""
    max_positions = getattr(loaded.model.config.get_text_config(), "max_position_embeddings", None)
    if isinstance(max_positions, int) and config.decoding.max_context_tokens > max_positions:
        raise ModelLoadError(
            f"config {config.name!r}: decoding.max_context_tokens is {config.decoding.max_context_tokens}, above the "
            f"model's max_position_embeddings ({max_positions}, {loaded.folder}): set decoding.max_context_tokens to "
            f"{max_positions} or less"
        )


def load_dense_model(config: ServingConfig, settings: Settings) -> LoadedModel:
    """The config's model in full or half precision (fp32, bf16, fp16), through transformers."""
    started = time.perf_counter()
    if settings.hf_hub_offline:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = resolve_model_folder(config.model, settings)
    if (declared := declared_quantization(folder)) is not None:
        # NOTE: transformers would load it in its own quantised form, not the precision the config names
        raise ModelLoadError(
            f"{folder} holds quantised weights (its config.json declares quantization_config, quant_method "
            f"{declared.get('quant_method')!r}), not {config.weights}: an AWQ int4 checkpoint is served with "
            "weights: awq-int4"
        )
    device = resolve_device(config.device)
    dtype = DTYPES[config.weights]
    if dtype == torch.float16 and device.type == "cpu":
        log.warning("fp16 on CPU has no fast matmul path; use bf16 on CPU and fp16 on GPU")
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attention_for(folder))
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model from {folder}: {exc}") from exc
    model.to(device).eval()
    return LoadedModel(
        model=model, tokenizer=tokenizer, device=device, dtype=dtype, folder=folder,
        shape=model_shape(model.config), load_s=time.perf_counter() - started,
    )
