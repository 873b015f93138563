"""Wall-clock samples for the scripts that time queries side by side (never for asserts)."""

from __future__ import annotations

import time
from collections.abc import Callable


def samples_s(fn: Callable[[], object], *, repeats: int) -> list[float]:
    """Seconds per call over `repeats` calls, after one unmeasured call (plans cached, pages in memory)."""
    fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return samples
