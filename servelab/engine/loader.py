"""Loads a serving config's model and tokenizer onto its device: the one place the weights pick the loader.

`weights: awq-int4` goes to the AWQ loader (servelab.engine.awq); fp32 / bf16 / fp16 load the dense
transformers model here. Knows the weight precisions and the thread count. Does not know decoding; where
model files come from is servelab.engine.model_files, what a loaded model is servelab.engine.loaded_model.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

from servelab.config import ServingConfig
from servelab.engine.loaded_model import LoadedModel, model_shape, resolve_device
from servelab.engine.model_files import ModelLoadError, ensure_bundled_folder, file_lock, resolve_model_folder
from servelab.settings import Settings, available_cores

# NOTE: re-exported: engine, cli, linear, kernels, lab, bench and tests import these from here.
__all__ = [
    "DTYPES", "LoadedModel", "ModelLoadError", "apply_threads", "ensure_bundled_folder", "file_lock",
    "load_dense_model", "load_model", "model_shape", "resolve_device", "resolve_model_folder",
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

        return load_awq_model(config, settings)
    return load_dense_model(config, settings)


def load_dense_model(config: ServingConfig, settings: Settings) -> LoadedModel:
    """The config's model in full or half precision (fp32, bf16, fp16), through transformers."""
    started = time.perf_counter()
    if settings.hf_hub_offline:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = resolve_model_folder(config.model, settings)
    device = resolve_device(config.device)
    dtype = DTYPES[config.weights]
    if dtype == torch.float16 and device.type == "cpu":
        log.warning("fp16 on CPU has no fast matmul path; use bf16 on CPU and fp16 on GPU")
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model from {folder}: {exc}") from exc
    model.to(device).eval()
    return LoadedModel(
        model=model, tokenizer=tokenizer, device=device, dtype=dtype, folder=folder,
        shape=model_shape(model.config), load_s=time.perf_counter() - started,
    )
