"""AWQ's GEMM checkpoint layout, unpacked: the int4 values and zero points as plain (outputs, inputs) arrays.

An AWQ checkpoint (autoawq's and gptqmodel's `gemm` format) stores per quantised linear layer
`qweight` (in, out / 8) int32, `qzeros` (in / group, out / 8) int32 and `scales` (in / group, out) fp16:
each int32 holds 8 four-bit values of 8 adjacent outputs, nibble i (bits 4i..4i+3) holding output
8 j + ORDER[i] (AWQ interleaves even and odd outputs so that its CUDA kernel unpacks them in order).
A weight is w[o, k] = scales[k // group, o] * (q[o, k] - zero[k // group, o]).
Knows the layout; does not know kernels (linear.py lays the values out for servelab's own).
"""

from __future__ import annotations

import torch

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed int32 -> output offset ORDER[i] within its 8


def unpack_int32_columns(packed: torch.Tensor) -> torch.Tensor:
    """(rows, cols / 8) int32 -> (rows, cols) uint8 values 0..15, in output order."""
    rows, words = packed.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.to(torch.int32)[:, :, None] >> shifts) & 0xF  # (rows, words, 8), nibble order
    out = torch.empty_like(nibbles)
    out[:, :, list(ORDER)] = nibbles  # nibble i is output ORDER[i]
    return out.reshape(rows, words * 8).to(torch.uint8)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor,
               scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A layer's AWQ tensors -> (q (out, in) uint8, zeros (groups, out) uint8, scales (groups, out), group size)."""
    in_features, out_features = qweight.shape[0], scales.shape[1]
    if qweight.dtype != torch.int32 or qweight.shape[1] * 8 != out_features:
        raise ValueError(f"not AWQ's gemm layout: qweight {tuple(qweight.shape)} {qweight.dtype} for {out_features} outputs")
    groups = scales.shape[0]
    if in_features % groups:
        raise ValueError(f"{groups} scale groups do not divide {in_features} inputs")
    q = unpack_int32_columns(qweight).t().contiguous()  # (out, in)
    zeros = unpack_int32_columns(qzeros)[:, :out_features]
    return q, zeros, scales, in_features // groups


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """The full-precision weight (out, in) in fp32: the reference every int4 kernel is checked against."""
    z = zeros.float().repeat_interleave(group, dim=0).t()
    s = scales.float().repeat_interleave(group, dim=0).t()
    return (q.float() - z) * s
