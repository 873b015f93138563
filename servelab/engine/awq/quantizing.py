"""Quantising a base model once into the checkpoint cache: gptqmodel's AWQ, or the round-to-nearest baseline.

Knows AWQ's settings in gptqmodel (activation-aware scale and clip search, GEMM layout, asymmetric with
zero points), staging a checkpoint so a crash leaves no trusted half, and relabelling RTN output as AWQ
GEMM. Does not know serving: quantising happens only when asked (`servelab quantize`), never while loading.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoTokenizer

from servelab.config import AWQConfig, ServingConfig
from servelab.engine.awq.calibration import calibration_windows
from servelab.engine.awq.checkpoint import (
    RECORD_FILE,
    CheckpointSlot,
    QuantizeRecord,
    QuantMethod,
    awq_section,
    checkpoint_slot,
    validate_checkpoint,
)
from servelab.engine.awq.gptq_cpu import cpu_search, import_gptqmodel, run_logs_in
from servelab.engine.awq.layout import AWQCheckpointError, published_layout, read_json
from servelab.engine.loaded_model import resolve_device
from servelab.engine.model_files import file_lock, resolve_model_folder
from servelab.settings import Settings


def quantize(
    config: ServingConfig, settings: Settings, *, method: QuantMethod | None = None,
    progress: Callable[[str], None] = print,
) -> QuantizeRecord:
    """The config's int4 checkpoint, made once (AWQ, or the RTN baseline) and reused from the cache after."""
    awq_cfg = awq_section(config)
    base_folder = Path(resolve_model_folder(config.model, settings))
    if published_layout(base_folder) is not None:  # NOTE: other quantised folders raise inside, naming their layout
        raise AWQCheckpointError(
            f"{base_folder} is already an AWQ int4 checkpoint (its config.json declares quantization_config): a config "
            "naming it with weights: awq-int4 serves it as it is; `servelab quantize` makes int4 weights from a "
            "full-precision model"
        )
    _check_group_size(base_folder, awq_cfg.group_size)
    slot = checkpoint_slot(config, settings, base_folder, method=method)
    out = slot.folder
    with file_lock(out.parent / f".{out.name}.lock"):  # NOTE: two workers asking at once quantise once
        if (out / RECORD_FILE).is_file():
            validate_checkpoint(out, base_folder, awq_cfg)
            record = QuantizeRecord(**read_json(out / RECORD_FILE))
            progress(f"reusing {slot.method} checkpoint {out} (made in {record.quantize_s:.0f} s)")
            return QuantizeRecord(**{**asdict(record), "is_reused": True})
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        with run_logs_in(Path(settings.state_dir) / "logs" / "gptqmodel"):
            record = _quantize_into(staging, config, slot, progress=progress)
        record = QuantizeRecord(**{**asdict(record), "checkpoint": str(out)})
        (staging / RECORD_FILE).write_text(json.dumps(asdict(record), indent=2) + "\n")
        validate_checkpoint(staging, base_folder, awq_cfg)
        shutil.rmtree(out, ignore_errors=True)  # a folder without a record is a leftover, never trusted
        staging.rename(out)  # NOTE: a crash before this line leaves only a .partial folder
    progress(f"wrote {slot.method} checkpoint {out} in {record.quantize_s:.0f} s")
    return record


def quantize_rtn(
    config: ServingConfig, settings: Settings, *, progress: Callable[[str], None] = print
) -> QuantizeRecord:
    """Round-to-nearest int4 at the same group size and layout: the baseline AWQ has to beat."""
    return quantize(config, settings, method="rtn", progress=progress)


def _check_group_size(base_folder: Path, group_size: int) -> None:
    hf = read_json(base_folder / "config.json")
    for field in ("hidden_size", "intermediate_size"):
        if hf.get(field, 0) % group_size:
            fits = [g for g in (32, 64, 128) if hf[field] % g == 0 and hf.get("hidden_size", 0) % g == 0]
            raise ValueError(
                f"awq.group_size {group_size} does not divide the model's {field} ({hf[field]}); "
                f"group sizes that fit {base_folder.name}: {fits}"
            )


