"""What structured output costs a decode step: one engine, free rows against rows held to a JSON schema (llguidance's
mask computed and applied every step), side by side in one process, interleaved round by round, one thread:

    python -m bench.structured --config configs/fp32.yaml --batch-sizes 1,8 --rounds 3

decode tok/s = B x (N - 1) / (t_N - t_1) with N = 64 new tokens for both: the free rows ignore EOS, and the
schema (an array of at least 64 small records: a bounded string, an enum, an integer) cannot close before N
tokens. Then the constraint's own work per step timed alone (the rows' masks, the masked sampler against the free
one), which a busy machine blurs less than two decode rates. Also printed: the mixed batch (one constrained row among free ones) against free rows alone, which is what a
free row pays for a constrained batch-mate, and the constraint's compile time (its first use) against a cached use.
"""

from __future__ import annotations

import statistics
import sys
import time
from types import SimpleNamespace

import torch

from bench.side_by_side import config_bench_args
from servelab.engine.engine import Engine, _allowed
from servelab.engine.sampling import sample_next
from servelab.engine.grammar import constraint_json
from servelab.hardware import describe_hardware
from servelab.request import ChatMessage, GenerationRequest, SamplingParams
from servelab.settings import Settings

NEW_TOKENS = 64
SCHEMA = {"type": "array", "minItems": NEW_TOKENS, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "kind": {"enum": ["cat", "dog", "bird"]},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "kind", "age"], "additionalProperties": False}}
QUESTION = (ChatMessage("user", "List animals as JSON records with a name, a kind and an age."),)


def _requests(rows: int, new_tokens: int, constrained: int) -> list[GenerationRequest]:
    """`constrained` of the rows held to SCHEMA, the rest free (EOS ignored): each decodes exactly new_tokens."""
    held = SamplingParams(max_new_tokens=new_tokens, constraint=constraint_json(SCHEMA))
    free = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    return [GenerationRequest(f"r{i}", messages=QUESTION, params=held if i < constrained else free)
            for i in range(rows)]


def _timed(engine: Engine, requests: list[GenerationRequest]) -> float:
    started = time.perf_counter()
    result = engine.generate(requests)
    elapsed = time.perf_counter() - started
    assert all(len(c.token_ids) == requests[0].params.max_new_tokens for c in result.completions), "a row ended early"
    return elapsed


def _rate(engine: Engine, rows: int, constrained: int) -> float:
    one = _timed(engine, _requests(rows, 1, constrained))
    full = _timed(engine, _requests(rows, NEW_TOKENS, constrained))
    return rows * (NEW_TOKENS - 1) / (full - one)


def _mask_cost(engine: Engine, rows: int, repeats: int = 200) -> str:
    """The constraint's own work per decode step, timed alone (less noisy than two decode rates on a busy machine):
    the rows' bitmasks (llguidance), then the sampler with the masks against the sampler without."""
    matchers = [engine.decodings.matcher(constraint_json(SCHEMA)) for _ in range(rows)]
    answer = engine.tokenizer.encode('[{"name":"Rex","kind":"dog","age":3},{"name":"Tom","kind":"cat","age":', 
                                     add_special_tokens=False)
    for m in matchers:
        assert m.consume_tokens(answer), m.get_error()
    held = [SimpleNamespace(matcher=m) for m in matchers]
    vocab = engine.loaded.shape.vocab_size
    logits = torch.randn(rows, vocab)
    params = [SamplingParams()] * rows
    args = (logits, params, [None] * rows, [[]] * rows, [[]] * rows, [()] * rows)

    def per_call_ms(fn) -> float:
        fn()
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - started) * 1e3 / repeats

    masks_ms = per_call_ms(lambda: _allowed(held, vocab))
    allowed = _allowed(held, vocab)
    free_ms = per_call_ms(lambda: sample_next(*args))
    masked_ms = per_call_ms(lambda: sample_next(*args, allowed))
    return (f"batch {rows}: per step (every row masked in full: sampled rows, greedy ones whose best token is refused), the masks {masks_ms:.3f} ms, the sampler {free_ms:.3f} ms free against "
            f"{masked_ms:.3f} ms masked: {masks_ms + masked_ms - free_ms:.3f} ms a step for the constraint")


def main(argv: list[str] | None = None) -> int:
    args, config = config_bench_args("python -m bench.structured", __doc__.split("\n\n")[0], argv, batch_sizes=[1, 8], rounds=3)
    torch.set_num_threads(1)
    engine = Engine.from_config(config, Settings())
    print(f"{config.name}: {engine.kernel}; CPU {describe_hardware().cpu}, 1 thread", flush=True)
    started = time.perf_counter()
    engine.generate(_requests(1, 1, 1))  # NOTE: the first use builds llguidance's tokenizer and compiles the schema
    first_ms = (time.perf_counter() - started) * 1e3
    started = time.perf_counter()
    engine.generate(_requests(1, 1, 1))
    print(f"first constrained request (tokenizer built, schema compiled) {first_ms:.0f} ms; the next "
          f"{(time.perf_counter() - started) * 1e3:.0f} ms (compiled: cached)", flush=True)
    engine.generate(_requests(2, 4, 0))  # warm-up
    for rows in args.batch_sizes:
        kinds = {"free": 0, "constrained": rows} | ({"one constrained": 1} if rows > 1 else {})
        rates: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(args.rounds):
            for kind, constrained in kinds.items():
                rates[kind].append(_rate(engine, rows, constrained))
        free = statistics.median(rates["free"])
        said = ", ".join(f"{kind} {statistics.median(r):.1f} (x{statistics.median(r) / free:.3f})"
                         for kind, r in rates.items())
        print(f"batch {rows}: decode tok/s {said}; rounds: " + "; ".join(
            f"{kind} " + " ".join(f"{v:.1f}" for v in r) for kind, r in rates.items()), flush=True)
        print(_mask_cost(engine, rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
