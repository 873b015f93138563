"""One layer's fused decode attention (blocked.cpp's decode_step_attention) over a paged pool in fp32, bf16 and
int8, per kernel build this CPU runs, interleaved call by call (the order alternating), one thread:

    python -m bench.kv_attention --rows 16,64 --tokens 1488 --calls 7

The bundled model's attention shape (9 query heads, 3 kv heads, head_dim 64, blocks of 16), random keys and values,
every row holding --tokens columns in blocks of its own; fp32 queries. Prints the median and least time of a call
per precision and the median's ratio against fp32. `servelab bench kv-dtype` measures whole decode steps.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from servelab.engine.kernels import ISAS, isa_reason, load_blocked_kernel
from servelab.engine.kvcache import quantize_heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,64")
    parser.add_argument("--tokens", type=int, default=1488)
    parser.add_argument("--calls", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    H, H_kv, D, bs = 9, 3, 64, 16
    for isa in ISAS:
        if (reason := isa_reason(isa)) is not None:
            print(f"{isa.label}: skipped ({reason})")
            continue
        kernel = load_blocked_kernel(Path(".cache"), isa.name).module
        for B in (int(r) for r in args.rows.split(",")):
            span = -(-(args.tokens + 1) // bs)
            generator = torch.Generator().manual_seed(0)
            keys, values = (torch.randn(B * span, H_kv, bs, D, generator=generator) for _ in range(2))
            (k8, ks), (v8, vs) = quantize_heads(keys), quantize_heads(values)
            pools = {"fp32": (keys, values, ()), "bf16": (keys.bfloat16(), values.bfloat16(), ()),
                     "int8": (k8, v8, (ks, vs))}
            table = torch.arange(B * span, dtype=torch.int32).view(B, span)
            cos, sin = torch.ones(args.tokens + 1, D), torch.zeros(args.tokens + 1, D)
            qkv = torch.randn(B, H + 2 * H_kv, D, generator=generator)
            lengths = torch.full((B,), args.tokens, dtype=torch.long)
            times: dict[str, list[float]] = {name: [] for name in pools}
            for call in range(args.calls):
                for name in (list(pools) if call % 2 == 0 else list(pools)[::-1]):
                    k, v, scales = pools[name]
                    start = time.perf_counter()
                    kernel.decode_step_attention(qkv, cos, sin, lengths, k, v, lengths, table, H, D ** -0.5, *scales)
                    times[name].append(time.perf_counter() - start)
            base = statistics.median(times["fp32"])
            print(f"{isa.label}, {B} rows x {args.tokens} tokens: " + " | ".join(
                f"{name} {1e3 * statistics.median(t):.1f} ms (least {1e3 * min(t):.1f}) x{base / statistics.median(t):.2f}"
                for name, t in times.items()))


if __name__ == "__main__":
    main()
