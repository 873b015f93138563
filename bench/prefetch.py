"""servelab's dense matmul kernels under each weight prefetch setting (blocked.cpp, `weight_prefetch`: into L1 or
L2, some 64-byte lines ahead of the loads, for the passes bound by the weights' stream: the few-row passes, 1-4 rows
in the AVX-512 build (4 blocks a pass; bf16 in units of 2 interleaved blocks: a unit a pass) and 1 row in the AVX2
one; the others prefetch 32 lines into L1 whatever the setting), side by
side in one process, rounds interleaved: GB/s of weights streamed through a model's worth of projections (--layers
copies of the four projection shapes, one after another, as a decode step reads them), at each row count and thread
count; medians of the rounds and each setting's ratio to the first per round (median). The kernel's default is
chosen by the CPU's vendor (docs/performance.md): run this on a new kind of CPU to see whether another setting
streams faster there. The outputs are checked to be the same bits under every setting (a prefetch moves no
arithmetic).

    python -m bench.prefetch --settings l1:32,l2:16 --dtypes fp32,bf16 --rows 1,4,16 --threads 1,2

Default shapes: the bundled SmolLM2-135M's (hidden 576, 9 heads and 3 kv heads of 64, intermediate 1536), 30 layers.
The weights should not fit the CPU's largest cache, or the run measures that cache, not the stream from memory: the
first line says how the two compare.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.matmul import DTYPES, SHAPES
from bench.side_by_side import positive_ints
from servelab.engine.kernels import best_isa, last_level_cache_bytes, load_blocked_kernel
from servelab.hardware import describe_hardware

REPO = Path(__file__).resolve().parents[1]


def settings_arg(text: str) -> list[tuple[str, int]]:
    """'l1:32,l2:16' -> [('l1', 32), ('l2', 16)]."""
    out = []
    for item in text.split(","):
        where, _, lines = item.strip().partition(":")
        if where not in ("l1", "l2") or not lines.isdigit() or not 1 <= int(lines) <= 1024:
            raise argparse.ArgumentTypeError(f"{item!r}: a setting is l1:LINES or l2:LINES, LINES from 1 to 1024")
        out.append((where, int(lines)))
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"{text!r} names a setting twice")
    return out


def dtypes_arg(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",")]
    if not names or any(n not in DTYPES for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}: dtypes from {', '.join(sorted(DTYPES))}, comma-separated")
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", type=settings_arg, default=settings_arg("l1:32,l2:16"))
    parser.add_argument("--dtypes", type=dtypes_arg, default=["fp32", "bf16"])
    parser.add_argument("--rows", type=positive_ints, default=[1, 4, 16])
    parser.add_argument("--threads", type=positive_ints, default=[1, 2])
    parser.add_argument("--layers", type=int, choices=range(1, 257), default=30, metavar="1..256")
    parser.add_argument("--rounds", type=int, choices=range(1, 101), default=9, metavar="1..100")
    args = parser.parse_args(argv)
    if best_isa() is None:
        parser.exit(1, "servelab's kernel cannot run on this CPU (it needs AVX2 + FMA or AVX-512)\n")
    kernel = load_blocked_kernel(REPO / ".cache").module
    default = kernel.weight_prefetch()
    llc = last_level_cache_bytes()
    torch.manual_seed(0)
    packed = {name: [kernel.pack((torch.randn(n, k) * 0.05).to(DTYPES[name]))
                     for _ in range(args.layers) for n, k in SHAPES] for name in args.dtypes}
    nbytes = {name: sum(w.numel() * w.element_size() for w in ws) for name, ws in packed.items()}
    cache = f"largest cache {llc / 2**20:.0f} MiB; " if llc else "largest cache unknown; "
    print(f"cpu: {describe_hardware().cpu}; servelab {kernel.isa()} build; default setting {default[0]}:{default[1]}; "
          + cache + "weights " + ", ".join(f"{name} {b / 2**20:.0f} MiB" for name, b in nbytes.items())
          + f"; {args.rounds} rounds interleaved, medians", flush=True)
    if llc and min(nbytes.values()) <= 2 * llc:
        print("NOTE: the weights are not twice the largest cache: raise --layers to measure the memory stream",
              flush=True)
    try:
        for name, weights in packed.items():
            for rows in args.rows:
                inputs = [torch.randn(rows, k).to(DTYPES[name]) for _ in range(args.layers) for _, k in SHAPES]
                outputs = []
                for where, lines in args.settings:
                    kernel.weight_prefetch(where, lines)
                    outputs.append([kernel.linear(x, w) for x, w in zip(inputs, weights)])
                assert all(all(torch.equal(a, b) for a, b in zip(outputs[0], other)) for other in outputs[1:]), (
                    "a prefetch setting changed the outputs")
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    speeds: dict[tuple[str, int], list[float]] = {s: [] for s in args.settings}
                    for r in range(args.rounds):
                        for setting in args.settings if r % 2 == 0 else args.settings[::-1]:
                            kernel.weight_prefetch(*setting)
                            started = time.perf_counter()
                            for x, w in zip(inputs, weights):
                                kernel.linear(x, w)
                            speeds[setting].append(nbytes[name] / (time.perf_counter() - started) / 1e9)
                    first = speeds[args.settings[0]]
                    print(f"{name}, {rows} row(s), {threads} thread(s): " + " | ".join(
                        f"{where}:{lines} {statistics.median(s):.1f} GB/s "
                        f"(x{statistics.median(a / b for a, b in zip(s, first)):.2f})"
                        for (where, lines), s in speeds.items()), flush=True)
    finally:
        kernel.weight_prefetch(*default)


if __name__ == "__main__":
    main()
