"""Does a gpu-worker started by `servelab up` keep its speed when the worker beside it is busy?

Drives a running stack through its OpenAI-compatible API: a burst of requests to model A alone, then the same burst
to A while B gets its own, in alternating order over rounds; prints A's output tokens/s each way and their ratio
(medians of rounds, measured side by side in one run). With the workers pinned to their own cores (`servelab up`'s
default) A should keep about its whole speed; with `--share-cores` both run on every core, each worker's thread team
contending for them (docs/performance.md has both figures).

    servelab up --configs configs/a.yaml,configs/b.yaml       # or --share-cores; each config without num_threads
    SERVELAB_API_KEY=... python -m bench.up_share --models a,b --requests 16 --new-tokens 64 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import httpx

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def burst(client: httpx.AsyncClient, model: str, num_requests: int, new_tokens: int) -> tuple[int, float]:
    """(output tokens, seconds from the first send to the last answer) of num_requests concurrent chat calls."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": new_tokens,
            "temperature": 0.0, "ignore_eos": True}
    started = time.perf_counter()
    answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(num_requests)))
    elapsed = time.perf_counter() - started
    for answer in answers:
        if answer.status_code != 200:
            raise SystemExit(f"{model}: HTTP {answer.status_code}: {answer.text[:300]}")
    return sum(a.json()["usage"]["completion_tokens"] for a in answers), elapsed


async def measure(args: argparse.Namespace) -> None:
    first, second = args.models.split(",")
    headers = {"Authorization": f"Bearer {args.key}"}
    alone, together, beside = [], [], []
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600) as client:
        await burst(client, first, 2, 4)  # NOTE: warm both workers (first step, kernels) before measuring
        await burst(client, second, 2, 4)
        for round_index in range(args.rounds):
            order = ("alone", "together") if round_index % 2 == 0 else ("together", "alone")
            for kind in order:
                if kind == "alone":
                    tokens, seconds = await burst(client, first, args.requests, args.new_tokens)
                    alone.append(tokens / seconds)
                else:
                    (tokens, seconds), (b_tokens, b_seconds) = await asyncio.gather(
                        burst(client, first, args.requests, args.new_tokens),
                        burst(client, second, args.requests, args.new_tokens))
                    together.append(tokens / seconds)
                    beside.append(b_tokens / b_seconds)
            print(f"round {round_index + 1}/{args.rounds}: {first} alone {alone[-1]:.1f} tok/s, beside busy "
                  f"{second} {together[-1]:.1f} tok/s ({second} {beside[-1]:.1f})", file=sys.stderr)
    a, t = statistics.median(alone), statistics.median(together)
    print(f"{args.requests} requests x {args.new_tokens} tokens per burst, {args.rounds} rounds, medians; "
          f"{os.cpu_count()} cores on this machine")
    print(f"{first} alone: {a:.1f} tok/s; beside a busy {second}: {t:.1f} tok/s (x{t / a:.2f}); "
          f"{second} meanwhile {statistics.median(beside):.1f} tok/s")
    print("per round, together / alone: " + ", ".join(f"x{x / y:.2f}" for x, y in zip(together, alone)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--key", default=os.environ.get("SERVELAB_API_KEY"), help="default SERVELAB_API_KEY")
    parser.add_argument("--models", required=True, help="A,B: the measured model and the one kept busy beside it")
    parser.add_argument("--requests", type=int, default=16, help="concurrent requests per burst")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens each request makes (EOS ignored)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if not args.key:
        parser.error("an API key is needed: --key or SERVELAB_API_KEY (servelab keys create --tenant bench)")
    if len(args.models.split(",")) != 2:
        parser.error(f"--models {args.models!r}: name two served configs, A,B")
    if args.requests < 1 or args.new_tokens < 1 or args.rounds < 1:
        parser.error("--requests, --new-tokens and --rounds must be at least 1")
    asyncio.run(measure(args))


if __name__ == "__main__":
    main()
