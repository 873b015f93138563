"""This process's resident memory: now, its peak over a block, and freed heap handed back to the OS.

Knows Linux's /proc/self/status (VmRSS, VmHWM), /proc/self/clear_refs (which resets VmHWM) and glibc's malloc_trim;
where they are missing (not Linux, not allowed, no glibc) the peak falls back to getrusage's lifetime peak (an
over-estimate) and the hand-back does nothing. Imports no torch: the engine and the control-plane benches use it.
"""

from __future__ import annotations

import ctypes
import resource
from pathlib import Path


class ResidentPeak:
    """The peak resident memory over a block (peak_bytes), and where it started (start_bytes)."""

    def __init__(self) -> None:
        self.start_bytes = 0
        self.peak_bytes = 0

    def __enter__(self) -> ResidentPeak:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # NOTE: "5" resets VmHWM to the current RSS
        except OSError:
            pass  # VmHWM is then the process-lifetime peak
        self.start_bytes = status_bytes("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.peak_bytes = status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    @property
    def above_start_bytes(self) -> int:
        return max(0, self.peak_bytes - self.start_bytes)


def status_bytes(field: str) -> int:
    """A byte figure of /proc/self/status (VmRSS: resident now, VmHWM: its peak); 0 where it cannot be read."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def return_freed_memory() -> None:
    """Hand memory freed inside the heap back to the OS (glibc's malloc_trim), so resident memory is what the
    process still holds. A no-op where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
