"""Dense matmuls for servelab's decoder: which kernel serves a weight, and the weight in its layout.

Kernels: 'servelab' (its own, kernels/blocked.cpp: weights in 16-output blocks read as one stream; the
widest build this CPU runs, or a build named: 'servelab-avx512', 'servelab-avx2'), 'onednn' (oneDNN's
matmul on weights pre-packed once) and 'torch' (F.linear: MKL or oneDNN on CPU, cuBLAS on GPU). Which
is fastest depends on the CPU (vendor, AVX-512, AMX, native bf16), the dtype and the number of rows, and
no flag says it: measured here, MKL's fp32 GEMV beats servelab's kernel at one row on an Intel Xeon and
loses to it by 2x on an AMD EPYC; AMX makes oneDNN's bf16 the fastest at 16+ rows. So 'auto' runs every
kernel this CPU can run at 1, 16 and 64 rows on the model's own matrix shapes, as many bytes of them as
a decode step reads (a few seconds; see `measured_shapes`: a set that fits in the CPU's cache measures
the cache, not the memory), keeps the result in the cache per CPU, threads, dtype and shapes, and serves
each batch with the kernel that won at its size among the kernels that share one layout of the weights
(one copy per process: `one_layout_winners`). A kernel named explicitly that cannot run here is refused
with the reason, before any model is loaded (`linear_kernel_reason`). Does not know models. Past 400 lines as
one piece: `auto` measures exactly the layouts it would then serve, so the choice and the layouts change together.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
from bisect import bisect_left
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from servelab.engine.kernels import BLOCK, BlockedKernel, cpu_flags, last_level_cache_bytes, load_blocked_kernel
from servelab.engine.loader import ModelLoadError, file_lock

log = logging.getLogger(__name__)

LINEAR_KERNELS = ("auto", "servelab", "servelab-avx512", "servelab-avx2", "onednn", "torch")
MEASURED_ROWS = (1, 16, 64)  # 'auto' measures at these row counts ...
ROW_LIMITS = (4, 32, None)  # ... and serves up to this many rows with each one's winner
LABELS = {"onednn": "oneDNN pre-packed", "torch": "torch F.linear", "torch-on-blocked": "torch matmul on the blocked layout"}

Linear = Callable[[torch.Tensor], torch.Tensor]


class LinearKernelError(ModelLoadError):
    """The configured linear kernel cannot serve this device or dtype (a config that cannot be served here)."""


@lru_cache(maxsize=None)
def _onednn_bf16_reason() -> str | None:
    """oneDNN decides by itself whether it runs bf16 on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): ask it."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError as exc:
        return f"oneDNN runs no bf16 on this CPU ({str(exc).splitlines()[0]})"
    return None


def onednn_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"oneDNN packing is for CPUs (device {device})"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN packing covers fp32 and bf16 (dtype {dtype})"
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return "this torch build has no oneDNN linear"
    return _onednn_bf16_reason() if dtype == torch.bfloat16 else None


def _servelab_build(choice: str, device: torch.device, dtype: torch.dtype,
                    cache_dir: Path) -> tuple[BlockedKernel | None, str | None]:
    """-> (the build, None), or (None, why it cannot serve)."""
    if device.type != "cpu":
        return None, f"servelab's kernel is for CPUs (device {device})"
    if dtype not in (torch.float32, torch.bfloat16):
        return None, f"servelab's kernel covers fp32 and bf16 (dtype {dtype})"
    blocked = load_blocked_kernel(cache_dir, choice.removeprefix("servelab-") if "-" in choice else None)
    return (blocked, None) if blocked.module is not None else (None, blocked.reason)


def linear_kernel_reason(choice: str, *, device: torch.device, dtype: torch.dtype, cache_dir: Path) -> str | None:
    """Why the configured kernel cannot run here, or None; 'auto' always runs (torch's F.linear at worst)."""
    if choice not in LINEAR_KERNELS:
        return f"unknown linear kernel {choice!r}; allowed: {', '.join(LINEAR_KERNELS)}"
    if choice.startswith("servelab"):
        return _servelab_build(choice, device, dtype, cache_dir)[1]
    if choice == "onednn":
        return onednn_reason(device, dtype)
    return None


