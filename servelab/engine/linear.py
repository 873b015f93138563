"""Dense matmuls for servelab's decoder: which kernel serves a weight, and the weight in its layout.

Kernels, fastest first on an AVX-512 CPU (`servelab bench steps` measures each): 'servelab' (its own
kernel, kernels/avx512.cpp: weights in 16-output blocks read as one stream, near the memory
bandwidth at small batch), 'onednn' (oneDNN's matmul on weights pre-packed once) and 'torch'
(F.linear: MKL on CPU, cuBLAS on GPU). 'auto' takes the first that serves the device and dtype; a kernel
named explicitly that cannot serve them is an error that says why. Does not know models.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from servelab.engine.kernels import BLOCK, BlockedKernel, load_blocked_kernel
from servelab.engine.loader import ModelLoadError

LINEAR_KERNELS = ("auto", "servelab", "onednn", "torch")


class LinearKernelError(ModelLoadError):
    """The configured linear kernel cannot serve this device or dtype (a config that cannot be served here)."""


def onednn_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"oneDNN packing is for CPUs (device {device})"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN packing covers fp32 and bf16 (dtype {dtype})"
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return "this torch build has no oneDNN linear"
    return None


def servelab_reason(device: torch.device, dtype: torch.dtype, blocked: BlockedKernel) -> str | None:
    if device.type != "cpu":
        return f"servelab's kernel is for CPUs (device {device})"
    if blocked.module is None:
        return blocked.reason
    if not blocked.supports(dtype):
        return f"servelab's kernel has no {dtype} path on this CPU (fp32, and bf16 with AVX-512 BF16)"
    return None


@dataclass(frozen=True)
class LinearKernel:
    name: str  # 'servelab' | 'onednn' | 'torch'
    blocked: BlockedKernel | None = None

    def make(self, weight: torch.Tensor, bias: torch.Tensor | None):
        # NOTE: torch's kernel reads the weights where they are; the others lay out their own copy
        weight, bias = weight.detach(), bias.detach() if bias is not None else None
        if self.name == "servelab" and (weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0):
            return BlockedLinear(self.blocked, weight, bias)
        if self.name in ("servelab", "onednn"):  # NOTE: bf16 with an odd K: oneDNN serves that weight
            return OneDNNLinear(weight, bias)
        return TorchLinear(weight, bias)


def choose_linear_kernel(choice: str, *, device: torch.device, dtype: torch.dtype, cache_dir: Path) -> LinearKernel:
    if choice not in LINEAR_KERNELS:
        raise LinearKernelError(f"unknown linear kernel {choice!r}; allowed: {', '.join(LINEAR_KERNELS)}")
    if choice in ("auto", "servelab") and device.type == "cpu":
        blocked = load_blocked_kernel(cache_dir)
        reason = servelab_reason(device, dtype, blocked)
        if reason is None:
            return LinearKernel("servelab", blocked)
        if choice == "servelab":
            raise LinearKernelError(f"linear_kernel 'servelab' cannot run here: {reason}")
    if choice in ("auto", "onednn"):
        reason = onednn_reason(device, dtype)
        if reason is None:
            return LinearKernel("onednn")
        if choice == "onednn":
            raise LinearKernelError(f"linear_kernel 'onednn' cannot run here: {reason}")
    return LinearKernel("torch")


class TorchLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class OneDNNLinear:
    """Weights reordered once into oneDNN's blocked layout (the hint is a batch size; any batch is correct)."""

    PACK_BATCH_SIZE = 16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, self.PACK_BATCH_SIZE)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class BlockedLinear:
    """servelab's kernel; N is padded with zero rows to a multiple of 16, and the padding cut off again."""

    def __init__(self, blocked: BlockedKernel, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.kernel = blocked.module
        self.out_features = weight.shape[0]
        padding = -self.out_features % BLOCK
        if padding:
            weight = torch.cat([weight, weight.new_zeros(padding, weight.shape[1])])
        self.weight = self.kernel.pack(weight.contiguous())
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel.linear(x.reshape(-1, x.shape[-1]).contiguous(), self.weight)  # (M, N padded)
        y = y[:, : self.out_features].reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


class Int4Linear:
    """int4 weights (AWQ, after gptqmodel's CPU transform) through ATen's int4 CPU matmul, several
    projections of one input as one call: their packed rows and scales are joined along the outputs."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.group_size = modules[0].group_size
        self.weight = torch.cat([m.qweight for m in modules])  # (N, K / 2) uint8, one row per output
        self.scales_and_zeros = torch.cat([m.scales_and_zeros for m in modules], dim=1)  # (K / group, N, 2)
        self.out_features = sum(m.out_features for m in modules)

    @staticmethod
    def covers(modules: list[torch.nn.Module]) -> bool:
        """gptqmodel's ATen AWQ layers already switched to the CPU int4 layout (the load runs one forward)."""
        return all(getattr(m, "linear_mode", None) == "inference" and hasattr(m, "scales_and_zeros")
                   and getattr(m, "bias", None) is None and m.group_size == modules[0].group_size for m in modules)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # NOTE: the int4 kernel computes in bf16
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight, self.group_size, self.scales_and_zeros)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
