"""What 'auto' serves a model's dense weights with on this machine, as the engine reports it.

'auto' is measured per CPU and cached, so a test that checks a reported kernel asks the same chooser
(same cache, threads and shapes) instead of naming a kernel that only one CPU kind would print.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from servelab.engine.linear import choose_linear_kernel, measured_shapes


def auto_kernel_label(cache_dir: Path, model_folder: Path, *, dtype: torch.dtype = torch.float32,
                      num_threads: int = 1) -> str:
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=dtype)
    shapes = measured_shapes([m.weight for m in model.modules() if type(m) is torch.nn.Linear])
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        return choose_linear_kernel("auto", device=torch.device("cpu"), dtype=dtype, cache_dir=cache_dir,
                                    shapes=shapes).label
    finally:
        torch.set_num_threads(before)
