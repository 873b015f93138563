"""A row generating 4,000 tokens on the bundled model (the configs named on the command line, e.g. fp32-continuous-window
and fp32-continuous-long): kv_cache_tokens, KV bytes and the pool's allocated bytes every 250 steps, as take_stats reports
them. Run: PYTHONPATH=. python -m bench.window_series configs/fp32-continuous-window.yaml configs/fp32-continuous-long.yaml
"""
import sys, time, os
sys.path.insert(0, '.')
import torch
from pathlib import Path
from servelab.config import ServingConfig
from servelab.engine.engine import Engine
from servelab.settings import Settings
from servelab.request import GenerationRequest, SamplingParams
settings = Settings(cache_dir=Path('.cache'))
for path in sys.argv[1:]:
    config = ServingConfig.from_yaml(path)
    engine = Engine.from_config(config, settings)
    engine.take_stats()
    engine.add([GenerationRequest("long", messages=None, prompt="Write a very long story about a lighthouse keeper.",
                                  params=SamplingParams(max_new_tokens=4000, ignore_eos=True))])
    step, t0, last = 0, time.perf_counter(), time.perf_counter()
    series = []
    while engine.num_live:
        engine.step()
        step += 1
        if step % 250 == 0 or not engine.num_live:
            timings, memory = engine.take_stats()
            now = time.perf_counter()
            series.append((step, memory.kv_cache_tokens, memory.kv_cache_bytes, memory.kv_cache_allocated_bytes,
                           (now - last) / 250 * 1e3))
            print(config.name, f"step {step}: kv_cache_tokens {memory.kv_cache_tokens}, kv_cache_bytes "
                  f"{memory.kv_cache_bytes / 2**20:.2f} MiB, allocated {memory.kv_cache_allocated_bytes / 2**20:.2f} MiB, "
                  f"{(now - last) / 250 * 1e3:.1f} ms/step (last 250)", flush=True)
            last = now
    print(config.name, "total", f"{time.perf_counter() - t0:.0f} s", engine.kernel, torch.get_num_threads(), flush=True)
