"""Run in a fresh process by test_memory.py: what loading the bundled model adds to this process's resident
memory, against the engine's weight figure, and the resident peak while it serves a batch.

The first load fills what a worker pays once per process and machine (imports done lazily by the load, the
bundled model's conversion, the kernel builds and 'auto''s measurement); it is then dropped, and the second load
is what is measured, as a serving worker holds it. Prints one JSON line.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

from servelab.config import ServingConfig
from servelab.engine.engine import Engine
from servelab.resident import return_freed_memory
from servelab.request import GenerationRequest, SamplingParams
from servelab.settings import Settings


def status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: resident now, VmHWM: the resident peak)."""
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field + ":"))


def settle() -> int:
    gc.collect()
    return_freed_memory()
    return status("VmRSS")


def main(config_path: str, cache_dir: str) -> None:
    torch.set_num_threads(1)
    config, settings = ServingConfig.from_yaml(config_path), Settings(cache_dir=Path(cache_dir))
    del Engine.from_config(config, settings).decoder  # NOTE: the once-per-process costs, then dropped
    before = settle()
    engine = Engine.from_config(config, settings)
    loaded = settle()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the resident memory now
    requests = [GenerationRequest(f"r{i}", prompt="The history of the city " * 12,
                                  params=SamplingParams(max_new_tokens=64, ignore_eos=True)) for i in range(16)]
    result = engine.generate(requests)
    memory = result.memory
    print(json.dumps({"growth": loaded - before, "weights": engine.weight_bytes, "peak": status("VmHWM") - before,
                      "kv": memory.kv_cache_allocated_bytes, "working": memory.peak_working_bytes}))


if __name__ == "__main__":
    main(*sys.argv[1:])
