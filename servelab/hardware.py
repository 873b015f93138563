"""The machine a measurement ran on: CPU / GPU model, memory, software versions, measured bandwidth.

Knows how to fingerprint the host and measure its memory bandwidth with a large tensor copy
(the batch-1 decode roofline is bandwidth / bytes read per step). Does not know any model.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import torch

SOFTWARE = ("torch", "transformers", "gptqmodel", "servelab")


@dataclass(frozen=True)
class Hardware:
    cpu: str
    num_cpus: int
    memory_bytes: int
    gpu: str | None
    num_threads: int

    def as_dict(self) -> dict:
        return asdict(self)


def describe_hardware() -> Hardware:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return Hardware(
        cpu=_cpu_model(), num_cpus=os.cpu_count() or 1, memory_bytes=_memory_bytes(),
        gpu=gpu, num_threads=torch.get_num_threads(),
    )


def software_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in SOFTWARE:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def measure_bandwidth_gbs(device: torch.device, *, num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best of `repeats` copies of a buffer larger than any cache: bytes read + written per second."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - started)
    return 2 * num_bytes / best / 1e9


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a CUDA stream); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0
