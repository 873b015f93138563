"""The command line of the peer benchmark: parsing and validation, nothing else.

Knows the option names, their defaults and their allowed values; raises OptionError with a message
naming the option. Does not know whether a peer is installed: bench/peers/peers.py does.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

PRECISIONS = ("fp32", "bf16", "int4")
ENGINES = ("servelab", "vllm", "llamacpp", "ct2", "ortgenai")
MAX_BATCH_SIZE = 256
MAX_TOKENS = 2048  # prompt + new tokens: the servelab configs' max_context_tokens


class OptionError(ValueError):
    """A command-line option is malformed or out of range; the message says which and why."""


@dataclass(frozen=True)
class Options:
    precisions: tuple[str, ...] = PRECISIONS
    batch_sizes: tuple[int, ...] = (1, 16, 64)
    engines: tuple[str, ...] = ENGINES
    threads: tuple[int, ...] = (1,)  # every count is a run of its own; the scaling table compares them
    rounds: int = 3
    prompt_tokens: int = 64
    new_tokens: int = 64
    json_path: Path | None = None


def parse_options(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.peers",
        description="servelab's engine against peer engines on the bundled model: decode and end-to-end tok/s.",
    )
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help=f"comma list of {', '.join(PRECISIONS)}")
    parser.add_argument("--batch-sizes", default="1,16,64", help="comma list of positive integers")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)}")
    parser.add_argument("--threads", default="1", help="compute threads given to every engine: a comma list runs "
                        "every engine at each count, and a table compares the counts (default 1)")
    parser.add_argument("--rounds", default="3", help="interleaved rounds; medians are reported")
    parser.add_argument("--prompt-tokens", default="64", help="prompt length in tokens, the same for every row")
    parser.add_argument("--new-tokens", default="64", help="generated tokens per row (EOS ignored), at least 2")
    parser.add_argument("--json", default=None, help="also write the full results to this JSON file")
    args = parser.parse_args(argv)
    return validate(
        precisions=_names(args.precisions, "--precisions", PRECISIONS),
        batch_sizes=tuple(_int(v, "--batch-sizes") for v in _items(args.batch_sizes, "--batch-sizes")),
        engines=_names(args.engines, "--engines", ENGINES),
        threads=tuple(_int(v, "--threads") for v in _items(args.threads, "--threads")),
        rounds=_int(args.rounds, "--rounds"),
        prompt_tokens=_int(args.prompt_tokens, "--prompt-tokens"),
        new_tokens=_int(args.new_tokens, "--new-tokens"),
        json_path=Path(args.json) if args.json else None,
    )


def validate(*, precisions: tuple[str, ...], batch_sizes: tuple[int, ...], engines: tuple[str, ...],
             threads: tuple[int, ...],
             rounds: int, prompt_tokens: int, new_tokens: int, json_path: Path | None) -> Options:
    if "servelab" not in engines:
        raise OptionError("--engines must include servelab: every ratio is taken against it")
    for size in batch_sizes:
        if not 1 <= size <= MAX_BATCH_SIZE:
            raise OptionError(f"--batch-sizes: each must be between 1 and {MAX_BATCH_SIZE}, got {size}")
    if len(set(batch_sizes)) != len(batch_sizes):
        raise OptionError(f"--batch-sizes: repeated value in {list(batch_sizes)}")
    if min(threads) < 1:
        raise OptionError(f"--threads must be at least 1, got {min(threads)}")
    if len(set(threads)) != len(threads):
        raise OptionError(f"--threads: repeated value in {list(threads)}")
    if rounds < 1:
        raise OptionError(f"--rounds must be at least 1, got {rounds}")
    if prompt_tokens < 1:
        raise OptionError(f"--prompt-tokens must be at least 1, got {prompt_tokens}")
    if new_tokens < 2:
        raise OptionError(f"--new-tokens must be at least 2 (decode tok/s compares it with a 1-token call), "
                          f"got {new_tokens}")
    if prompt_tokens + new_tokens > MAX_TOKENS:
        raise OptionError(f"--prompt-tokens + --new-tokens must be at most {MAX_TOKENS}, "
                          f"got {prompt_tokens + new_tokens}")
    if json_path is not None and not json_path.parent.is_dir():
        raise OptionError(f"--json: folder {json_path.parent} does not exist")
    return Options(precisions, tuple(batch_sizes), engines, tuple(threads), rounds, prompt_tokens, new_tokens,
                   json_path)


def _items(value: str, option: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise OptionError(f"{option}: give at least one value")
    return items


def _names(value: str, option: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    names = _items(value, option)
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise OptionError(f"{option}: unknown {', '.join(unknown)}; choose from {', '.join(allowed)}")
    if len(set(names)) != len(names):
        raise OptionError(f"{option}: repeated value in {names}")
    return tuple(names)


def _int(value: str, option: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise OptionError(f"{option}: {value!r} is not an integer") from None
