"""servelab's blocked matmul against torch's F.linear (MKL or oneDNN on CPU) on a model's four projection shapes, side
by side in one process, rounds interleaved: GFLOP/s over the four shapes (q/k/v joined, o, gate/up joined, down) at
each row count and thread count, medians of the rounds, and servelab's ratio to torch per round (median) with the
rounds it was faster in. The outputs are checked to agree (fp32: 1e-4 relative; bf16: 2e-2) before timing.

    python -m bench.matmul --dtype fp32 --rows 1,16,512 --threads 1,2

Default shapes: the bundled SmolLM2-135M's (hidden 576, 9 heads and 3 kv heads of 64, intermediate 1536).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.side_by_side import positive_ints
from servelab.engine.kernels import best_isa, load_blocked_kernel
from servelab.hardware import describe_hardware

REPO = Path(__file__).resolve().parents[1]
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K): q/k/v, o, gate/up, down
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--rows", type=positive_ints, default=[1, 16, 512])
    parser.add_argument("--threads", type=positive_ints, default=[1, 2])
    parser.add_argument("--rounds", type=int, choices=range(1, 101), default=7, metavar="1..100")
    args = parser.parse_args(argv)
    if best_isa() is None:
        parser.exit(1, "servelab's kernel cannot run on this CPU (it needs AVX2 + FMA or AVX-512)\n")
    kernel = load_blocked_kernel(REPO / ".cache").module
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    weights = [(torch.randn(n, k) * 0.05).to(dtype) for n, k in SHAPES]
    packed = [kernel.pack(w) for w in weights]
    print(f"cpu: {describe_hardware().cpu}; servelab {kernel.isa()} build; {args.dtype}; {args.rounds} rounds "
          "interleaved, medians", flush=True)
    for rows in args.rows:
        inputs = [torch.randn(rows, k).to(dtype) for _, k in SHAPES]
        for w, p, x in zip(weights, packed, inputs):
            torch.testing.assert_close(kernel.linear(x, p).float(), F.linear(x, w).float(),
                                       **({"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else
                                          {"atol": 2e-2, "rtol": 2e-2}))
        forms = {"servelab": lambda: [kernel.linear(x, p) for x, p in zip(inputs, packed)],
                 "torch": lambda: [F.linear(x, w) for x, w in zip(inputs, weights)]}
        flops = sum(2 * rows * n * k for n, k in SHAPES)
        reps = max(1, 2048 // rows)
        for threads in args.threads:
            torch.set_num_threads(threads)
            speeds: dict[str, list[float]] = {name: [] for name in forms}
            for name, run in forms.items():
                run()  # warm-up
            for r in range(args.rounds):
                for name in forms if r % 2 == 0 else list(forms)[::-1]:
                    started = time.perf_counter()
                    for _ in range(reps):
                        forms[name]()
                    speeds[name].append(flops * reps / (time.perf_counter() - started) / 1e9)
            ratios = [s / t for s, t in zip(speeds["servelab"], speeds["torch"])]
            print(f"{rows} row(s), {threads} thread(s): servelab {statistics.median(speeds['servelab']):.1f} GFLOP/s | "
                  f"torch {statistics.median(speeds['torch']):.1f} GFLOP/s | servelab / torch "
                  f"x{statistics.median(ratios):.2f} ({sum(x > 1 for x in ratios)} of {len(ratios)} faster)", flush=True)


if __name__ == "__main__":
    main()
