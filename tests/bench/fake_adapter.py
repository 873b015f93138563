"""A stand-in engine for the protocol tests: row r's token i is 100 * r + i, instantly.

--precision picks a behaviour: "ok", "fail-load" (raises while loading), "short" (one token too few), "record"
(loading takes 0.3 s and appends "pid start end" to the file --model names).
"""

from __future__ import annotations

import os
import time

from bench.peers.protocol import AdapterArgs, Loaded, serve


def load(args: AdapterArgs) -> Loaded:
    if args.precision == "fail-load":
        raise RuntimeError("no such model")
    if args.precision == "record":
        started = time.time()
        time.sleep(0.3)
        with open(args.model, "a") as log:
            log.write(f"{os.getpid()} {started} {time.time()}\n")
    missing = 1 if args.precision == "short" else 0

    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        print("engines print to stdout; the protocol must not see this")
        return [[100 * r + i for i in range(new_tokens - missing)] for r in range(len(prompts))]

    return Loaded(generate, "0.0-fake", {"threads": args.threads})


if __name__ == "__main__":
    serve(load)
