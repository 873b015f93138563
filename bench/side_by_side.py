"""Two engines' decode speed side by side in one process, interleaved round by round (the machine's load moves
both alike): decode tok/s = B x (N - 1) / (t_N - t_1) with a 64-token prompt and N = 64 new tokens (EOS ignored),
the ratio second / first per round and its median. Used by bench.int4_activations and bench.huge_pages; the command
line of a bench over one config's batch sizes (`config_bench_args`) by bench.huge_pages and bench.structured."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from servelab.config import ConfigError, ServingConfig
from servelab.engine.engine import Engine
from servelab.request import GenerationRequest, SamplingParams

PROMPT_TOKENS, NEW_TOKENS = 64, 64


def compare_decode(engines: dict[str, Engine], batch_sizes: list[int], rounds: int) -> None:
    """Print, per batch size, each engine's median decode tok/s and the second's ratio to the first."""
    (first, _), (second, _) = engines.items()
    tokenizer = next(iter(engines.values())).tokenizer
    prompt = tokenizer.decode(tokenizer("The history of the city " * 20)["input_ids"][:PROMPT_TOKENS])

    def timed(engine: Engine, rows: int, new_tokens: int) -> float:
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        requests = [GenerationRequest(f"r{i}", prompt=prompt, params=params) for i in range(rows)]
        started = time.perf_counter()
        engine.generate(requests)
        return time.perf_counter() - started

    for name, engine in engines.items():
        print(f"{name}: {engine.kernel}", flush=True)
        timed(engine, 2, 4)  # warm-up
    for rows in batch_sizes:
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(rounds):
            for name, engine in engines.items():
                one, full = timed(engine, rows, 1), timed(engine, rows, NEW_TOKENS)
                rates[name].append(rows * (NEW_TOKENS - 1) / (full - one))
        ratios = [b / a for a, b in zip(rates[first], rates[second])]
        print(f"batch {rows}: decode tok/s {first} {statistics.median(rates[first]):.1f}, {second} "
              f"{statistics.median(rates[second]):.1f}; {second} / {first} x{statistics.median(ratios):.3f} (rounds "
              f"{', '.join(f'x{r:.3f}' for r in ratios)})", flush=True)


def positive_ints(text: str) -> list[int]:
    """argparse type: a comma list of positive integers."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return values


def config_bench_args(prog: str, description: str, argv: list[str] | None, *, batch_sizes: list[int],
                      rounds: int) -> tuple[argparse.Namespace, ServingConfig]:
    """--config (a serving config, its errors the parser's), --batch-sizes and --rounds (1..20) -> (args, config)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", type=Path, required=True, help="a serving config (YAML)")
    parser.add_argument("--batch-sizes", type=positive_ints, default=batch_sizes)
    parser.add_argument("--rounds", type=int, choices=range(1, 21), default=rounds, metavar="1..20")
    args = parser.parse_args(argv)
    try:
        return args, ServingConfig.from_yaml(args.config)
    except ConfigError as error:
        parser.error(str(error))
