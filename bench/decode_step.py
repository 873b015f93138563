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
from pathlib import Path

import torch

from bench.side_by_side import positive_ints
from bench.threads import engine_at, timed
from servelab.engine.engine import Engine
from servelab.hardware import describe_hardware
from servelab.settings import Settings

REPO = Path(__file__).resolve().parents[1]
FORMS = ("loop", "region per kernel", "team")
PROMPT_TOKENS = 64  # the prompt below is about 50 tokens: the engine's prefill limits are set for this many


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
            engine = engine_at(path, threads, PROMPT_TOKENS, max(args.batch_sizes), settings, None)
            torch.set_num_threads(threads)
            if engine.decoder._decode_stack() is None:
                print(f"{engine.config.name} at {threads} thread(s): no one-call step here ({engine.kernel})", flush=True)
                continue
            prompt = "The history of the city " * 10
            for batch in args.batch_sizes:
                speeds: dict[str, list[float]] = {form: [] for form in FORMS}
                for form in FORMS:
                    _use(engine, form)
                    timed(engine, threads, prompt, batch, 4)  # warm-up
                for r in range(args.rounds):
                    for form in FORMS if r % 2 == 0 else FORMS[::-1]:
                        _use(engine, form)
                        one = timed(engine, threads, prompt, batch, 1)
                        full = timed(engine, threads, prompt, batch, args.new_tokens)
                        speeds[form].append(batch * (args.new_tokens - 1) / (full - one))
                loop = speeds["loop"]
                cells = []
                for form in FORMS:
                    ratios = [s / b for s, b in zip(speeds[form], loop)]
                    faster = "" if form == "loop" else f", {sum(x > 1 for x in ratios)} faster"
                    cells.append(f"{form} {statistics.median(speeds[form]):.1f} tok/s "
                                 f"(x{statistics.median(ratios):.3f}{faster})")
                print(f"{engine.config.name} at {threads} thread(s), batch {batch}: " + " | ".join(cells), flush=True)
            del engine


if __name__ == "__main__":
    main()
