"""servelab at several thread counts side by side, in one process, rounds interleaved (the machine's load moves
every count alike): per config, one engine per thread count (its `auto` kernel choice and int4 crossover are
measured at that count, as a worker's are), then per round and count:

- prefill: the time to the first token of one --prompt-tokens prompt (one row, one new token, the prompt in one
  chunk, no prefix cache), as tok/s;
- decode tok/s at each batch size: one closed batch of B rows, N = --new-tokens each, EOS ignored: the tokens its
  decode steps made over those steps' time, as the engine times them (`BatchTimings.decode_tok_s`, as `servelab
  bench engine` reports it). (Two runs' difference, B x (N - 1) / (t_N - t_1), went negative when the 1-token run
  met a busy moment.)

Medians of the rounds, and each count's ratio to the first per round (median). The CPU, its flags and the
measured memory bandwidth head the table. Each round also reads a 256 MiB buffer once at every count (torch's sum: a
read-only stream on the same threads), and each config's last line gives that stream's GB/s and its ratio to the
first count: on a machine whose other tenants take a changing share of the memory, a batch-1 decode (a weight
stream) can gain from more threads only what the memory gave in those same rounds. Each config's line says whether
greedy decoding gave the same tokens at every count (servelab's kernels split output blocks, attention rows and
heads across threads, never a sum; torch's prefill GEMMs may round differently at other counts, so a 'no' names a
difference to look at, not a failure).

    python -m bench.threads --configs configs/fp32.yaml,configs/bf16.yaml --threads 1,2 --batch-sizes 1,16

--random-weights FOLDER: the configs' precisions on a model of FOLDER's shape (its config.json and tokenizer files)
with random weights (bench/random_model.py), for a machine without the bundled model; speed only.

NOTE: on a machine other processes share, a descheduled thread holds a whole step at the join of each
parallel kernel: quote figures from an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.side_by_side import positive_ints
from bench.random_model import random_loaded
from servelab.config import ServingConfig
from servelab.engine.engine import Engine, check_configured_kernel
from servelab.engine.loader import apply_threads
from servelab.hardware import describe_hardware, measure_bandwidth_gbs
from servelab.outputs import BatchResult
from servelab.request import GenerationRequest, SamplingParams
from servelab.settings import Settings, available_cores

REPO = Path(__file__).resolve().parents[1]


def engine_at(path: str, threads: int, prompt_tokens: int, batch: int, settings: Settings,
            random_weights: Path | None) -> Engine:
    config = ServingConfig.from_yaml(path)
    config = config.model_copy(update={
        "num_threads": threads,
        "batching": config.batching.model_copy(update={
            "max_batch_size": max(config.batching.max_batch_size, batch),
            "max_prefill_tokens": max(prompt_tokens + 1, batch * 65),
            "max_batch_tokens": max(config.batching.max_batch_tokens, batch * 130, prompt_tokens + 1)}),
        "kv_cache": config.kv_cache.model_copy(update={"prefix_caching": False})})
    if random_weights is None:
        return Engine.from_config(config, settings)
    apply_threads(config, settings)
    check_configured_kernel(config, settings)
    return Engine(random_loaded(config, random_weights), config, cache_dir=settings.cache_dir, settings=settings)


def _run(engine: Engine, threads: int, prompt: str, rows: int, new_tokens: int) -> tuple[float, BatchResult]:
    """Seconds for one closed batch of `rows` copies of the prompt, and its result."""
    torch.set_num_threads(threads)  # NOTE: the engines share the process: each count set before its call
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    requests = [GenerationRequest(f"r{i}", prompt=prompt, params=params) for i in range(rows)]
    started = time.perf_counter()
    result = engine.generate(requests)
    return time.perf_counter() - started, result


def timed(engine: Engine, threads: int, prompt: str, rows: int, new_tokens: int) -> float:
    return _run(engine, threads, prompt, rows, new_tokens)[0]


def read_stream_gbs(buffer: torch.Tensor, threads: int) -> float:
    """GB/s of one read of `buffer` through torch's sum on `threads` threads: the memory's read pace now."""
    torch.set_num_threads(threads)
    started = time.perf_counter()
    buffer.sum()
    return buffer.numel() * buffer.element_size() / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="configs/fp32.yaml,configs/bf16.yaml")
    parser.add_argument("--threads", type=positive_ints, default=[1, 2])
    parser.add_argument("--batch-sizes", type=positive_ints, default=[1])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--random-weights", type=Path, default=None, metavar="FOLDER",
                        help="a folder with a model's config.json and tokenizer: that shape, random weights")
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error(f"--new-tokens {args.new_tokens}: at least 2 (a row's first token comes from its prefill; "
                     "decode steps make the rest)")
    if args.prompt_tokens < 1 or args.rounds < 1:
        parser.error("--prompt-tokens and --rounds: at least 1 each")
    if args.random_weights is not None and not (args.random_weights / "config.json").is_file():
        parser.error(f"--random-weights {args.random_weights}: no config.json there (the folder holds a model's "
                     "config.json and tokenizer files)")
    settings = Settings(cache_dir=REPO / ".cache")
    hardware = describe_hardware()
    bandwidth = {}
    for n in args.threads:
        torch.set_num_threads(n)
        bandwidth[n] = measure_bandwidth_gbs(torch.device("cpu"))
    print(f"cpu: {hardware.cpu}; cores this process may run on: {available_cores()}; threads {args.threads}; "
          "memory bandwidth (measured): " + ", ".join(f"{n}t {gbs:.1f} GB/s" for n, gbs in bandwidth.items())
          + f"; {args.rounds} rounds interleaved, medians", flush=True)
    buffer = torch.ones(256 << 18)  # 256 MiB of fp32, beyond any CPU cache: the per-round read stream
    buffer.sum()  # NOTE: its pages touched before the first round
    for path in args.configs.split(","):
        engines = {n: engine_at(path, n, args.prompt_tokens, max(args.batch_sizes), settings, args.random_weights)
                   for n in args.threads}
        first = engines[args.threads[0]]
        tokenizer = first.tokenizer
        text = tokenizer.decode(tokenizer("The history of the city " * (args.prompt_tokens // 4 + 8))["input_ids"])
        prompt = tokenizer.decode(tokenizer(text)["input_ids"][:args.prompt_tokens])
        for n, engine in engines.items():
            print(f"{first.config.name} ({first.config.weights}) at {n} thread(s): {engine.kernel}", flush=True)
            timed(engine, n, prompt, 2, 4)  # warm-up
        tokens = {n: [c.token_ids for c in _run(engine, n, prompt[:200], 3, args.new_tokens)[1].completions]
                  for n, engine in engines.items()}
        differ = [n for n in args.threads if tokens[n] != tokens[args.threads[0]]]
        print(f"  greedy tokens (3 rows, {args.new_tokens} new) the same at every count: "
              + ("yes" if not differ else f"no, {differ} thread(s) differ from {args.threads[0]}"), flush=True)
        prefill: dict[int, list[float]] = {n: [] for n in args.threads}
        decode: dict[tuple[int, int], list[float]] = {(n, b): [] for n in args.threads for b in args.batch_sizes}
        stream: dict[int, list[float]] = {n: [] for n in args.threads}
        for _ in range(args.rounds):
            for n, engine in engines.items():
                stream[n].append(read_stream_gbs(buffer, n))
                prefill[n].append(args.prompt_tokens / timed(engine, n, prompt, 1, 1))
                for b in args.batch_sizes:
                    decode[(n, b)].append(_run(engine, n, prompt[:200], b, args.new_tokens)[1].timings.decode_tok_s)
        base = args.threads[0]

        def cells(samples: dict, key) -> str:
            ref = samples[(base, *key[1:]) if isinstance(key, tuple) else base]
            ratio = statistics.median(s / r for s, r in zip(samples[key], ref))
            return f"{statistics.median(samples[key]):8.1f} (x{ratio:.2f})"

        print(f"  prefill {args.prompt_tokens} tokens, tok/s: "
              + " | ".join(f"{n}t {cells(prefill, n)}" for n in args.threads), flush=True)
        for b in args.batch_sizes:
            print(f"  decode batch {b}, tok/s: " + " | ".join(f"{n}t {cells(decode, (n, b))}" for n in args.threads),
                  flush=True)
        print("  memory read stream in the same rounds, GB/s: "
              + " | ".join(f"{n}t {cells(stream, n)}" for n in args.threads), flush=True)
        del engines


if __name__ == "__main__":
    main()
