"""The int4 checkpoint cache: where a config's checkpoint lives, the record inside it, and checking it.

Knows the cache key (base model fingerprint, method, quant and calibration settings), the GEMM tensor
layout a checkpoint must have, and that a bad checkpoint raises, never falls back to full precision.
Does not know how a checkpoint is made (quantizing.py) or served (load.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from safetensors import SafetensorError, safe_open

from servelab.config import AWQConfig, ServingConfig
from servelab.engine.model_files import ModelLoadError, resolve_model_folder
from servelab.settings import Settings

QuantMethod = Literal["awq", "rtn"]

# base config fields a checkpoint must share with its base model
SHAPE_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "vocab_size",
)
RECORD_FILE = "servelab_quantize.json"
PACK_FACTOR = 32 // 4  # int4 values per packed int32 column


class AWQCheckpointError(ModelLoadError):
    """An AWQ checkpoint that is missing, corrupt or made for another model; the message names the file."""


@dataclass(frozen=True)
class QuantizeRecord:
    """How a checkpoint was made; written as JSON inside it and returned by quantize()."""

    checkpoint: str
    method: QuantMethod
    base_model: str
    bits: int
    group_size: int
    zero_point: bool
    calibration_set: str | None
    num_calibration_samples: int
    calibration_seq_len: int
    quantize_s: float
    device: str
    gptqmodel_version: str
    is_reused: bool = False


@dataclass(frozen=True)
class CheckpointSlot:
    """One config's checkpoint in the cache, and the base model it is made from (resolved once per call)."""

    folder: Path  # the checkpoint folder; it may not exist yet
    base_folder: Path
    method: QuantMethod
    awq: AWQConfig


def awq_section(config: ServingConfig) -> AWQConfig:
    if config.awq is None:
        raise ValueError(
            f"config {config.name!r} has no awq section: set weights: awq-int4 to quantise or load AWQ weights"
        )
    return config.awq


def checkpoint_slot(config: ServingConfig, settings: Settings, base_folder: Path, *,
                    method: QuantMethod | None = None) -> CheckpointSlot:
    """Where this config's checkpoint lives, for the base model folder its caller resolved (once)."""
    awq_cfg = awq_section(config)
    method = method or awq_cfg.method
    key = {
        "base": config.model, **_base_fingerprint(base_folder), "method": method,
        "bits": awq_cfg.bits, "group_size": awq_cfg.group_size, "zero_point": awq_cfg.zero_point,
    }
    if method == "awq":  # RTN reads no calibration data: its checkpoint does not depend on it
        key |= {
            "calibration_set": awq_cfg.calibration_set,
            "num_calibration_samples": awq_cfg.num_calibration_samples,
            "calibration_seq_len": awq_cfg.calibration_seq_len,
        }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = f"{base_folder.name}-{method}-int{awq_cfg.bits}-g{awq_cfg.group_size}-{digest}"
    return CheckpointSlot(settings.model_cache_dir / "awq" / name, base_folder, method, awq_cfg)


def awq_checkpoint_dir(config: ServingConfig, settings: Settings, *, method: QuantMethod | None = None) -> Path:
    """The cache folder of this config's quantised checkpoint (which may not exist yet)."""
    awq_section(config)  # NOTE: a config without an awq section is refused before its model is resolved
    base_folder = Path(resolve_model_folder(config.model, settings))
    return checkpoint_slot(config, settings, base_folder, method=method).folder


def _base_fingerprint(base_folder: Path) -> dict:
    # NOTE: name + config + weight bytes, not the path: the same model under another cache_dir
    # (relative or absolute) must find the same checkpoint.
    weight_bytes = sum(p.stat().st_size for p in sorted(base_folder.glob("*.safetensors")))
    config_sha = hashlib.sha256((base_folder / "config.json").read_bytes()).hexdigest()[:16]
    return {"name": base_folder.name, "config_sha": config_sha, "weight_bytes": weight_bytes}


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AWQCheckpointError(
            f"{path}: cannot read it as JSON ({exc}); delete the checkpoint and re-quantise"
        ) from exc


def validate_checkpoint(folder: Path, base_folder: Path, awq_cfg: AWQConfig) -> None:
    """Raise AWQCheckpointError naming the file unless `folder` is an int4 GEMM checkpoint of this base
    model with these quant settings, every base linear layer present as packed qweight/qzeros/scales."""
    _check_config(folder / "config.json", base_folder, awq_cfg)
    shapes = _tensor_shapes(_safetensors_files(folder))
    for key, (base_shape, _) in _tensor_shapes(_safetensors_files(base_folder)).items():
        if ".layers." not in key or not key.endswith(".weight") or len(base_shape) != 2:
            continue  # norms, embeddings and the head stay in full precision
        prefix = key.removesuffix(".weight")
        out_features, in_features = base_shape
        expected = {"qweight": ((in_features, out_features // PACK_FACTOR), "I32"),
                    "scales": ((in_features // awq_cfg.group_size, out_features), None)}
        for part, (shape, dtype) in expected.items():
            found = shapes.get(f"{prefix}.{part}")
            if found is None or found[0] != shape or (dtype and found[1] != dtype):
                raise AWQCheckpointError(
                    f"{folder}: {prefix}.{part} is {found or 'missing'}, expected shape {shape} for the "
                    f"{base_shape} linear of {base_folder.name}; the checkpoint is not this model's int4 weights"
                )


def _check_config(config_file: Path, base_folder: Path, awq_cfg: AWQConfig) -> None:
    hf, base_hf = read_json(config_file), read_json(base_folder / "config.json")
    qc = hf.get("quantization_config") or {}
    want = {"quant_method": "awq", "bits": awq_cfg.bits, "group_size": awq_cfg.group_size,
            "zero_point": awq_cfg.zero_point, "version": "gemm"}
    got = {**{f: hf.get(f) for f in SHAPE_FIELDS}, **{k: qc.get(k) for k in want}}
    want = {**{f: base_hf.get(f) for f in SHAPE_FIELDS}, **want}
    wrong = [f"{k}: checkpoint has {got[k]!r}, expected {want[k]!r}" for k in want if got[k] != want[k]]
    if wrong:
        raise AWQCheckpointError(
            f"{config_file} does not match {base_folder.name} with this awq config ({'; '.join(wrong)}); "
            "delete the checkpoint folder and re-quantise"
        )


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index)["weight_map"].values()))
        return [folder / name for name in names]
    return [folder / "model.safetensors"]


def _tensor_shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    shapes = {}
    for path in files:
        if not path.is_file():
            raise AWQCheckpointError(f"{path} is missing; delete the checkpoint folder and re-quantise")
        try:
            with safe_open(path, "pt") as handle:  # NOTE: reads the header; it covers the whole file
                for key in handle.keys():
                    tensor = handle.get_slice(key)
                    shapes[key] = (tuple(tensor.get_shape()), tensor.get_dtype())
        except (SafetensorError, OSError) as exc:
            raise AWQCheckpointError(
                f"{path} is not a readable safetensors file ({exc}); delete the checkpoint folder and re-quantise"
            ) from exc
    return shapes
