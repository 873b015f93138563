"""A decode step's three forms side by side in one engine, rounds interleaved (the machine's load moves them alike):
the decoder's Python layer loop, the one-call step (DecodeStack in blocked.cpp) with a parallel region per kernel,
and the one-call step as one team (a single parallel region for every layer). Decode tok/s = B x (N - 1) /
(t_N - t_1), N = --new-tokens, EOS ignored; medians of the rounds and each form's ratio to the loop per round
(median), with the rounds it was faster in. The three give the same bits (tests/engine/test_fused_kernels.py,
tests/engine/test_awq.py); only their speed differs.

    python -m bench.decode_step --configs configs/fp32.yaml,configs/bf16.yaml --threads 2 --batch-sizes 1,16

NOTE: quote figures from an idle machine: a descheduled thread holds the whole step at every join.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.side_by_side import positive_ints
from servelab.config import ServingConfig
from servelab.engine.engine import Engine
from servelab.hardware import describe_hardware
from servelab.request import GenerationRequest, SamplingParams
from servelab.settings import Settings

REPO = Path(__file__).resolve().parents[1]
FORMS = ("loop", "region per kernel", "team")


def _use(engine: Engine, form: str) -> None:
    decoder = engine.decoder
    decoder._stack = False if form == "loop" else None  # NOTE: None: the stack is built again on its next use
    if form != "loop":
        decoder._decode_stack().team = form == "team"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="configs/fp32.yaml,configs/bf16.yaml")
    parser.add_argument("--threads", type=positive_ints, default=[2])
    parser.add_argument("--batch-sizes", type=positive_ints, default=[1])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    if args.new_tokens < 2 or args.rounds < 1:
        parser.error("--new-tokens must be at least 2 and --rounds at least 1")
    settings = Settings(cache_dir=REPO / ".cache")
    print(f"cpu: {describe_hardware().cpu}; {args.rounds} rounds interleaved, medians", flush=True)
    for path in args.configs.split(","):
        for threads in args.threads:
            config = ServingConfig.from_yaml(path)
            config = config.model_copy(update={
                "num_threads": threads,
                "batching": config.batching.model_copy(update={
                    "max_batch_size": max(config.batching.max_batch_size, *args.batch_sizes)}),
                "kv_cache": config.kv_cache.model_copy(update={"prefix_caching": False})})
            engine = Engine.from_config(config, settings)
            torch.set_num_threads(threads)
            if engine.decoder._decode_stack() is None:
                print(f"{config.name} at {threads} thread(s): no one-call step here ({engine.kernel})", flush=True)
                continue
            prompt = "The history of the city " * 10
            for batch in args.batch_sizes:
                def timed(new_tokens: int) -> float:
                    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
                    started = time.perf_counter()
                    engine.generate([GenerationRequest(f"r{i}", prompt=prompt, params=params) for i in range(batch)])
                    return time.perf_counter() - started

                speeds: dict[str, list[float]] = {form: [] for form in FORMS}
                for form in FORMS:
                    _use(engine, form)
                    timed(4)  # warm-up
                for r in range(args.rounds):
                    for form in FORMS if r % 2 == 0 else FORMS[::-1]:
                        _use(engine, form)
                        one, full = timed(1), timed(args.new_tokens)
                        speeds[form].append(batch * (args.new_tokens - 1) / (full - one))
                loop = speeds["loop"]
                cells = []
                for form in FORMS:
                    ratios = [s / b for s, b in zip(speeds[form], loop)]
                    faster = "" if form == "loop" else f", {sum(x > 1 for x in ratios)} faster"
                    cells.append(f"{form} {statistics.median(speeds[form]):.1f} tok/s "
                                 f"(x{statistics.median(ratios):.3f}{faster})")
                print(f"{config.name} at {threads} thread(s), batch {batch}: " + " | ".join(cells), flush=True)
            del engine


if __name__ == "__main__":
    main()
