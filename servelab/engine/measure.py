"""Measures memory from real tensors and the process: weights, the KV cache, peak working memory.

Knows how to read tensor storage (shared storage counted once),
CUDA's allocator peaks and Linux's resident high-water mark (reset through /proc/self/clear_refs).
"""

from __future__ import annotations

import torch

from servelab.engine.arena import arena_bytes
from servelab.resident import ResidentPeak


def tensor_storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes held, each storage once (a weight arena by what it holds); an opaque tensor (oneDNN's packed weights)
    by its elements."""
    seen: dict[int, int] = {}
    opaque = 0
    for t in tensors:
        if t.layout != torch.strided:
            opaque += t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        held = arena_bytes(storage)
        seen[storage.data_ptr()] = storage.nbytes() if held is None else held
    return sum(seen.values()) + opaque


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
            self._resident = ResidentPeak().__enter__()
            self.start_bytes = self._resident.start_bytes
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self._resident.__exit__(*exc)
            self.peak_bytes = self._resident.peak_bytes

    @property
    def working_bytes(self) -> int:
        return max(0, self.peak_bytes - self.start_bytes)
