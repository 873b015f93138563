"""gptqmodel on this machine: importing it with a worker pool the cores allow, two CPU speed patches
to its AWQ search (a batched clip search, linear layers computing 16-bit inputs in fp32), and its per-run logs kept
under servelab's state folder (it writes them into ./logs of whatever folder the command runs in).

Knows gptqmodel 7.6's internals that the patches replace. Does not know checkpoints, calibration text or
serving; the patches hold only while quantising (cpu_search), never while loading.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


def import_gptqmodel():
    # NOTE: gptqmodel 7.6 sizes its CPU worker pool at cpu_count // 2 but asks 2 workers for loading:
    # on a 2-core machine that raises at once unless the pool has at least 2 (GPTQMODEL_CPU_WORKERS).
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(min(12, max(2, ((os.cpu_count() or 1) + 1) // 2))))
    # NOTE: gptqmodel logs through logbar's shared logger, which sets itself to INFO when first made: made here
    # first and kept at ERROR, so its banner, GIL advice, ENV and kernel lines stay out of every worker's output
    from logbar import LogBar

    LogBar.shared().setLevel(logging.ERROR)
    import gptqmodel

    return gptqmodel


@contextmanager
def run_logs_in(folder: Path) -> Iterator[None]:
    """gptqmodel's per-run log files (a table per quantised layer) written under `folder` while quantising."""
    # NOTE: gptqmodel 7.6 names its folder once, as a module constant (looper/loop_processor.py: Path("logs"))
    import_gptqmodel()  # NOTE: first, with its worker pool and quiet logger
    from gptqmodel.looper import loop_processor

    before = loop_processor._PROJECT_LOG_DIR
    loop_processor._PROJECT_LOG_DIR = folder
    try:
        yield
    finally:
        loop_processor._PROJECT_LOG_DIR = before


@contextmanager
def cpu_search() -> Iterator[None]:
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

    from logbar import LogBar

    # NOTE: gptqmodel's layer lines ("Quantizing layer I of N") are the progress `servelab quantize` shows (its
    # output goes to a log file): logged while quantising, quiet again after (import_gptqmodel's ERROR)
    bar = LogBar.shared()
    level = bar.level
    bar.setLevel(logging.INFO)
    AWQProcessor._compute_best_clip, torch.nn.Linear.forward = batched_best_clip, linear_in_fp32
    try:
        yield
    finally:
        AWQProcessor._compute_best_clip, torch.nn.Linear.forward = original_clip, original_linear
        bar.setLevel(level)


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
