"""servelab's CPU kernels for decoding (blocked.cpp: matmul, decode attention, RMSNorm), built per instruction set.

Both builds are compiled with OpenMP (PARALLEL_FLAGS), so the kernels run on torch's thread pool: torch.set_num_threads
(a worker's num_threads) governs them.

Knows the two builds of the one source (AVX-512, and AVX2 + FMA), which of them this CPU can run (its flags,
capped by the instruction set torch itself dispatches to, so ATEN_CPU_CAPABILITY=avx2 makes an AVX-512
machine behave as an AVX2 one), how to build one with torch's extension builder into the cache (keyed by
the source, torch's version, the build and the CPU's flags, under a file lock so workers starting together
build it once), and how to say why a build is not used. Does not know models: decoder.py decides which
weights it serves.
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

SOURCE = Path(__file__).with_name("blocked.cpp")
BLOCK = 16  # outputs per weight block: the kernel needs N to be a multiple of it


@dataclass(frozen=True)
class Isa:
    name: str  # 'avx512' | 'avx2'
    label: str  # as reports print it
    required_flags: frozenset[str]
    cflags: tuple[str, ...]


# NOTE: best first. The AVX-512 build keeps -march=native (it also picks up AVX-512 BF16 where the CPU has
# it); the AVX2 build names its instruction sets, so an AVX-512 machine builds and tests it too.
ISAS = (
    Isa("avx512", "AVX-512", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}), ("-march=native",)),
    Isa("avx2", "AVX2", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c", "-mtune=native")),
)
ISA_NAMES = tuple(isa.name for isa in ISAS)
# NOTE: at::parallel_for is inline OpenMP in torch's CPU builds: compiled without -fopenmp it runs every kernel on
# the calling thread whatever torch.set_num_threads says (measured: no gain from a second thread). Linked with it,
# the extension shares torch's own OpenMP runtime (libgomp.so.1, already loaded by torch), so one pool serves both.
PARALLEL_FLAGS = ("-fopenmp",)


@dataclass(frozen=True)
class BlockedKernel:
    module: ModuleType | None
    reason: str  # why it cannot be used, when module is None
    isa: Isa | None = None

    @property
    def label(self) -> str:
        name = f"servelab {self.isa.label} kernel" if self.isa else "servelab kernel"
        if self.module is not None and not self.module.parallel():
            return f"{name} (one thread: built without OpenMP)"
        return name

    @property
    def build(self) -> str | None:
        """The build's module name, which hashes its source, torch's version, its flags and the CPU's: a choice
        measured with one build is not reused by another (a changed kernel is measured again)."""
        return self.module.__name__ if self.module is not None else None

    def bf16_note(self) -> str:
        """How bf16 weights run in this build."""
        if self.module is not None and self.module.native_bf16():
            rows = self.module.amx_rows()
            return f"bf16 with AVX-512 BF16, on AMX tiles from {rows} rows" if rows else "bf16 with AVX-512 BF16"
        return "bf16 weights converted to fp32 in registers"


_loaded: dict[tuple[Path, str], BlockedKernel] = {}


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache (Linux sysfs), or None where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=None)


def _torch_allows(isa: Isa) -> bool:
    """torch's own dispatch level (it honours ATEN_CPU_CAPABILITY): servelab never goes above it."""
    capability = torch.backends.cpu.get_cpu_capability().upper()
    if isa.name == "avx512":
        return capability.startswith(("AVX512", "AMX"))
    return capability.startswith(("AVX512", "AMX", "AVX2"))


def isa_reason(isa: Isa, flags: set[str] | None = None) -> str | None:
    """Why this CPU cannot run the build, or None when it can."""
    missing = sorted(isa.required_flags - (cpu_flags() if flags is None else flags))
    if missing:
        return f"this CPU has no {isa.label} ({', '.join(missing)} missing)"
    if not _torch_allows(isa):
        return f"torch runs at {torch.backends.cpu.get_cpu_capability()} here (ATEN_CPU_CAPABILITY), below {isa.label}"
    return None


def best_isa() -> Isa | None:
    """The widest build this CPU runs, or None."""
    return next((isa for isa in ISAS if isa_reason(isa) is None), None)


def load_blocked_kernel(cache_dir: Path, isa_name: str | None = None) -> BlockedKernel:
    """The compiled kernel (the best build for this CPU, or the one named), or why there is none; built on
    first use (about 30 s), then loaded from the cache."""
    isa = next((i for i in ISAS if i.name == isa_name), None) if isa_name else best_isa()
    key = (cache_dir, isa.name if isa else "none")
    if key in _loaded:
        return _loaded[key]
    if isa is None:
        kernel = BlockedKernel(None, f"unknown build {isa_name!r}" if isa_name else "this CPU has neither AVX-512 nor AVX2 + FMA")
    elif (reason := isa_reason(isa)) is not None:
        kernel = BlockedKernel(None, reason, isa)
    else:
        kernel = _build(cache_dir, isa)
    _loaded[key] = kernel
    return kernel


def _build(cache_dir: Path, isa: Isa) -> BlockedKernel:
    """The build on torch's threads (OpenMP); where the compiler has no OpenMP, the same build on one thread."""
    try:
        return BlockedKernel(_compile(cache_dir, isa, PARALLEL_FLAGS), "", isa)
    except Exception as exc:  # NOTE: no compiler, no ninja, no OpenMP, a broken toolchain: try without OpenMP
        log.warning("servelab's %s kernel could not be built with OpenMP (%s); building it for one thread", isa.label, exc)
    try:
        return BlockedKernel(_compile(cache_dir, isa, ()), "", isa)
    except Exception as exc:  # NOTE: serve with another kernel
        log.warning("servelab's %s kernel could not be built (%s)", isa.label, exc)
        return BlockedKernel(None, f"build failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", isa)


def _compile(cache_dir: Path, isa: Isa, parallel_flags: tuple[str, ...]) -> ModuleType:
    from torch.utils.cpp_extension import load

    from servelab.engine.loader import file_lock

    key = hashlib.sha256(
        SOURCE.read_bytes() + torch.__version__.encode() + " ".join((*parallel_flags, *isa.cflags)).encode()
        + " ".join(sorted(cpu_flags())).encode()
    ).hexdigest()[:16]
    build_dir = (cache_dir / "kernels" / f"{isa.name}-{key}").resolve()
    build_dir.mkdir(parents=True, exist_ok=True)
    _put_ninja_on_path()
    with file_lock(build_dir / ".lock"):
        # NOTE: torch's builder keeps a baton file (`lock`) for the length of its build and waits while one
        # exists; a process killed mid-build leaves it, and every later start would wait forever. Under this
        # flock (the kernel releases it when its holder dies) no other process builds here: a baton is stale.
        (build_dir / "lock").unlink(missing_ok=True)
        module = load(name=f"servelab_{isa.name}_{key}", sources=[str(SOURCE)], build_directory=str(build_dir),
                      extra_cflags=["-O3", *parallel_flags, *isa.cflags], extra_ldflags=list(parallel_flags),
                      verbose=False)
    assert module.isa() == isa.name, f"built {module.isa()} for {isa.name}: check the compiler flags"
    return module


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja`; the pinned ninja package ships one inside the virtual environment."""
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
