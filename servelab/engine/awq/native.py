"""AWQ checkpoints loaded without gptqmodel: the checkpoint's packed tensors in layers of servelab's own, served
by ATen's int4 matmul (PyTorch's tinygemm on CUDA, its CPU port on CPUs) or laid out for servelab's int4 kernel.

Why: gptqmodel's import brings pyarrow, pandas and datasets (about 7 s of a worker's start, and a tree too large for
the wheel folder an air-gapped CUDA host gets), while ATen's int4 matmul ships with torch itself.
Knows AWQ's gemm layout (through unpack.py), ATen's int4 packing on each device and how a transformers model is
built with its parameters unallocated and then filled from safetensors files. Does not know which kernel a config
asks for (load.py decides) or how a checkpoint is checked (layout.py, checkpoint.py: the caller checks first).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from servelab.engine.awq.layout import RECOPY, AWQCheckpointError, safetensors_files, tensor_shapes
from servelab.engine.awq.unpack import unpack_awq

CUDA_INNER_K_TILES = (8, 4, 2)  # NOTE: tinygemm's k tiles per packed word: the widest the inputs divide is fastest
CUDA_GROUP_SIZES = (32, 64, 128, 256)


def aten_int4_reason(device: torch.device) -> str | None:
    """Why ATen's int4 matmul cannot serve on this device, or None."""
    if device.type == "cuda":
        if torch.version.hip:  # NOTE: ROCm's port packs outputs in groups of 16 and needs CDNA2: not checked here
            return "ATen's int4 matmul on ROCm is not one servelab checks: install gptqmodel for its kernels"
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            return (f"ATen's int4 matmul on CUDA (tinygemm) needs compute capability 8.0 or newer (bf16 tensor cores); "
                    f"this GPU has {major}.{minor}: install gptqmodel for its kernels")
        return None
    if device.type == "cpu":
        return None
    return f"ATen's int4 matmul runs on CPUs and CUDA GPUs, not on {device.type}"


class AwqAtenLinear(torch.nn.Module):
    """One AWQ int4 layer: its checkpoint tensors (qweight, qzeros, scales in the gemm layout) until packed once for
    ATen's int4 matmul on their device (at load, or by its first forward). Before that, servelab's decoder may take
    the gemm tensors instead: several layers' joined and packed as one matmul (Int4Linear), or laid out for its own
    CPU int4 kernel; it then never calls this layer.

    ATen computes w = (q - 8) * scale + zero in bf16; AWQ's w = (q - z) * s is the same with scale = s rounded to
    bf16 (a relative 2^-9 at most) and zero = (8 - z) * scale, so that only the zero's own rounding is added."""

    bits = 4

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups, words = in_features // group_size, out_features // 8
        self.register_buffer("qweight", torch.empty((in_features, words), dtype=torch.int32, device="meta"))
        self.register_buffer("qzeros", torch.empty((groups, words), dtype=torch.int32, device="meta"))
        self.register_buffer("scales", torch.empty((groups, out_features), dtype=torch.float16, device="meta"))
        self.register_buffer("bias", torch.empty(out_features, device="meta") if bias else None)
        self.linear_mode: str | None = None  # NOTE: "inference" once packed for ATen, as gptqmodel's ATen layers say

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"

    @torch.no_grad()
    def pack(self) -> None:
        """The gemm tensors -> ATen's packed weight and its (groups, out, 2) bf16 scales and zeros (the gemm ones
        freed)."""
        if self.linear_mode == "joined":
            raise RuntimeError(f"{self.extra_repr()}: this layer's weights were packed into a joined matmul of "
                               "servelab's decoder and freed; load the model again to call it")
        if self.linear_mode is not None:
            return
        packed, scales_and_zeros = aten_pack(*unpack_awq(self.qweight, self.qzeros, self.scales))
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.qweight = packed
        del self.qzeros, self.scales
        self.linear_mode = "inference"

    def free_joined(self) -> int:
        """The gemm tensors dropped once a joined matmul holds their values (the only copy from then on) -> bytes."""
        freed = sum(t.untyped_storage().nbytes() for t in (self.qweight, self.qzeros, self.scales))
        for name in ("qweight", "qzeros", "scales"):
            setattr(self, name, torch.empty(0, dtype=getattr(self, name).dtype, device=self.qweight.device))
        self.linear_mode, self.freed_bytes = "joined", freed
        return freed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.pack()
        out = aten_int4_matmul(x.reshape(-1, self.in_features), self.qweight, self.group_size, self.scales_and_zeros)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out + self.bias.to(out.dtype) if self.bias is not None else out


def aten_layout_reason(out_features: int, in_features: int, group: int, device: torch.device) -> str | None:
    """Why ATen's int4 packing cannot take a weight of this shape on this device, or None."""
    if (reason := aten_int4_reason(device)) is not None:
        return reason
    if device.type == "cuda":
        if _cuda_inner_k_tiles(in_features) is None or group not in CUDA_GROUP_SIZES or out_features % 8:
            return (f"ATen's int4 matmul on CUDA takes inputs in multiples of 32, outputs in multiples of 8 and groups "
                    f"of {', '.join(map(str, CUDA_GROUP_SIZES))}: {in_features} inputs, {out_features} outputs, "
                    f"group {group}")
    elif out_features % 16:
        return f"ATen's int4 matmul on CPUs takes outputs in multiples of 16: {out_features}"
    return None


