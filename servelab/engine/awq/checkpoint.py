"""A config's int4 checkpoint: the cache slot `servelab quantize` fills, the record inside it, and checking it; or
the published AWQ checkpoint the config's model names, which its awq section must state.

Knows the cache key (base model fingerprint, method, quant and calibration settings), that a cached checkpoint must
match its base model, and that a bad checkpoint raises, never falls back to full precision. Does not know how a
checkpoint is made (quantizing.py) or served (load.py); what a folder's files say is layout.py.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from servelab.config import AWQConfig, ServingConfig
from servelab.engine.awq.layout import (
    AWQCheckpointError,
    AWQLayout,
    packed_tensors,
    published_layout,
    read_json,
    safetensors_files,
    tensor_shapes,
)
from servelab.engine.model_files import resolve_model_folder
from servelab.settings import Settings

QuantMethod = Literal["awq", "rtn"]

# base config fields a checkpoint must share with its base model
SHAPE_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "vocab_size",
)
RECORD_FILE = "servelab_quantize.json"


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
    """The folder of this config's int4 checkpoint: a published AWQ checkpoint's own folder, else the cache folder of
    the checkpoint `servelab quantize` makes from the config's model (which may not exist yet)."""
    awq_section(config)  # NOTE: a config without an awq section is refused before its model is resolved
    base_folder = Path(resolve_model_folder(config.model, settings))
    if published_layout(base_folder) is not None:
        return base_folder
    return checkpoint_slot(config, settings, base_folder, method=method).folder


def check_config_states(config: ServingConfig, folder: Path, layout: AWQLayout, *,
                        method: QuantMethod | None = None) -> None:
    """A published checkpoint is served as it is: the config's awq section must state its layout (bits, group size,
    zero point), so that the config stored with every run says which weights served it; awq.method names how servelab
    quantises, so rtn is refused. The calibration fields are not read."""
    awq_cfg = awq_section(config)
    if (method or awq_cfg.method) != "awq":
        raise AWQCheckpointError(
            f"config {config.name!r}: awq.method {method or awq_cfg.method!r} asks servelab to quantise, but {folder} is "
            "a published AWQ checkpoint, served as it is: leave awq.method at 'awq', or name a full-precision model"
        )
    wrong = {field: value for field, value in asdict(layout).items() if getattr(awq_cfg, field) != value}
    if wrong:
        said = "; ".join(f"awq.{f} is {getattr(awq_cfg, f)!r}, the checkpoint's {v!r}" for f, v in wrong.items())
        fix = ", ".join(f"{f}: {json.dumps(v)}" for f, v in wrong.items())
        raise AWQCheckpointError(
            f"config {config.name!r}: {said} ({folder / 'config.json'}): set awq {{{fix}}} so the config states the "
            "weights it serves"
        )


def _base_fingerprint(base_folder: Path) -> dict:
    # NOTE: name + config + weight bytes, not the path: the same model under another cache_dir
    # (relative or absolute) must find the same checkpoint.
    weight_bytes = sum(p.stat().st_size for p in sorted(base_folder.glob("*.safetensors")))
    config_sha = hashlib.sha256((base_folder / "config.json").read_bytes()).hexdigest()[:16]
    return {"name": base_folder.name, "config_sha": config_sha, "weight_bytes": weight_bytes}


def validate_checkpoint(folder: Path, base_folder: Path, awq_cfg: AWQConfig) -> None:
    """Raise AWQCheckpointError naming the file unless `folder` is an int4 GEMM checkpoint of this base
    model with these quant settings, every base linear layer present as packed qweight/qzeros/scales."""
    _check_config(folder / "config.json", base_folder, awq_cfg)
    shapes = tensor_shapes(safetensors_files(folder))
    for key, (base_shape, _) in tensor_shapes(safetensors_files(base_folder)).items():
        if ".layers." not in key or not key.endswith(".weight") or len(base_shape) != 2:
            continue  # norms, embeddings and the head stay in full precision
        prefix = key.removesuffix(".weight")
        out_features, in_features = base_shape
        for part, (shape, dtype) in packed_tensors(in_features, out_features, awq_cfg.group_size).items():
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
