"""The JSON-lines protocol between the runner and an engine adapter, and the adapter's serve loop.

An adapter process writes one line when loaded: {"ready": true, "version": ..., "info": {...}} or
{"ready": false, "error": ...}. Then for each request line {"batch_size", "prompt_ids", "new_tokens"}
it answers {"seconds", "num_output_tokens", "first_row_token_ids"} or {"error": ...}. The time is taken
here, around the engine's generate call only, identically for every engine. Standard library only: this
module runs under every peer's venv. Does not know any engine: each adapter gives `serve` a loader.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

# prompt rows -> generated token ids per row, exactly new_tokens each, greedy, EOS ignored
Generate = Callable[[list[list[int]], int], list[list[int]]]


@dataclass(frozen=True)
class AdapterArgs:
    model: str  # a folder or file, as the converter left it
    precision: str  # the engine's own label (bench/peers/peers.py)
    threads: int
    max_batch_size: int
    max_tokens: int  # prompt + new tokens of the longest call


@dataclass(frozen=True)
class Loaded:
    generate: Generate
    version: str
    info: dict[str, Any]


@dataclass(frozen=True)
class Request:
    batch_size: int
    prompt_ids: list[int]
    new_tokens: int

    def to_line(self) -> str:
        return json.dumps({"batch_size": self.batch_size, "prompt_ids": self.prompt_ids,
                           "new_tokens": self.new_tokens}) + "\n"

    @classmethod
    def from_line(cls, line: str) -> Request:
        data = json.loads(line)
        return cls(int(data["batch_size"]), [int(t) for t in data["prompt_ids"]], int(data["new_tokens"]))


def adapter_argv(args: AdapterArgs) -> list[str]:
    return ["--model", args.model, "--precision", args.precision, "--threads", str(args.threads),
            "--max-batch-size", str(args.max_batch_size), "--max-tokens", str(args.max_tokens)]


def parse_adapter_args(argv: list[str] | None = None) -> AdapterArgs:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--precision", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    a = parser.parse_args(argv)
    return AdapterArgs(a.model, a.precision, a.threads, a.max_batch_size, a.max_tokens)


def thread_env(threads: int) -> dict[str, str]:
    """Set before any engine library loads: OpenMP and BLAS pools read these once."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "OPENBLAS_NUM_THREADS": str(threads)}


def answer(generate: Generate, request: Request) -> dict[str, Any]:
    prompts = [list(request.prompt_ids) for _ in range(request.batch_size)]
    started = time.perf_counter()
    rows = generate(prompts, request.new_tokens)
    seconds = time.perf_counter() - started
    lengths = sorted({len(r) for r in rows})
    if len(rows) != request.batch_size or lengths != [request.new_tokens]:
        return {"error": f"engine returned {len(rows)} rows of lengths {lengths}, asked "
                         f"{request.batch_size} rows of {request.new_tokens}"}
    return {"seconds": seconds, "num_output_tokens": sum(len(r) for r in rows),
            "first_row_token_ids": [int(t) for t in rows[0]]}


def serve(load: Callable[[AdapterArgs], Loaded], argv: list[str] | None = None) -> None:
    """Load once, then answer request lines until stdin closes."""
    out = _claim_stdout()
    args = parse_adapter_args(argv)
    os.environ.update(thread_env(args.threads))
    try:
        loaded = load(args)
    except Exception as exc:  # noqa: BLE001 - any load failure is reported, not raised
        traceback.print_exc()
        _write(out, {"ready": False, "error": _describe(exc)})
        return
    _write(out, {"ready": True, "version": loaded.version, "info": loaded.info})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = answer(loaded.generate, Request.from_line(line))
        except Exception as exc:  # noqa: BLE001 - one failed call is a cell's error, not the end
            traceback.print_exc()
            reply = {"error": _describe(exc)}
        _write(out, reply)


def _claim_stdout() -> IO[str]:
    """Keep the real stdout for protocol lines and send fd 1 to stderr: engines print to stdout."""
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol


def _write(out: IO[str], message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 300 else text[:297] + "..."