def _cuda_inner_k_tiles(in_features: int) -> int | None:
    return next((t for t in CUDA_INNER_K_TILES if in_features % (t * 16) == 0), None)


@torch.no_grad()
def aten_pack(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
              group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 values (out, in), zero points and scales (groups, out) -> (ATen's packed weight for their device, its
    (groups, out, 2) bf16 scales and zeros). Pack the joined values of several layers, never join packed weights:
    ATen's CPU packing interleaves outputs in blocks of 64."""
    out_features, in_features = q.shape
    if (reason := aten_layout_reason(out_features, in_features, group, q.device)) is not None:
        raise RuntimeError(reason)
    if q.device.type == "cuda":
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # NOTE: on CUDA the even input in the high nibble
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), _cuda_inner_k_tiles(in_features))
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    scales = scales.to(torch.bfloat16).float()  # NOTE: the zero from the rounded scale: w = (q - z) * bf16(s)
    return packed, torch.stack([scales, (8 - zeros.float()) * scales], dim=-1).to(torch.bfloat16)


def aten_int4_matmul(rows: torch.Tensor, packed: torch.Tensor, group_size: int,
                     scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """rows (M, K) @ the packed int4 weight's transpose -> (M, N) bf16, through ATen's op for the weight's device."""
    op = (torch.ops.aten._weight_int4pack_mm if packed.device.type == "cuda"
          else torch.ops.aten._weight_int4pack_mm_for_cpu)
    return op(rows.to(torch.bfloat16).contiguous(), packed, group_size, scales_and_zeros)


@contextlib.contextmanager
def parameters_unallocated():
    """Build modules with every parameter on the meta device (no memory, no init) and every buffer real, so a
    model's computed buffers (rotary frequencies) hold their values while its weights wait for the checkpoint's."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def load_native(folder: Path, device: torch.device, dtype: torch.dtype, attn_implementation: str,
                group_size: int) -> PreTrainedModel:
    """The AWQ checkpoint in `folder` (checked by the caller) as a transformers model whose layer linears are
    AwqAtenLinear layers holding the checkpoint's tensors; everything else in `dtype`, on `device`."""
    config = AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # NOTE: the layers are servelab's: transformers must not look for gptqmodel
    files = safetensors_files(folder, fix=RECOPY)
    with parameters_unallocated():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    modules = dict(model.named_modules())
    packed = sorted(key.removesuffix(".qweight") for key in tensor_shapes(files, fix=RECOPY)
                    if key.endswith(".qweight"))
    for prefix in packed:
        parent_name, _, child = prefix.rpartition(".")
        linear = modules.get(prefix)
        if not isinstance(linear, torch.nn.Linear):
            raise AWQCheckpointError(f"{folder}: {prefix}.qweight packs a layer {type(model).__name__} does not "
                                     "have as a linear layer; the checkpoint is not this architecture's")
        if device.type == "cuda" and (reason := aten_layout_reason(
                linear.out_features, linear.in_features, group_size, device)) is not None:
            raise AWQCheckpointError(f"{folder}: {prefix} cannot be served on {device}: {reason}")
        layer = AwqAtenLinear(linear.in_features, linear.out_features, group_size, linear.bias is not None)
        setattr(modules[parent_name] if parent_name else model, child, layer)
    modules = dict(model.named_modules())
    seen = set()
    for path in files:
        with safe_open(path, "pt", device=str(device)) as handle:
            for key in handle.keys():
                owner, _, name = key.rpartition(".")
                module = modules.get(owner)
                if module is not None and name in module._non_persistent_buffers_set:
                    continue  # NOTE: computed by the model (rotary frequencies), as transformers ignores them
                if module is None or not (name in module._parameters or name in module._buffers):
                    raise AWQCheckpointError(f"{path}: {key} is no tensor of {type(model).__name__}; the checkpoint is "
                                             "not this architecture's")
                tensor, held = handle.get_tensor(key), getattr(module, name)
                if held is not None and tuple(tensor.shape) != tuple(held.shape):
                    raise AWQCheckpointError(f"{path}: {key} is {tuple(tensor.shape)}, {type(model).__name__} of "
                                             f"this config.json takes {tuple(held.shape)}; the checkpoint is not this "
                                             "model's")
                if name in module._parameters:
                    module._parameters[name] = torch.nn.Parameter(tensor.to(dtype), requires_grad=False)
                else:  # NOTE: AWQ's packed tensors keep their dtype; a bias follows the serving dtype
                    module._buffers[name] = tensor.to(dtype) if isinstance(module, AwqAtenLinear) and name == "bias" \
                        else tensor
                seen.add(key)
    head = model.get_output_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) and head is not None and head.weight.device.type == "meta":
        head.weight = model.get_input_embeddings().weight
    missing = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.device.type == "meta"]
    if missing:
        raise AWQCheckpointError(f"{folder}: {missing[0]} is not in the checkpoint ({len(missing)} tensors missing); "
                                 f"{RECOPY}")
    for module in model.modules():  # NOTE: the computed buffers (rotary frequencies) were made on the CPU
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval().requires_grad_(False)