def check_linear_kernel(choice: str, *, device: torch.device, dtype: torch.dtype, cache_dir: Path) -> None:
    """Refuse a kernel that cannot run here, with the reason (before a model loads, and when one is served)."""
    reason = linear_kernel_reason(choice, device=device, dtype=dtype, cache_dir=cache_dir)
    if reason is not None:
        raise LinearKernelError(reason if choice not in LINEAR_KERNELS
                                else f"linear_kernel {choice!r} cannot run here: {reason}")


@dataclass(frozen=True)
class LinearKernel:
    """What serves the dense weights: one kernel, or ('auto') the measured best per number of rows."""

    name: str  # 'servelab' | 'onednn' | 'torch' | 'auto'
    blocked: BlockedKernel | None = None  # servelab's build, when one serves (its attention and norm too)
    by_rows: tuple[tuple[int | None, str], ...] = ()  # auto: (up to this many rows or None, kernel), ascending
    blocked_by_rows: tuple[tuple[int | None, str], ...] = ()  # auto: the same within servelab's layout

    def for_tied_head(self) -> LinearKernel:
        """A head tied to the embedding stays in servelab's blocked layout, where the embedding is read from it
        (one table, not two), whichever layout the other weights take."""
        if self.name == "auto" and self.blocked_by_rows and self.by_rows != self.blocked_by_rows:
            return LinearKernel("auto", self.blocked, self.blocked_by_rows, self.blocked_by_rows)
        return self

    @property
    def kernels(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(k for _, k in self.by_rows)) if self.by_rows else (self.name,)

    @property
    def label(self) -> str:
        if not self.by_rows:
            return self._label(self.name)
        if len(self.kernels) == 1:
            return f"{self._label(self.kernels[0])} (auto, measured)"
        parts, low = [], 1
        for rows, kernel in _merged(self.by_rows):
            span = f"{low}+" if rows is None else f"{low}-{rows}"
            parts.append(f"{span} rows {self._label(kernel)}")
            low = (rows or 0) + 1
        return "auto, measured: " + ", ".join(parts)

    def _label(self, name: str) -> str:
        if name == "servelab" and self.blocked:
            return self.blocked.label
        return LABELS["torch-on-blocked" if name == "torch" and self._torch_on_blocked() else name]

    def _torch_on_blocked(self, dtype: torch.dtype = torch.float32) -> bool:
        """'auto' with servelab's build, fp32: torch's matmul reads servelab's blocked layout (N/16, K, 16) as
        N/16 products of (M, K) x (K, 16), so both kernels serve from one copy of the weights. Measured on
        an AVX2 EPYC (24 of the bundled model's matrices, one thread): 74 ms against F.linear's 130 at 64
        rows, 446 against 442 at 256, so 'auto' measures this, not F.linear, as its torch candidate."""
        return self.name == "auto" and self.blocked is not None and dtype == torch.float32

    def make(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        # NOTE: torch's kernel reads the weights where they are; the others lay out their own copy
        weight, bias = weight.detach(), bias.detach() if bias is not None else None
        if not self.by_rows:
            return self._make_one(self.name, weight, bias)
        if self._torch_on_blocked(weight.dtype) and set(self.kernels) == {"servelab", "torch"}:
            blocked = BlockedLinear(self.blocked, weight, bias)  # one copy for both
            linears = {"servelab": blocked, "torch": BlockedMatmulLinear(blocked)}
        else:
            linears = {kernel: self._make_one(kernel, weight, bias) for kernel in self.kernels}
        if len(linears) == 1:
            return next(iter(linears.values()))
        merged = _merged(self.by_rows)
        return RowDispatchLinear([rows for rows, _ in merged[:-1]], [linears[k] for _, k in merged])

    def _make_one(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        if name == "torch" and self._torch_on_blocked(weight.dtype):
            return BlockedMatmulLinear(BlockedLinear(self.blocked, weight, bias))
        if name == "servelab" and (weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0):
            return BlockedLinear(self.blocked, weight, bias)
        if name in ("servelab", "onednn") and onednn_reason(weight.device, weight.dtype) is None:
            return OneDNNLinear(weight, bias)  # NOTE: bf16 with an odd K: oneDNN serves that weight
        return TorchLinear(weight, bias)


def measured_shapes(weights: list[torch.Tensor]) -> tuple[tuple[int, int], ...]:
    """The (N, K) of the dense weights a decode step reads, in order, up to as many bytes as the model has
    or twice the CPU's largest cache, whichever is less (at most 1 GiB): the measurement then meets the
    same caches and memory as a decode step does, and stays bounded for large models."""
    llc = last_level_cache_bytes() or 128 << 20
    limit, total, shapes = min(2 * llc, 1 << 30), 0, []
    for w in weights:
        if total >= limit:
            break
        shapes.append((w.shape[0], w.shape[1]))
        total += w.numel() * w.element_size()
    return tuple(shapes)


def _merged(by_rows: tuple[tuple[int | None, str], ...]) -> list[tuple[int | None, str]]:
    """Adjacent row ranges served by the same kernel, as one."""
    out: list[tuple[int | None, str]] = []
    for rows, kernel in by_rows:
        if out and out[-1][1] == kernel:
            out[-1] = (rows, kernel)
        else:
            out.append((rows, kernel))
    return out


def choose_linear_kernel(choice: str, *, device: torch.device, dtype: torch.dtype, cache_dir: Path,
                         shapes: tuple[tuple[int, int], ...] = ((1536, 576), (576, 1536))) -> LinearKernel:
    """The kernel for this config; 'auto' measures (or reads the cached measurement for) `shapes`, (N, K)."""
    check_linear_kernel(choice, device=device, dtype=dtype, cache_dir=cache_dir)
    if choice in ("onednn", "torch"):
        return LinearKernel(choice)
    blocked, _ = _servelab_build("servelab" if choice == "auto" else choice, device, dtype, cache_dir)
    if choice != "auto":
        return LinearKernel("servelab", blocked)
    candidates = [k for k, ok in (("servelab", blocked is not None),
                                  ("onednn", onednn_reason(device, dtype) is None), ("torch", True)) if ok]
    if len(candidates) == 1:
        return LinearKernel(candidates[0], blocked)
    probe = LinearKernel("auto", blocked)
    record = _measured_winners(probe, candidates, dtype=dtype, shapes=shapes, cache_dir=cache_dir)
    blocked_winners = record.get("blocked_winners") or []
    return LinearKernel("auto", blocked, tuple(zip(ROW_LIMITS, record["winners"])),
                        tuple(zip(ROW_LIMITS, blocked_winners)))


def layout_families(candidates: list[str], *, torch_on_blocked: bool) -> dict[str, list[str]]:
    """The candidates grouped by the layout of the weights they read: servelab's blocked layout (with torch's
    matmul over it, fp32), oneDNN's own packed one, torch's F.linear on the checkpoint's tensor."""
    families: dict[str, list[str]] = {}
    for kernel in candidates:
        layout = "servelab" if kernel == "servelab" or (kernel == "torch" and torch_on_blocked) else kernel
        families.setdefault(layout, []).append(kernel)
    return families


def one_layout_winners(timings: dict[str, list[float]], families: dict[str, list[str]]) -> tuple[str, list[str]]:
    """The layout to keep and its fastest kernel at each measured row count. NOTE: a worker keeps one copy of its
    weights, so 'auto' never mixes two layouts: the layout kept is the one whose kernels lose least against the
    fastest measured at each row count (geometric mean of the slowdowns over the row counts)."""
    num_rows = len(next(iter(timings.values())))
    best = [min(t[i] for t in timings.values()) for i in range(num_rows)]

    def winners(layout: str) -> list[str]:
        return [min(families[layout], key=lambda k: timings[k][i]) for i in range(num_rows)]

    def slowdown(layout: str) -> float:
        ratios = [timings[k][i] / best[i] for i, k in enumerate(winners(layout))]
        return math.prod(ratios) ** (1 / len(ratios))

    layout = min(families, key=slowdown)
    return layout, winners(layout)


def _measured_winners(probe: LinearKernel, candidates: list[str], *, dtype: torch.dtype,
                      shapes: tuple[tuple[int, int], ...], cache_dir: Path) -> dict:
    """The measured choice: `winners` (the kept layout's fastest kernel at each of MEASURED_ROWS) and
    `blocked_winners` (the same within servelab's layout, for a tied head), from the cache or measured now."""
    torch_on_blocked = probe._torch_on_blocked(dtype)
    what = {"flags": sorted(cpu_flags()), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "dtype": str(dtype), "shapes": [list(s) for s in shapes], "candidates": candidates,
            "isa": probe.blocked.isa.name if probe.blocked else None, "rows": list(MEASURED_ROWS),
            "build": probe.blocked.build if probe.blocked else None,
            "torch_on_blocked": torch_on_blocked, "rule": "one layout",
            # NOTE: choices measured while servelab's kernels ran on one thread whatever the count are not reused
            "parallel": bool(probe.blocked and probe.blocked.module.parallel())}

    def measure() -> dict:
        clock = PassClock(torch.get_num_threads())
        timings = measure_kernels(probe, candidates, dtype=dtype, shapes=shapes, clock=clock)
        families = layout_families(candidates, torch_on_blocked=torch_on_blocked)
        layout, winners = one_layout_winners(timings, families)
        blocked = one_layout_winners(timings, {"servelab": families["servelab"]})[1] if "servelab" in families else None
        return {"layout": layout, "winners": winners, "blocked_winners": blocked, "seconds": timings,
                "cpu_share": clock.share}

    return _cached_choice(cache_dir, "", what, measure)


# The least share of its threads' time a process must get while it times the candidates for the choice to be cached.
# Measured on a 2-core AVX-512 EPYC (the int4 crossover): 1.00 at one thread and 0.98 at two on the idle machine;
# beside a two-thread matmul loop 0.82 and 0.49, when both int4 paths took about 60 ms instead of 0.2 and 0.6 and
# their ratio (x2.9 idle) measured x1.07 to x1.32: a choice made then is noise, and cached it would stay. The share
# is taken over the timed passes alone (PassClock): taken over the whole measurement, whose set-up (random weights,
# packing) runs on one thread, an idle 2-core AVX2 EPYC gave 0.86-0.89 at two threads, and no choice was cached there.
MIN_CPU_SHARE = 0.9


class PassClock:
    """Wall and CPU time summed over the timed passes of a measurement (`with clock:` around each), and the share of
    its threads' time the process got in them: CPU over threads x wall. Set-up between passes is left out."""

    def __init__(self, threads: int) -> None:
        self.threads, self.wall, self.cpu = threads, 0.0, 0.0

    def __enter__(self) -> PassClock:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall += time.perf_counter() - self._wall
        self.cpu += time.process_time() - self._cpu

    @property
    def share(self) -> float:
        return self.cpu / max(self.wall * self.threads, 1e-9)


def _cached_choice(cache_dir: Path, prefix: str, what: dict, measure: Callable[[], dict]) -> dict:
    """A measured choice, keyed by everything it depends on (`what`), from the cache or measured now (under a
    file lock, so workers starting together measure once) and cached with what it was measured on. A choice
    measured while the process did not get its threads' time (other processes on its cores: the CPU time of
    the measurement under MIN_CPU_SHARE of threads x wall time) serves this process but is not cached: the
    next start measures again. measure() may give that share itself ("cpu_share", from a PassClock over its timed
    passes); else it is taken over the whole call."""
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir / "kernels" / "choices" / f"{prefix}{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path.with_suffix(".lock")):
        if path.is_file():
            return json.loads(path.read_text())
        wall, cpu = time.perf_counter(), time.process_time()
        measured = measure()
        share = measured.pop("cpu_share", None)
        if share is None:  # a measure() without a PassClock: the share over the whole of it
            share = (time.process_time() - cpu) / max((time.perf_counter() - wall) * what.get("threads", 1), 1e-9)
        record = {**measured, **what, "cpu_share": round(share, 3)}
        if share >= MIN_CPU_SHARE:
            path.write_text(json.dumps(record, indent=1))
        else:
            log.warning("kernel choice %s measured on a busy machine (%.0f %% of %d thread(s)' time): used by this "
                        "process, not cached; the next start measures again", path.stem, 100 * share,
                        what.get("threads", 1))
    return record


@torch.inference_mode()
def measure_kernels(probe: LinearKernel, candidates: list[str], *, dtype: torch.dtype,
                    shapes: tuple[tuple[int, int], ...], num_rounds: int = 3,
                    clock: PassClock | None = None) -> dict[str, list[float]]:
    """The fastest of `num_rounds` passes of each kernel over all `shapes` at each of MEASURED_ROWS, kernels
    interleaved round by round; `clock` times the passes. NOTE: the minimum, not the median: on a shared machine other load only
    ever slows a pass down, so the fastest pass is the kernel's own speed."""
    torch.manual_seed(0)
    weights = [torch.randn(n, k, dtype=dtype) * 0.05 for n, k in shapes]
    linears = {name: [probe._make_one(name, w, None) for w in weights] for name in candidates}
    samples: dict[str, list[list[float]]] = {name: [[] for _ in MEASURED_ROWS] for name in candidates}
    for i, rows in enumerate(MEASURED_ROWS):
        inputs = [torch.randn(rows, k, dtype=dtype) for _, k in shapes]
        for round_idx in range(num_rounds + 1):  # the first round warms up
            for name in candidates:
                with clock or contextlib.nullcontext():
                    started = time.perf_counter()
                    for linear, x in zip(linears[name], inputs):
                        linear(x)
                if round_idx:
                    samples[name][i].append(time.perf_counter() - started)
    return {name: [min(s) for s in per_rows] for name, per_rows in samples.items()}


class RowDispatchLinear:
    """'auto' with different winners: a batch of M rows goes to the kernel measured fastest at its size."""

    def __init__(self, max_rows: list[int], linears: list[Linear]) -> None:
        assert len(linears) == len(max_rows) + 1, "one kernel per row range; the last has no upper limit"
        self.max_rows, self.linears = max_rows, linears

    takes_residual = True

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        linear = self.linears[bisect_left(self.max_rows, x.numel() // x.shape[-1])]
        return add_projection(linear, x, residual) if residual is not None else linear(x)


def add_projection(linear: Linear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + linear(x), the add fused into the matmul's output where the kernel takes it (servelab's
    kernels: one operation fewer per projection, the same values; see store_out in blocked.cpp)."""
    if getattr(linear, "takes_residual", False):
        return linear(x, residual=residual)
    return residual + linear(x)


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

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight (an embedding lookup from the blocked layout): ids (...) -> (..., K)."""
        flat = ids.reshape(-1)
        if self.weight.dim() == 3:  # fp32 (N/16, K, 16)
            out = self.weight[flat // BLOCK, :, flat % BLOCK]
        else:  # bf16: blocked16 or units of blocks interleaved (the kernel knows its build's layout)
            out = self.kernel.bf16_rows(flat.long(), self.weight)
        return out.reshape(*ids.shape, out.shape[-1])  # NOTE: -1 cannot stand for K when there are no ids

    @property
    def takes_residual(self) -> bool:
        return self.bias is None and self.out_features % BLOCK == 0

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        if residual is not None:
            assert self.takes_residual, "a residual needs unpadded outputs and no bias"
            return self.kernel.linear(rows, self.weight, residual.reshape(rows.shape[0], -1)).view_as(residual)
        y = self.kernel.linear(rows, self.weight)  # (M, N padded)
        y = y[:, : self.out_features].reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


def int4_modules_reason(modules: list[torch.nn.Module]) -> str | None:
    """Why servelab's int4 kernel cannot take these AWQ layers (as one joined matmul), or None when it can."""
    first = modules[0]
    for m in modules:
        qweight = getattr(m, "qweight", None)
        if not isinstance(qweight, torch.Tensor) or not hasattr(m, "qzeros") or not hasattr(m, "scales"):
            return f"{type(m).__name__} is not an AWQ int4 layer"
        if getattr(m, "bits", 4) != 4 or qweight.dtype != torch.int32 or qweight.shape[1] * 8 != m.out_features:
            return f"{type(m).__name__} does not hold AWQ's 4-bit gemm layout (already transformed for another kernel?)"
        if qweight.device.type != "cpu":
            return f"servelab's int4 kernel is for CPUs (device {qweight.device})"
        if m.in_features != first.in_features or m.scales.shape[0] != first.scales.shape[0]:
            return "the joined layers differ in inputs or group size"
    if first.in_features % 8 or first.in_features % first.scales.shape[0]:
        return f"{first.in_features} inputs are not a multiple of 8 and of the group size"
    return None


class ServelabInt4Linear:
    """AWQ int4 weights through servelab's own kernel (blocked.cpp, 'int4x16'), several projections of one
    input as one matmul: their outputs side by side. The AWQ tensors are unpacked and laid out once; this
    layout is then the only copy of these weights the decoder needs. Up to `int_rows` rows the kernel takes
    integer dot products on activations quantised per group to int8 (or, float_activations, fp32 FMAs on the weights
    dequantised in registers); above, torch's GEMM on the weight dequantised for the call (int4_int_rows says which
    is faster where)."""

    def __init__(self, blocked: BlockedKernel, modules: list[torch.nn.Module], int_rows: int,
                 float_activations: bool = False) -> None:
        from servelab.engine.awq.unpack import unpack_awq

        self.kernel, self.int_rows, self.float_activations = blocked.module, int_rows, float_activations
        parts = [unpack_awq(m.qweight, m.qzeros, m.scales) for m in modules]
        self.group_size = parts[0][3]
        q = torch.cat([p[0] for p in parts])  # (N, K)
        zeros = torch.cat([p[1] for p in parts], dim=1)  # (K / group, N)
        scales = torch.cat([p[2] for p in parts], dim=1)
        if scales.dtype != torch.float16 and not torch.equal(scales.half().to(scales.dtype), scales):
            raise ValueError(f"AWQ scales in {scales.dtype} that fp16 does not hold exactly: servelab's int4 kernel "
                             "keeps them in fp16, as AWQ's gemm format stores them")
        self.out_features = q.shape[0]
        padding = -self.out_features % BLOCK
        if padding:  # NOTE: zero rows with a zero scale: the padded outputs are 0 and cut off
            q = torch.cat([q, q.new_zeros(padding, q.shape[1])])
            zeros = torch.cat([zeros, zeros.new_zeros(zeros.shape[0], padding)], dim=1)
            scales = torch.cat([scales, scales.new_zeros(scales.shape[0], padding)], dim=1)
        # (N/16, K/8, 64) uint8; fp16 scales and uint8 zero points, (N/16, K/group, 16) each
        self.packed, self.scales, self.zeros = self.kernel.int4_pack(q, scales.float(), zeros.float(), self.group_size)
        biases = [getattr(m, "bias", None) for m in modules]
        self.bias = (torch.cat([b.detach().float() if b is not None else torch.zeros(m.out_features)
                                for b, m in zip(biases, modules)]) if any(b is not None for b in biases) else None)

    @property
    def takes_residual(self) -> bool:
        return self.bias is None and self.out_features % BLOCK == 0

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.packed, self.scales, self.zeros, self.bias) if t is not None]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        if residual is not None:
            assert self.takes_residual, "a residual needs unpadded outputs and no bias"
            return self.kernel.int4_linear(rows, self.packed, self.scales, self.zeros, self.group_size, self.int_rows,
                                           residual.reshape(rows.shape[0], -1),
                                           float_activations=self.float_activations).view_as(residual)
        y = self.kernel.int4_linear(rows, self.packed, self.scales, self.zeros, self.group_size, self.int_rows,
                                    float_activations=self.float_activations)
        y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


class Int8Linear:
    """An output layer quantised at load to int8 per output row (symmetric), through servelab's int8 kernel
    (blocked.cpp, 'int8x16'): the activations quantised per group to int8 as for int4, integer dot products. Half
    the bytes of bf16; a tied embedding is read from the same table (rows)."""

    def __init__(self, blocked: BlockedKernel, weight: torch.Tensor) -> None:
        self.kernel = blocked.module
        self.out_features, in_features = weight.shape
        padding = -self.out_features % BLOCK
        if padding:
            weight = torch.cat([weight, weight.new_zeros(padding, in_features)])
        self.group_size = next(g for g in (64, 32, 16, 8, 4) if in_features % g == 0)
        self.weight, self.scales = self.kernel.int8_pack(weight.detach())  # (N/16, K/4, 64) uint8, (N/16, 16)

    @property
    def takes_residual(self) -> bool:
        return self.out_features % BLOCK == 0

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.scales]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the dequantised weight (an embedding lookup): ids (...) -> (..., K) fp32, gathered from the
        interleaved layout by the kernel (int8_rows in blocked.cpp). It was ten torch operations: 134 us for one id, 1.5 %
        of an int4 batch-1 step, against 5.5 us now (x24; x11 at 512 ids; one thread, 2-core AVX2 EPYC)."""
        rows = self.kernel.int8_rows(ids.reshape(-1).long(), self.weight, self.scales)
        return rows.view(*ids.shape, rows.shape[-1])

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        if residual is not None:
            assert self.takes_residual, "a residual needs unpadded outputs"
            return self.kernel.int8_linear(rows, self.weight, self.scales, self.group_size,
                                           residual.reshape(rows.shape[0], -1)).view_as(residual)
        y = self.kernel.int8_linear(rows, self.weight, self.scales, self.group_size)[:, : self.out_features]
        return y.reshape(*x.shape[:-1], self.out_features)


INT4_MEASURED_ROWS = (16, 64, 256)


def int4_int_rows(blocked: BlockedKernel, cache_dir: Path, shapes: tuple[tuple[int, int], ...],
                  group: int, float_activations: bool = False, *, dtype: torch.dtype) -> int:
    """Up to how many rows servelab's int4 kernel streams the weights (integer dot products, or fp32 FMAs with
    float_activations) rather than a GEMM on the dequantised weight (torch's in fp32; AMX tiles for bf16 rows where
    the CPU has them): measured once per CPU, threads, shapes and activations (in `dtype`, the model's: the GEMM
    wins at many rows, where the product's arithmetic outweighs dequantising the weight once), cached like the dense
    kernels' choice. One row and few rows always stream: the weights are read once."""
    what = {"flags": sorted(cpu_flags()), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "isa": blocked.isa.name if blocked.isa else None, "shapes": [list(s) for s in shapes], "group": group,
            "build": blocked.build,
            "rows": list(INT4_MEASURED_ROWS), "kernel": "int4", "tiles": "gemm",
            "activations": "float" if float_activations else "int8", "parallel": bool(blocked.module.parallel()),
            "dtype": str(dtype)}

    def measure() -> dict:
        clock = PassClock(torch.get_num_threads())
        timings = _measure_int4(blocked, shapes, group, float_activations, clock=clock, dtype=dtype)
        int_rows = 1 << 30
        for rows, (dot, tile) in zip(INT4_MEASURED_ROWS, timings):
            if tile < dot:
                int_rows = max(4, rows // 2)
                break
        return {"int_rows": int_rows, "seconds": timings, "cpu_share": clock.share}

    return _cached_choice(cache_dir, "int4-", what, measure)["int_rows"]


@torch.inference_mode()
def _measure_int4(blocked: BlockedKernel, shapes: tuple[tuple[int, int], ...], group: int,
                  float_activations: bool = False, num_rounds: int = 3,
                  clock: PassClock | None = None, *, dtype: torch.dtype) -> list[tuple[float, float]]:
    """(streaming path, tile path) seconds over `shapes` at each of INT4_MEASURED_ROWS, the fastest of the rounds;
    `clock` times the passes."""
    kernel = blocked.module
    generator = torch.Generator().manual_seed(0)
    weights = []
    for n, k in shapes:
        q = torch.randint(0, 16, (n + -n % BLOCK, k), dtype=torch.uint8, generator=generator)
        scales = (torch.rand(k // group, q.shape[0], generator=generator) * 0.02).half().float()
        zeros = torch.randint(0, 16, scales.shape, generator=generator).float()
        weights.append(kernel.int4_pack(q, scales, zeros, group))
    out = []
    for rows in INT4_MEASURED_ROWS:
        inputs = [torch.randn(rows, k, generator=generator).to(dtype) for _, k in shapes]
        best = [float("inf"), float("inf")]
        for round_idx in range(num_rounds + 1):  # the first round warms up
            for path, int_rows in enumerate((1 << 30, 0)):
                with clock or contextlib.nullcontext():
                    started = time.perf_counter()
                    for packed, x in zip(weights, inputs):
                        kernel.int4_linear(x, *packed, group, int_rows, float_activations=float_activations)
                if round_idx:
                    best[path] = min(best[path], time.perf_counter() - started)
        out.append((best[0], best[1]))
    return out


class BlockedMatmulLinear:
    """torch's matmul over servelab's fp32 blocked layout: y = x (M, K) @ W (N/16, K, 16), blocks side by side."""

    def __init__(self, blocked: BlockedLinear) -> None:
        self.blocked = blocked
        self.weight, self.bias = blocked.weight, blocked.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        blocks, _, width = self.weight.shape
        y = torch.matmul(rows, self.weight).transpose(0, 1).reshape(rows.shape[0], blocks * width)  # (M, N padded)
        y = y[:, : self.blocked.out_features].reshape(*x.shape[:-1], self.blocked.out_features)
        return y + self.bias if self.bias is not None else y


class Int4Linear:
    """int4 weights (AWQ) through ATen's int4 matmul, several projections of one input as one call: servelab's layers
    (awq/native.py) joined while unpacked and packed once, or gptqmodel's CPU layers, already packed, joined where the
    packing allows it (ATen's CPU packing interleaves outputs in blocks of 64: a layer before another must fill its
    blocks)."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        from servelab.engine.awq.native import aten_int4_matmul, aten_pack
        from servelab.engine.awq.unpack import unpack_awq

        self.group_size = modules[0].group_size
        self.out_features = sum(m.out_features for m in modules)
        self._matmul = aten_int4_matmul
        if modules[0].linear_mode is None:  # NOTE: servelab's layers, unpacked (covers says so)
            parts = [unpack_awq(m.qweight, m.qzeros, m.scales) for m in modules]
            self.weight, self.scales_and_zeros = aten_pack(
                torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts], dim=1),
                torch.cat([p[2] for p in parts], dim=1), self.group_size)
            if self.weight.device.type == "cuda":
                # NOTE: the one copy on a GPU from here: a 70B model's int4 weights held twice until the engine
                # released them would not fit an 80 GB card (the engine counts the bytes as released)
                for m in modules:
                    m.free_joined()
        else:
            self.weight = torch.cat([m.qweight for m in modules])  # (N, K / 2) uint8, outputs leading
            self.scales_and_zeros = torch.cat([m.scales_and_zeros for m in modules], dim=1)  # (K / group, N, 2)

    @staticmethod
    def covers(modules: list[torch.nn.Module]) -> bool:
        """servelab's AWQ layers not yet packed, or ATen-packed layers whose packed weights join (the load ran one
        forward), all without a bias and at one group size."""
        from servelab.engine.awq.native import AwqAtenLinear, aten_layout_reason

        first = modules[0]
        if any(getattr(m, "bias", None) is not None or getattr(m, "group_size", None) != first.group_size
               for m in modules):
            return False
        if all(isinstance(m, AwqAtenLinear) and m.linear_mode is None for m in modules):
            return aten_layout_reason(sum(m.out_features for m in modules), first.in_features, first.group_size,
                                      first.qweight.device) is None
        return (all(getattr(m, "linear_mode", None) == "inference" and hasattr(m, "scales_and_zeros")
                    and m.qweight.device.type == "cpu" for m in modules)
                and all(m.out_features % 64 == 0 for m in modules[:-1]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x.reshape(-1, x.shape[-1]), self.weight, self.group_size, self.scales_and_zeros)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
