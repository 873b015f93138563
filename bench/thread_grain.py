"""Where a second thread starts to pay in servelab's kernels (the grain, min_thread_bytes in blocked.cpp): one fp32
matmul at one row (a decode step's shape: K = 576) of growing weight bytes, every thread count given, the grain
set to 0 so every call splits; rounds interleaved, the fastest and the median of the rounds, and the speed-up
over one thread. Also the four projections of a SmolLM2 layer at 1, 16 and 512 rows (decode, and a 512-token
prefill's matmuls) with the default grain.

    python -m bench.thread_grain --threads 1,2 --rounds 15

NOTE: on a machine other processes share, a thread that is descheduled holds the whole call at OpenMP's join:
read the fastest round, and run it on an idle machine for figures to quote.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.side_by_side import positive_ints
from servelab.engine.kernels import best_isa, load_blocked_kernel

REPO = Path(__file__).resolve().parents[1]
DECODE_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2-135M: qkv, o, gate_up, down


def timed(fn, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


def run(kernel, cases: dict[str, callable], threads: list[int], rounds: int, calls: int) -> None:
    seconds: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for name, fn in cases.items():
            for n in threads:
                torch.set_num_threads(n)
                seconds.setdefault((name, n), []).append(timed(fn, calls))
    for name in cases:
        one = min(seconds[(name, threads[0])])
        cells = []
        for n in threads:
            s = seconds[(name, n)]
            cells.append(f"{n}t {min(s) * 1e6:8.1f} us (median {statistics.median(s) * 1e6:8.1f}) x{one / min(s):.2f}")
        print(f"{name:>28}: " + " | ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=positive_ints, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--isa", default=None, help="avx512 or avx2 (default: the widest this CPU runs)")
    args = parser.parse_args()
    blocked = load_blocked_kernel(REPO / ".cache", args.isa)
    kernel = blocked.module
    assert kernel is not None, blocked.reason
    print(f"{blocked.label} ({args.isa or best_isa().name}); built with OpenMP: {kernel.parallel()}; "
          f"default grain {kernel.thread_grain() // 1024} KB; threads {args.threads}; {args.rounds} rounds, interleaved")
    torch.manual_seed(0)
    default_grain = kernel.thread_grain(0)
    x = torch.randn(1, 576)
    cases = {}
    for outputs in (16, 32, 64, 128, 256, 512, 1024):
        packed = kernel.pack(torch.randn(outputs, 576))
        cases[f"grain 0: 1 row, {outputs * 576 * 4 // 1024} KB"] = (lambda p=packed: kernel.linear(x, p))
    run(kernel, cases, args.threads, args.rounds, calls=200)
    kernel.thread_grain(default_grain)
    for dtype in (torch.float32, torch.bfloat16):
        weights = [kernel.pack(torch.randn(n, k).to(dtype)) for n, k in DECODE_SHAPES]
        cases = {}
        for rows in (1, 16, 512):  # decode at batch 1 and 16; a 512-token prefill's matmuls
            xs = [torch.randn(rows, k).to(dtype) for _, k in DECODE_SHAPES]
            cases[f"layer {str(dtype)[6:]} {rows} row(s)"] = (
                lambda xs=xs: [kernel.linear(x, w) for x, w in zip(xs, weights)])
        run(kernel, cases, args.threads, args.rounds, calls=3)


if __name__ == "__main__":
    main()
