"""Loading an int4 checkpoint into a LoadedModel (a published AWQ checkpoint as it is, or the one cached for a
full-precision model): the serving dtype and the kernel backend.

Knows which loader serves which awq.kernel: servelab's own (native.py: ATen's int4 matmul, or servelab's CPU
kernel through the decoder; no gptqmodel) for auto on CPU, servelab and aten, and for auto on CUDA where gptqmodel
is not installed; transformers' AWQ integration (gptqmodel's kernels) for auto on CUDA beside gptqmodel and for a
gptqmodel backend named. Checks the checkpoint before trusting it. Does not know how a checkpoint is made: loading
never quantises (`servelab quantize` does), and never falls back to full precision.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from servelab.config import AWQConfig, ServingConfig
from servelab.engine.awq.checkpoint import (
    AWQCheckpointError,
    QuantMethod,
    awq_section,
    check_config_states,
    checkpoint_slot,
    validate_checkpoint,
)
from servelab.engine.awq.gptq_cpu import import_gptqmodel
from servelab.engine.awq.layout import check_published_tensors, published_layout
from servelab.engine.awq.native import aten_int4_reason, load_native
from servelab.engine.loaded_model import LoadedModel, attention_for, model_shape, resolve_device
from servelab.engine.model_files import ModelLoadError, resolve_model_folder
from servelab.settings import Settings

log = logging.getLogger(__name__)

# config.awq.kernel -> transformers AwqBackend value, for the kernels gptqmodel serves; "auto" on CUDA beside gptqmodel
# lets it pick. "servelab", "aten" and "auto" elsewhere load servelab's own layers (native.py): servelab's decoder
# lays out their AWQ tensors for its own int4 kernel ("servelab", and "auto" on CPU) or joins the ATen ones.
KERNEL_BACKENDS = {
    "auto": "auto", "servelab": "auto", "aten": "auto", "torch": "torch_awq", "triton": "gemm_triton",
    "marlin": "marlin", "gemm": "gemm", "exllama": "exllama_v2",
}


def kernel_name(model: torch.nn.Module) -> str:
    """The class name(s) of the quantised linear modules actually serving, e.g. 'TorchAtenAwqLinear'."""
    names = sorted({type(m).__name__ for m in model.modules() if isinstance(getattr(m, "qweight", None), torch.Tensor)})
    if not names:
        raise ValueError("the model has no quantised linear modules (no qweight buffers): it is not an AWQ model")
    return "+".join(names)


def serves_natively(kernel: str, device: torch.device) -> bool:
    """Whether servelab's own layers (native.py) load the checkpoint for this awq.kernel, rather than gptqmodel's."""
    if kernel == "auto":
        return device.type != "cuda" or importlib.util.find_spec("gptqmodel") is None
    return kernel in ("servelab", "aten")


def serving_dtype(device: torch.device, kernel: str = "auto") -> torch.dtype:
    """The dtype of everything around the int4 matmuls: embeddings, norms, attention, the head."""
    if device.type == "cuda":  # NOTE: what the kernels take: ATen's int4 matmul bf16, gptqmodel's CUDA kernels fp16
        return torch.bfloat16 if serves_natively(kernel, device) else torch.float16
    # NOTE: the CPU int4 kernel computes in bf16 whatever the model dtype; the rest of the model runs
    # in bf16 only where the CPU has native bf16 (AVX512-BF16 / AMX) and torch dispatches to it (not capped
    # below AVX-512 by ATEN_CPU_CAPABILITY), else at ~1/50 of fp32 speed.
    has_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    torch_uses_it = torch.backends.cpu.get_cpu_capability().upper().startswith(("AVX512", "AMX"))
    return torch.bfloat16 if has_bf16 and torch_uses_it else torch.float32


def load_awq_model(config: ServingConfig, settings: Settings, *, method: QuantMethod | None = None) -> LoadedModel:
    """Load the config's int4 checkpoint: the model folder itself where it is a published AWQ checkpoint, else the one
    `servelab quantize` made from the model (loading never quantises)."""
    started = time.perf_counter()
    if settings.hf_hub_offline:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    awq_cfg = awq_section(config)
    model_folder = Path(resolve_model_folder(config.model, settings))  # NOTE: the only resolve of this load
    folder, source = _checkpoint_to_serve(config, settings, model_folder, method)
    device = resolve_device(config.device)
    dtype = serving_dtype(device, awq_cfg.kernel)
    if serves_natively(awq_cfg.kernel, device):
        if (reason := aten_int4_reason(device)) is not None:
            raise ModelLoadError(f"config {config.name!r}: awq.kernel {awq_cfg.kernel!r} cannot serve here: {reason}")
        model = load_native(folder, device, dtype, attention_for(folder), awq_cfg.group_size)
    else:
        model = _from_pretrained(folder, device, dtype, awq_cfg)
    dense = _count_dense_layer_linears(model)
    assert not dense, f"{folder}: layers left in full precision after loading: {dense[:4]}"
    model.eval()  # NOTE: gptqmodel's CPU layers repack for ATen on their first forward: build_decoder decides
    log.info("loaded %s int4 checkpoint %s on %s in %s, kernel %s", source, folder.name, device, dtype,
             kernel_name(model))
    return LoadedModel(
        model=model, tokenizer=AutoTokenizer.from_pretrained(model_folder), device=device, dtype=dtype,
        folder=str(folder), shape=model_shape(model.config), load_s=time.perf_counter() - started,
    )


def _checkpoint_to_serve(config: ServingConfig, settings: Settings, model_folder: Path,
                         method: QuantMethod | None) -> tuple[Path, str]:
    """(the checked checkpoint folder, where it came from: 'published', or the method that made the cached one)."""
    # NOTE: the folder says which is meant: a config.json declaring AWQ is a published checkpoint, served as it is
    # (its tokenizer, no base model, no cache slot); a full-precision model is served through its cached checkpoint.
    layout = published_layout(model_folder)
    if layout is not None:
        check_config_states(config, model_folder, layout, method=method)
        check_published_tensors(model_folder, layout)
        return model_folder, "published"
    slot = checkpoint_slot(config, settings, model_folder, method=method)
    if not (slot.folder / "config.json").is_file():
        raise AWQCheckpointError(
            f"no {slot.method} int4 checkpoint for config {config.name!r} at {slot.folder}; make it first with "
            f"`servelab quantize --config <this config's YAML file>` ({model_folder} declares no quantization_config: "
            "a full-precision model)"
        )
    validate_checkpoint(slot.folder, model_folder, slot.awq)
    return slot.folder, slot.method


def _count_dense_layer_linears(model: PreTrainedModel) -> list[str]:
    return [name for name, m in model.named_modules() if ".layers." in name and type(m) is torch.nn.Linear]


def _from_pretrained(folder: Path, device: torch.device, dtype: torch.dtype, awq_cfg: AWQConfig) -> PreTrainedModel:
    import_gptqmodel()  # NOTE: first, so transformers' AWQ integration imports gptqmodel with our worker pool
    from transformers import AwqConfig as HfAwqConfig

    kwargs = {}
    if KERNEL_BACKENDS[awq_cfg.kernel] != "auto":  # NOTE: only the backend of a passed config overrides the checkpoint's
        kwargs["quantization_config"] = HfAwqConfig(
            bits=awq_cfg.bits, group_size=awq_cfg.group_size, zero_point=awq_cfg.zero_point,
            backend=KERNEL_BACKENDS[awq_cfg.kernel],
        )
    try:
        return AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, device_map={"": str(device)}, attn_implementation=attention_for(folder), **kwargs
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise AWQCheckpointError(
            f"cannot load the int4 checkpoint {folder} with kernel {awq_cfg.kernel!r}: {exc}"
        ) from exc
