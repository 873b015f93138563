"""servelab's CPU kernels for decoding (avx512.cpp: matmul, decode attention), compiled once per CPU and cached.

Knows when the kernel can run (an AVX-512 CPU; bf16 also needs AVX-512 BF16), how to build it with
torch's extension builder into the cache (keyed by the source, torch's version and the CPU's flags,
under a file lock so workers starting together build it once), and how to say why it is not used.
Does not know models: decoder.py decides which weights it serves.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("avx512.cpp")
BLOCK = 16  # outputs per weight block: the kernel needs N to be a multiple of it


@dataclass(frozen=True)
class BlockedKernel:
    module: ModuleType | None
    reason: str  # why it cannot be used, when module is None

    def supports(self, dtype: torch.dtype) -> bool:
        if self.module is None:
            return False
        return dtype == torch.float32 or (dtype == torch.bfloat16 and self.module.has_bf16())


_loaded: dict[Path, BlockedKernel] = {}


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def load_blocked_kernel(cache_dir: Path) -> BlockedKernel:
    """The compiled kernel, or why there is none; built on first use (about 30 s), then loaded from the cache."""
    if cache_dir in _loaded:
        return _loaded[cache_dir]
    flags = cpu_flags()
    if "avx512f" not in flags:
        kernel = BlockedKernel(None, "this CPU has no AVX-512")
    else:
        kernel = _build(cache_dir, flags)
    _loaded[cache_dir] = kernel
    return kernel


def _build(cache_dir: Path, flags: set[str]) -> BlockedKernel:
    from torch.utils.cpp_extension import load

    from servelab.engine.loader import file_lock

    key = hashlib.sha256(
        SOURCE.read_bytes() + torch.__version__.encode() + " ".join(sorted(flags)).encode()
    ).hexdigest()[:16]
    build_dir = (cache_dir / "kernels" / key).resolve()
    build_dir.mkdir(parents=True, exist_ok=True)
    _put_ninja_on_path()
    try:
        with file_lock(build_dir / ".lock"):
            module = load(name=f"servelab_linear_{key}", sources=[str(SOURCE)], build_directory=str(build_dir),
                          extra_cflags=["-O3", "-march=native"], verbose=False)
    except Exception as exc:  # NOTE: no compiler, no ninja, a broken toolchain: serve with oneDNN instead
        log.warning("servelab's AVX-512 matmul kernel could not be built (%s); using oneDNN", exc)
        return BlockedKernel(None, f"build failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    return BlockedKernel(module, "")


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja`; the pinned ninja package ships one inside the virtual environment."""
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