def _quantize_into(
    staging: Path, config: ServingConfig, slot: CheckpointSlot, *, progress: Callable[[str], None],
) -> QuantizeRecord:
    gptqmodel = import_gptqmodel()
    awq_cfg, base_folder, method = slot.awq, slot.base_folder, slot.method
    device = resolve_device(config.device)
    # NOTE: packing needs a 16-bit model: fp16 on GPU, bf16 on CPU (fp16 range is tighter); on CPU
    # cpu_search makes the 16-bit search fast.
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    qcfg, calibration = _gptq_settings(slot, progress, device)
    started = time.perf_counter()
    model = gptqmodel.GPTQModel.load(str(base_folder), qcfg, dtype=dtype, device=str(device))
    backend = gptqmodel.BACKEND.AWQ_TORCH if device.type == "cpu" else gptqmodel.BACKEND.AUTO
    with cpu_search():
        model.quantize(calibration, backend=backend)
    model.save(str(staging))
    quantize_s = time.perf_counter() - started
    if method == "rtn":
        _label_as_awq_gemm(staging / "config.json", awq_cfg)
    return QuantizeRecord(
        checkpoint=str(staging), method=method, base_model=config.model, bits=awq_cfg.bits,
        group_size=awq_cfg.group_size, zero_point=awq_cfg.zero_point,
        calibration_set=awq_cfg.calibration_set if method == "awq" else None,
        num_calibration_samples=awq_cfg.num_calibration_samples if method == "awq" else 0,
        calibration_seq_len=awq_cfg.calibration_seq_len if method == "awq" else 0,
        quantize_s=round(quantize_s, 2), device=str(device),
        gptqmodel_version=importlib.metadata.version("gptqmodel"),
    )


def _gptq_settings(slot: CheckpointSlot, progress: Callable[[str], None], device: torch.device):
    """gptqmodel's quantise config for the slot's method, and the calibration rows AWQ reads (None for RTN)."""
    from gptqmodel.quantization import FORMAT
    from gptqmodel.quantization import AWQConfig as GptqAWQConfig
    from gptqmodel.quantization import RTNConfig

    awq_cfg, base_folder = slot.awq, slot.base_folder
    common = dict(bits=awq_cfg.bits, group_size=awq_cfg.group_size, sym=not awq_cfg.zero_point,
                  format=FORMAT.GEMM, offload_to_disk=False)
    if slot.method == "rtn":
        progress(f"RTN-quantising {base_folder.name} on {device}, group size {awq_cfg.group_size}")
        return RTNConfig(**common), None
    # NOTE: fallback=None: every module gets the activation-aware search, never a silent RTN fallback.
    qcfg = GptqAWQConfig(**common, fallback=None)
    tokenizer = AutoTokenizer.from_pretrained(base_folder)
    calibration = [{"input_ids": ids, "attention_mask": [1] * len(ids)}
                   for ids in calibration_windows(awq_cfg, tokenizer)]
    progress(f"AWQ-quantising {base_folder.name} on {device}: {len(calibration)} samples x "
             f"{awq_cfg.calibration_seq_len} tokens of {awq_cfg.calibration_set}, group size {awq_cfg.group_size}")
    return qcfg, calibration


def _label_as_awq_gemm(config_file: Path, awq_cfg: AWQConfig) -> None:
    # NOTE: gptqmodel's RTN writes the AWQ GEMM tensor layout (qweight (in, out/8), qzeros, scales) but
    # labels it quant_method "gptq", which transformers would route to optimum. Relabel it so the RTN
    # baseline loads through exactly the same AWQ kernel as the AWQ checkpoint.
    hf = json.loads(config_file.read_text())
    meta = hf["quantization_config"].get("meta", {})
    hf["quantization_config"] = {
        "quant_method": "awq", "bits": awq_cfg.bits, "group_size": awq_cfg.group_size,
        "zero_point": awq_cfg.zero_point, "version": "gemm", "format": "gemm", "desc_act": False,
        "pack_dtype": "int32", "meta": {**meta, "servelab_method": "rtn"},
    }
    config_file.write_text(json.dumps(hf, indent=2) + "\n")
