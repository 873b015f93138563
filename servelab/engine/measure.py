"""Measures memory from real tensors and the process: weights, the KV cache, peak working memory.

Knows how to read tensor storage (shared storage counted once),
CUDA's allocator peaks and Linux's resident high-water mark (reset through /proc/self/clear_refs).
"""

from __future__ import annotations

import resource
from pathlib import Path

import torch


def tensor_storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes held, each storage once; an opaque tensor (oneDNN's packed weights) by its elements."""
    seen: dict[int, int] = {}
    opaque = 0
    for t in tensors:
        if t.layout != torch.strided:
            opaque += t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()) + opaque


def return_freed_memory() -> None:
    """Hand memory freed inside the heap back to the OS (glibc's malloc_trim), so resident memory is what the
    process still holds: after the decoder lays its weights out and transformers' copies are emptied, glibc
    would otherwise keep the freed pages. A no-op where there is no glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def weight_bytes(model: torch.nn.Module) -> int:
    return tensor_storage_bytes([*model.parameters(), *model.buffers()])


class PeakMemory:
    """Peak memory over a block: CUDA allocator stats on GPU, the process's VmHWM on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start_bytes = 0
        self.peak_bytes = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
        else:
            _reset_rss_peak()
            self.start_bytes = _proc_status_bytes("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self.peak_bytes = _proc_status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    @property
    def working_bytes(self) -> int:
        return max(0, self.peak_bytes - self.start_bytes)


def _reset_rss_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # NOTE: "5" resets VmHWM to the current RSS
    except OSError:
        pass  # not Linux, or not allowed: VmHWM is then the process-lifetime peak


def _proc_status_bytes(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
