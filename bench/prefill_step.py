"""A prompt's prefill with servelab's chunk step and with torch's, side by side in one engine per thread count,
rounds interleaved (the machine's load moves them alike). servelab: the chunk's rotary positions, cache writes and
causal attention in one kernel call per layer (prefill_step_attention); torch: its rotary operations, the paged
cache's write and read, then SDPA with the chunk's mask. Prefill tok/s = --prompt-tokens / the time to the first
token of one row (the e2e prefill a user waits for); medians of the rounds, servelab's ratio to torch per round
(median) with the rounds it was faster in, and each form's gain over the first thread count. The projections are
the same in both (tests/engine/test_decoder.py checks the kernels against the plain softmax and the unfused
write).

    python -m bench.prefill_step --configs configs/fp32.yaml --threads 1,2 --rounds 5

NOTE: quote figures from an idle machine: a descheduled thread holds the whole prefill at every join.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from bench.side_by_side import positive_ints
from bench.threads import engine_at, timed
from servelab.hardware import describe_hardware
from servelab.settings import Settings

REPO = Path(__file__).resolve().parents[1]
FORMS = ("servelab", "torch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="configs/fp32.yaml")
    parser.add_argument("--threads", type=positive_ints, default=[1, 2])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.prompt_tokens < 2 or args.rounds < 1:
        parser.error("--prompt-tokens must be at least 2 and --rounds at least 1")
    settings = Settings(cache_dir=REPO / ".cache")
    print(f"cpu: {describe_hardware().cpu}; prompt {args.prompt_tokens} tokens, one row; {args.rounds} rounds "
          "interleaved, medians", flush=True)
    for path in args.configs.split(","):
        engines = {n: engine_at(path, n, args.prompt_tokens, 1, settings, None) for n in args.threads}
        first = engines[args.threads[0]]
        kernel = first.decoder.prefill_step_attention
        if kernel is None:
            print(f"{first.config.name}: no servelab chunk step here ({first.kernel})", flush=True)
            continue
        tokenizer = first.tokenizer
        ids = tokenizer("The history of the city " * (args.prompt_tokens // 4 + 8))["input_ids"][:args.prompt_tokens]
        prompt = tokenizer.decode(ids)
        speeds = {(n, form): [] for n in args.threads for form in FORMS}
        for n, engine in engines.items():
            for form in FORMS:
                engine.decoder.prefill_step_attention = kernel if form == "servelab" else None
                timed(engine, n, prompt, 1, 1)  # warm-up
        for r in range(args.rounds):
            for n, engine in engines.items():
                for form in FORMS if r % 2 == 0 else FORMS[::-1]:
                    engine.decoder.prefill_step_attention = kernel if form == "servelab" else None
                    speeds[n, form].append(args.prompt_tokens / timed(engine, n, prompt, 1, 1))
        base = args.threads[0]
        for n in args.threads:
            ratios = [s / b for s, b in zip(speeds[n, "servelab"], speeds[n, "torch"])]
            cells = []
            for form in FORMS:
                gain = "" if n == base else (
                    f", x{statistics.median(speeds[n, form]) / statistics.median(speeds[base, form]):.2f} over {base}t")
                cells.append(f"{form} {statistics.median(speeds[n, form]):.1f} tok/s{gain}")
            print(f"{first.config.name} at {n} thread(s): " + " | ".join(cells)
                  + f" | servelab / torch x{statistics.median(ratios):.3f} ({sum(x > 1 for x in ratios)} of "
                  f"{len(ratios)} faster)", flush=True)
        del engines


if __name__ == "__main__":
    main()
