"""What 'auto' serves a model's dense weights with on this machine, as the engine reports it.

'auto' is measured per CPU and cached, so a test that checks a reported kernel asks the same chooser
(same cache, threads and shapes) instead of naming a kernel that only one CPU kind would print.
"""

from __future__ import annotations

from pathlib import Path

import torch

from servelab.engine.linear import choose_linear_kernel


def auto_kernel_label(cache_dir: Path, *, hidden_size: int = 64, intermediate_size: int = 128,
                      dtype: torch.dtype = torch.float32, num_threads: int = 1) -> str:
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        shapes = ((2 * intermediate_size, hidden_size), (hidden_size, intermediate_size))
        return choose_linear_kernel("auto", device=torch.device("cpu"), dtype=dtype, cache_dir=cache_dir,
                                    shapes=shapes).label
    finally:
        torch.set_num_threads(before)
