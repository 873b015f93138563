"""What a folder's files say about its int4 weights: config.json's quantization_config read as AWQ's layout, the
safetensors headers, and the packed tensors each layer linear must hold.

Knows the layout servelab reads (AWQ int4, `version: gemm`, zero points: the layout AutoAWQ wrote and transformers /
gptqmodel read) and names the ones it does not (gemv, gemv_fast, marlin, exllama packing; other bit widths; other
quant methods). Does not know the cache (checkpoint.py), quantising (quantizing.py) or loading (load.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from servelab.engine.model_files import ModelLoadError, declared_quantization

PACK_FACTOR = 32 // 4  # int4 values per packed int32 column
REQUANTISE = "delete the checkpoint folder and re-quantise"
RECOPY = "download or copy the checkpoint again"
# AWQ versions servelab does not read -> how their tensors differ from gemm's
OTHER_VERSIONS = {
    "gemv": "qweight packed along the inputs (out, in / 8) for AutoAWQ's GEMV kernel",
    "gemv_fast": "qweight interleaved for AutoAWQ's fast GEMV kernel",
    "marlin": "tensors repacked for the Marlin kernel",
    "exllama": "tensors repacked for the ExLlama kernel",
    "llm-awq": "the original llm-awq packing",
}
GROUP_SIZES = (32, 64, 128)


class AWQCheckpointError(ModelLoadError):
    """An AWQ checkpoint that is missing, corrupt, made for another model or in a layout servelab does not read; the
    message names the file and the problem."""


@dataclass(frozen=True)
class AWQLayout:
    """A published checkpoint's declared quantisation: the fields the config's awq section must state."""

    bits: int
    group_size: int
    zero_point: bool


def published_layout(folder: Path) -> AWQLayout | None:
    """The AWQ layout a model folder declares in config.json's quantization_config, checked to be one servelab reads;
    None for a full-precision model (no quantization_config, no packed tensors). Anything else raises
    AWQCheckpointError naming the field."""
    declared = declared_quantization(folder)
    if declared is None:
        _refuse_undeclared_packing(folder)
        return None
    return _read_layout(folder / "config.json", declared)


def _read_layout(config_file: Path, qc: dict) -> AWQLayout:
    where = f"{config_file}: quantization_config"
    if (method := qc.get("quant_method")) != "awq":
        raise AWQCheckpointError(
            f"{where} has quant_method {method!r}; weights: awq-int4 serves AWQ checkpoints (quant_method 'awq', "
            "version 'gemm', bits 4) and quantises full-precision models"
        )
    # NOTE: as transformers reads it: a legacy `version` wins over `format`; AutoAWQ wrote "gemm" or "GEMM"
    version = qc.get("version", qc.get("format"))
    version = version.lower() if isinstance(version, str) else version
    if version != "gemm":
        why = OTHER_VERSIONS.get(version, "no layout servelab knows") if version is not None else "it names no layout"
        raise AWQCheckpointError(
            f"{where} has version {version!r} ({why}); servelab reads AWQ's gemm packing only (qweight (in, out / 8) "
            "int32): use the model's gemm release, or re-quantise its full-precision weights with `servelab quantize`"
        )
    bits, group_size, zero_point = qc.get("bits"), qc.get("group_size"), qc.get("zero_point")
    if bits != 4 or isinstance(bits, bool):
        raise AWQCheckpointError(f"{where} has bits {bits!r}; servelab serves 4-bit AWQ weights only")
    if group_size not in GROUP_SIZES or isinstance(group_size, bool):
        raise AWQCheckpointError(
            f"{where} has group_size {group_size!r}; servelab serves AWQ groups of {', '.join(map(str, GROUP_SIZES))}"
        )
    if zero_point is not True:
        raise AWQCheckpointError(
            f"{where} has zero_point {zero_point!r}; servelab reads AWQ's asymmetric int4 with zero points "
            "(zero_point: true, a qzeros tensor per layer)"
        )
    return AWQLayout(bits=bits, group_size=group_size, zero_point=True)


def _refuse_undeclared_packing(folder: Path) -> None:
    """A folder without quantization_config whose weights are packed int4 is a checkpoint missing its label, not a
    full-precision model to quantise."""
    files = safetensors_files(folder)
    if not (folder / "config.json").is_file() or not all(path.is_file() for path in files):
        return  # NOTE: no local weights to look at (a hub id); the loader names what is missing
    packed = [key for key in tensor_shapes(files) if key.endswith(".qweight")]
    if packed:
        side = [name for name in ("quant_config.json", "quantize_config.json") if (folder / name).is_file()]
        note = f" ({side[0]} beside it is not read: copy its fields there)" if side else ""
        raise AWQCheckpointError(
            f"{folder / 'config.json'} has no quantization_config, but {folder} holds packed int4 tensors "
            f"({packed[0]}, {len(packed)} in all): a published AWQ checkpoint declares its layout in config.json's "
            f"quantization_config (quant_method 'awq', version 'gemm', bits 4, group_size, zero_point true){note}"
        )


def packed_tensors(in_features: int, out_features: int, group_size: int) -> dict[str, tuple[tuple[int, int], str]]:
    """The gemm layout's tensors of one (out_features, in_features) linear: part -> (shape, safetensors dtype)."""
    groups = in_features // group_size
    return {"qweight": ((in_features, out_features // PACK_FACTOR), "I32"),
            "qzeros": ((groups, out_features // PACK_FACTOR), "I32"),
            "scales": ((groups, out_features), "")}  # NOTE: scales in fp16 (AutoAWQ) or bf16: either is read


def check_published_tensors(folder: Path, layout: AWQLayout) -> None:
    """Raise AWQCheckpointError naming the tensor unless every layer linear of the checkpoint is packed int4 in the
    gemm layout at the declared group size (no base model to compare with: the tensors must agree among themselves)."""
    shapes = tensor_shapes(safetensors_files(folder, fix=RECOPY), fix=RECOPY)
    fix = "its tensors are not AWQ's gemm layout its quantization_config declares"
    dense = [k for k, (shape, _) in shapes.items() if ".layers." in k and k.endswith(".weight") and len(shape) == 2]
    if dense:
        raise AWQCheckpointError(
            f"{folder}: {dense[0]} ({len(dense)} in all) is a full-precision layer linear; servelab serves every layer "
            "linear of an AWQ checkpoint in int4 (modules_to_not_convert is not read)"
        )
    prefixes = [key.removesuffix(".qweight") for key in shapes if key.endswith(".qweight")]
    if not prefixes:
        raise AWQCheckpointError(f"{folder} declares AWQ int4 in config.json but holds no packed qweight tensors; {fix}")
    for prefix in prefixes:
        (in_features, words), _ = shapes[f"{prefix}.qweight"]
        for part, (shape, dtype) in packed_tensors(in_features, words * PACK_FACTOR, layout.group_size).items():
            found = shapes.get(f"{prefix}.{part}")
            if found is None or found[0] != shape or (dtype and found[1] != dtype):
                raise AWQCheckpointError(
                    f"{folder}: {prefix}.{part} is {found or 'missing'}, expected {shape} {dtype or ''} for AWQ's "
                    f"gemm layout at group_size {layout.group_size}; {fix}"
                )


def read_json(path: Path, *, fix: str = REQUANTISE) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AWQCheckpointError(f"{path}: cannot read it as JSON ({exc}); {fix}") from exc


def safetensors_files(folder: Path, *, fix: str = REQUANTISE) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index, fix=fix)["weight_map"].values()))
        return [folder / name for name in names]
    return [folder / "model.safetensors"]


def tensor_shapes(files: list[Path], *, fix: str = REQUANTISE) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor's (shape, safetensors dtype) from the files' headers (no tensor is read)."""
    shapes = {}
    for path in files:
        if not path.is_file():
            raise AWQCheckpointError(f"{path} is missing; {fix}")
        try:
            with safe_open(path, "pt") as handle:  # NOTE: reads the header; it covers the whole file
                for key in handle.keys():
                    tensor = handle.get_slice(key)
                    shapes[key] = (tuple(tensor.get_shape()), tensor.get_dtype())
        except (SafetensorError, OSError) as exc:
            raise AWQCheckpointError(f"{path} is not a readable safetensors file ({exc}); {fix}") from exc
    return shapes
