"""A config's decode speed with the weights on 4 KB pages against the huge-page arena (servelab/engine/arena.py),
two engines side by side in one process, interleaved (bench.side_by_side), one thread:

    python -m bench.huge_pages --config configs/awq-int4-fast.yaml --batch-sizes 1,16 --rounds 5

It also prints how much of the arena the kernel backed with huge pages. Where transparent huge pages are off
(or not Linux) the second engine has no arena either, and the script says so instead of measuring.
"""

from __future__ import annotations

import sys

import torch

from bench.side_by_side import compare_decode, config_bench_args
from servelab.engine.engine import Engine
from servelab.settings import Settings


def main(argv: list[str] | None = None) -> int:
    args, config = config_bench_args("python -m bench.huge_pages", __doc__.split("\n\n")[0], argv, batch_sizes=[1, 16], rounds=5)
    torch.set_num_threads(1)
    settings = Settings()  # SERVELAB_CACHE_DIR, else .cache
    plain = Engine.from_config(config, settings.model_copy(update={"huge_pages": False}))
    huge = Engine.from_config(config, settings.model_copy(update={"huge_pages": True}))
    if huge.arena is None:
        print(f"{config.name}: no arena here (transparent huge pages off or absent, or a decoder that is not "
              "servelab's on a CPU): nothing to compare", flush=True)
        return 1
    print(f"{config.name}: arena of {huge.arena.num_bytes / 1e6:.1f} MB on {huge.arena.huge_page_bytes >> 21} huge "
          f"pages of 2 MB (transparent huge pages: {huge.arena.mode})", flush=True)
    compare_decode({"4 KB pages": plain, "huge pages": huge}, args.batch_sizes, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
