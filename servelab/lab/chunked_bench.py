"""`servelab bench chunked`: what a long newcomer's prefill costs the rows already decoding, in the engine itself.

Per round: N rows (short questions, EOS ignored) are added and stepped until each has made a few tokens; then a
window of plain decode steps (the rows alone); then a newcomer with a long prompt joins (Engine.add) and the
engine is stepped until the newcomer's first token has come and every row has made one more token after it. The
rows' inter-token gaps come from their Completions' token_times_ms (the engine's own clock; the rows are
cancelled at the round's end to hand them back): the gaps that end inside the window, against those that end
between the newcomer's add and the rows' first token after its first token. The newcomer's TTFT is the wall time
from its add to the call that returned its first token, beside the engine's own `ttft_ms`. An engine that
prefills a prompt whole does it inside add (one long gap per row); one with chunked prefill spreads it over steps
of at most `batching.max_prefill_tokens` prompt tokens (more, shorter gaps). Each round's newcomer opens with its
own round number, so a prefix cache never serves one round's prompt to the next. Does not parse options or print.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from servelab.analysis.stats import percentile
from servelab.analysis.workload import builtin_prompts, system_prompt
from servelab.engine.engine import Engine
from servelab.outputs import Completion, StepOutput
from servelab.request import GenerationRequest, SamplingParams


class ChunkedBenchError(RuntimeError):
    """The round could not be measured as asked; the message says why and what to change."""


@dataclass(frozen=True)
class ChunkedShape:
    num_rows: int = 15
    newcomer_tokens: int = 1_500
    window_steps: int = 32  # plain decode steps measured with the rows alone
    warmup_steps: int = 4  # decode steps after every row's first token, before the window

    def rows_max_new_tokens(self, budget: int) -> int:
        """Tokens a row must be allowed to make: warm-up, window, and one per call until the newcomer's first token
        and one after it (a chunked prefill takes about newcomer_tokens / (budget - the decoding rows) calls: one
        step's token budget covers the decode rows and the chunk)."""
        return self.warmup_steps + self.window_steps + -(-self.newcomer_tokens // max(1, budget - self.num_rows)) + 4


@dataclass(frozen=True)
class ChunkedRound:
    alone_gaps_ms: tuple[float, ...]  # the rows' inter-token gaps in the window of plain decode steps
    joined_gaps_ms: tuple[float, ...]  # their gaps from the newcomer's add to their first token after its first
    newcomer_wall_ttft_ms: float  # its add to the return of the call that gave its first token
    newcomer_engine_ttft_ms: float | None  # the newcomer's Completion.ttft_ms (from its prefill's start)
    num_calls: int  # engine calls (add and steps) from the newcomer's add to its first token, both included

    @property
    def alone_p95_ms(self) -> float:
        return percentile(self.alone_gaps_ms, 95)

    @property
    def joined_p95_ms(self) -> float:
        return percentile(self.joined_gaps_ms, 95)


def newcomer_request(engine: Engine, round_no: int, num_tokens: int) -> GenerationRequest:
    """A plain prompt of exactly num_tokens tokens of English (the library desk's instructions, repeated), opening
    with the round's number; it makes one token, so it leaves the batch as soon as its prefill ends."""
    text = f"Round {round_no}. " + "\n\n".join([system_prompt("library")] * (2 + num_tokens // 500))
    ids = engine.tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    return GenerationRequest(f"newcomer-{round_no}", prompt=engine.tokenizer.decode(ids),
                             params=SamplingParams(max_new_tokens=1, ignore_eos=True), prompt_token_ids=tuple(ids))


def running_requests(round_no: int, num_rows: int, max_new_tokens: int) -> list[GenerationRequest]:
    questions = builtin_prompts("library")
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return [GenerationRequest(f"row-{round_no}-{i}", prompt=questions[i % len(questions)], params=params)
            for i in range(num_rows)]


def run_chunked_round(engine: Engine, shape: ChunkedShape, *, round_no: int) -> ChunkedRound:
    if engine.num_live:
        raise ChunkedBenchError("the engine has rows running: the bench needs it to itself")
    budget = engine.config.batching.max_prefill_tokens
    # NOTE: the rows' own prompts are prefilled in chunks too: the first rows make tokens while the last still prefill
    own_prefill = sum(len(engine.encode(r)) for r in running_requests(round_no, shape.num_rows, 1)) // budget + 2
    rows = running_requests(round_no, shape.num_rows, shape.rows_max_new_tokens(budget) + own_prefill)
    newcomer = newcomer_request(engine, round_no, shape.newcomer_tokens)
    made = dict.fromkeys((r.request_id for r in rows), 0)  # tokens each running row has made so far
    ended: list[Completion] = []  # the newcomer's completion, once it has one

    def call(step: Callable[[], StepOutput]) -> bool:
        """One engine call, the rows' counts updated; -> whether it gave the newcomer its first token."""
        out = step()
        if any(c.request_id in made for c in out.finished):
            raise ChunkedBenchError("a running row finished before the round's end (an error, or its token cap): "
                                    + "; ".join(f"{c.request_id}: {c.error or c.finish_reason}" for c in out.finished))
        ended.extend(c for c in out.finished if c.request_id == newcomer.request_id)
        for request_id, _ in out.new_tokens:
            if request_id in made:
                made[request_id] += 1
        return any(request_id == newcomer.request_id for request_id, _ in out.new_tokens)

    call(lambda: engine.add(rows))
    for _ in range(shape.newcomer_tokens + 64 * len(rows)):  # NOTE: a chunked engine may prefill the rows over steps
        if min(made.values()) >= 1:
            break
        call(engine.step)
    for _ in range(shape.warmup_steps):
        call(engine.step)
    window_start = dict(made)
    for _ in range(shape.window_steps):
        call(engine.step)
    joined_start = dict(made)
    added, num_calls = time.perf_counter(), 1
    before_first = dict(made)
    has_first = call(lambda: engine.add([newcomer]))
    while not has_first:
        if num_calls > shape.newcomer_tokens + 8:
            raise ChunkedBenchError(f"no first token for the newcomer after {num_calls} engine calls")
        before_first = dict(made)
        has_first = call(engine.step)
        num_calls += 1
    first = time.perf_counter()
    if any(c.error for c in ended):
        raise ChunkedBenchError(f"the newcomer failed: {ended[0].error}")
    # NOTE: each row's token numbered before_first[r] is the first it made in or after the call that gave the
    # newcomer its first token: the one that waited on the newcomer's prefill (or its last chunk)
    while any(made[r] <= before_first[r] for r in made):
        call(engine.step)
    completions = {c.request_id: c for c in engine.cancel(list(made))}
    return ChunkedRound(_gaps(completions, window_start, joined_start),
                        _gaps(completions, joined_start, {r: n + 1 for r, n in before_first.items()}),
                        (first - added) * 1e3, next((c.ttft_ms for c in ended), None), num_calls)


def _gaps(completions: dict[str, Completion], first: dict[str, int], end: dict[str, int]) -> tuple[float, ...]:
    """Each row's inter-token gaps, in ms, that end at its tokens numbered first[r] .. end[r] - 1 (from 0)."""
    gaps = []
    for request_id, c in completions.items():
        times = c.token_times_ms
        assert len(times) >= end[request_id], f"{request_id}: {len(times)} token times, {end[request_id]} expected"
        gaps += [times[k] - times[k - 1] for k in range(max(1, first[request_id]), end[request_id])]
    return tuple(gaps)


def run_chunked_bench(engine: Engine, shape: ChunkedShape, *, num_rounds: int,
                      progress: Callable[[str], None] = lambda _: None) -> list[ChunkedRound]:
    rounds = []
    for round_no in range(1, num_rounds + 1):
        progress(f"round {round_no}/{num_rounds}: {shape.num_rows} rows decoding, a {shape.newcomer_tokens}-token "
                 "newcomer joins")
        rounds.append(run_chunked_round(engine, shape, round_no=round_no))
    return rounds


def format_chunked_table(rounds: list[ChunkedRound]) -> str:
    lines = [f"{'round':>5} {'rows alone p95 ms':>17} {'with newcomer p95 ms':>20} {'ratio':>7} {'calls':>5} "
             f"{'newcomer TTFT ms':>16} {'engine TTFT ms':>14}"]
    for i, r in enumerate(rounds, start=1):
        engine_ttft = "n/a" if r.newcomer_engine_ttft_ms is None else f"{r.newcomer_engine_ttft_ms:.1f}"
        lines.append(f"{i:>5} {r.alone_p95_ms:>17.1f} {r.joined_p95_ms:>20.1f} {r.joined_p95_ms / r.alone_p95_ms:>6.2f}x "
                     f"{r.num_calls:>5} {r.newcomer_wall_ttft_ms:>16.1f} {engine_ttft:>14}")
    ratio = statistics.median(r.joined_p95_ms / r.alone_p95_ms for r in rounds)
    ttft = statistics.median(r.newcomer_wall_ttft_ms for r in rounds)
    lines.append(f"running rows' p95 inter-token time while the newcomer is prefilled, against the same rows alone: "
                 f"x{ratio:.2f} (median of {len(rounds)} round(s)); the newcomer's TTFT {ttft:.0f} ms")
    lines.append("calls = engine calls from the newcomer's add to its first token; TTFT from its add (wall) and from "
                 "its prefill's start (the engine's own)")
    return "\n".join(lines)
