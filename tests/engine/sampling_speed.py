"""What penalties and log-probabilities cost the decode loop: a measurement, not a test.

Run: .venv/bin/python -m tests.engine.sampling_speed [--config configs/fp32.yaml] [--batch-sizes 1,16,64]
In one process, interleaved rounds, medians printed side by side:
- greedy rows that ask for neither, served by the engine as it is and by the sampling step as it was before
  penalties and log-probabilities (`_sample` and `sample_next` of that commit, patched in): decode tokens/s;
- the sampling step alone (sample_next, and the log-probability read that finds no row asking) on (B, V) logits;
- what rows that do ask cost a batch of 16: one penalised row, one with 20 alternatives, every row with both.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from servelab.config import ServingConfig
from servelab.engine import sampling
from servelab.engine.engine import Engine
from servelab.request import GenerationRequest, SamplingParams
from servelab.settings import Settings


def _sample_next_before(logits, params, generators):
    """servelab/engine/sampling.py's sample_next before penalties (the commit this work started from)."""
    next_ids = logits.argmax(dim=-1)
    for i, (p, generator) in enumerate(zip(params, generators)):
        if generator is not None:
            next_ids[i] = sampling._sample_row(logits[i].float(), p, generator)
    return next_ids


def _sample_before(self, logits, rows):
    """Decodings.sample as it was before penalties and log-probabilities: the old sampling, the same postprocessing."""
    states = [self._by_id[r.request_id] for r in rows]
    next_ids = _sample_next_before(logits.float(), [r.request.params for r in rows], [s.generator for s in states])
    return self.postprocess(rows, states, next_ids.tolist(), {})


@contextmanager
def _before(engine: Engine):
    engine.decodings.sample = _sample_before.__get__(engine.decodings)
    try:
        yield
    finally:
        del engine.decodings.sample


def _requests(batch_size: int, num_new: int, **params) -> list[GenerationRequest]:
    prompt = "the quick brown fox jumps over the lazy dog " * 7  # about 64 tokens
    return [GenerationRequest(f"r{i}", prompt=prompt, params=SamplingParams(max_new_tokens=num_new, ignore_eos=True,
                                                                           **params)) for i in range(batch_size)]


def _decode_tokens_per_s(engine: Engine, requests: list[GenerationRequest]) -> float:
    timings = engine.generate(requests).timings
    return timings.num_decode_tokens / (timings.decode_ms / 1e3)


def _median_us(fn, repeats: int = 50) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/fp32.yaml")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    engine = Engine.from_config(ServingConfig.from_yaml(Path(args.config)), Settings(cache_dir=Path(".cache")))
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(f"{engine.config.name}: {engine.kernel}; {torch.get_num_threads()} threads; median of {args.rounds} "
          "interleaved rounds")
    print("greedy rows asking for neither, decode tokens/s: before | now | now / before (medians; then the best "
          "round of each: other load only slows)")
    for b in sizes:
        requests = _requests(b, args.new_tokens)
        before, now = [], []
        for round_index in range(args.rounds):
            for which in ("before", "now") if round_index % 2 == 0 else ("now", "before"):  # NOTE: ABBA order
                if which == "before":
                    with _before(engine):
                        before.append(_decode_tokens_per_s(engine, requests))
                else:
                    now.append(_decode_tokens_per_s(engine, requests))
        print(f"  batch {b:>3}: {statistics.median(before):8.1f} | {statistics.median(now):8.1f} | "
              f"x{statistics.median(now) / statistics.median(before):.3f}   best of rounds: {max(before):8.1f} | "
              f"{max(now):8.1f} | x{max(now) / max(before):.3f}")
    vocab = engine.loaded.model.config.vocab_size
    print(f"the sampling step alone on (B, {vocab}) fp32 logits, greedy rows, median microseconds: before | now | "
          "now / before")
    for b in sizes:
        logits, params, gens = torch.randn(b, vocab), [SamplingParams()] * b, [None] * b
        history = [list(range(args.new_tokens))] * b
        rows = [type("R", (), {"logprobs": None})()] * b
        old, new = [], []
        for _ in range(args.rounds * 200):  # NOTE: call by call, alternating, so load changes hit both alike
            old.append(_median_us(lambda: _sample_next_before(logits, params, gens), repeats=1))
            new.append(_median_us(lambda: (sampling.sample_next(logits, params, gens, history),
                                           Engine._read_logprobs(logits, None, rows)), repeats=1))
        print(f"  batch {b:>3}: {statistics.median(old):8.1f} | {statistics.median(new):8.1f} | "
              f"x{statistics.median(new) / statistics.median(old):.3f}")
    print("a batch of 16 whose rows ask, decode tokens/s (x against none asking):")
    asks = {"none": [{}] * 16, "one row penalised": [{"presence_penalty": 0.5, "frequency_penalty": 0.5}] + [{}] * 15,
            "one row with 20 alternatives": [{"logprobs": 20}] + [{}] * 15,
            "every row: penalties and 5 alternatives": [{"frequency_penalty": 0.5, "logprobs": 5}] * 16}
    figures: dict[str, list[float]] = {name: [] for name in asks}
    for round_index in range(args.rounds):
        for name, per_row in (asks.items() if round_index % 2 == 0 else reversed(asks.items())):
            requests = [r for i, p in enumerate(per_row) for r in _requests(1, args.new_tokens, **p)]
            requests = [GenerationRequest(f"r{i}", prompt=r.prompt, params=r.params) for i, r in enumerate(requests)]
            figures[name].append(_decode_tokens_per_s(engine, requests))
    base, best = statistics.median(figures["none"]), max(figures["none"])
    for name, values in figures.items():
        print(f"  {name:<42} {statistics.median(values):8.1f}  x{statistics.median(values) / base:.3f}   best: "
              f"{max(values):8.1f}  x{max(values) / best:.3f}")
    print(f"the same asks, the sampling step alone on (16, {vocab}) logits after {args.new_tokens} tokens, median "
          "microseconds:")
    logits, history = torch.randn(16, vocab), [list(range(args.new_tokens))] * 16
    timed: dict[str, list[float]] = {name: [] for name in asks}
    for _ in range(args.rounds * 50):
        for name, per_row in asks.items():
            params = [SamplingParams(**p) for p in per_row]
            rows = [type("R", (), {"logprobs": None if p.logprobs is None else [], "request": type(
                "Q", (), {"params": p})()})() for p in params]
            timed[name].append(_median_us(lambda: Engine._read_logprobs(
                logits, sampling.sample_next(logits, params, [None] * 16, history), rows), repeats=1))
    for name, values in timed.items():
        print(f"  {name:<42} {statistics.median(values):8.1f}")


if __name__ == "__main__":
    main()
