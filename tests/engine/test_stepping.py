"""The stepping engine: rows join and leave a running batch at any step, and decode as if alone."""

from __future__ import annotations

from dataclasses import replace

import random

import pytest

from servelab.engine.engine import Engine
from servelab.outputs import Completion, FinishReason
from servelab.request import GenerationRequest, SamplingParams
from tests.engine.naive import naive_greedy

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "river", "blue", "seven", "quickly", "house"]


def _request(rng: random.Random, request_id: str, **params) -> GenerationRequest:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
    return GenerationRequest(request_id, prompt=prompt,
                             params=SamplingParams(max_new_tokens=rng.randint(1, 20), **params))


def _run_schedule(engine: Engine, arrivals: dict[int, list[GenerationRequest]]) -> dict[str, Completion]:
    """Add each step's arrivals, then step; until every request has finished."""
    done: dict[str, Completion] = {}
    step = 0
    last_arrival = max(arrivals)
    while step <= last_arrival or engine.num_live:
        if arrivals.get(step):
            done.update((c.request_id, c) for c in engine.add(arrivals[step]).finished)
        done.update((c.request_id, c) for c in engine.step().finished)
        step += 1
    return done


@pytest.mark.parametrize("schedule_seed", range(8))
def test_rows_joining_and_leaving_at_random_steps_decode_like_naive(either_engine: Engine, schedule_seed: int) -> None:
    rng = random.Random(schedule_seed)
    arrivals: dict[int, list[GenerationRequest]] = {}
    for i in range(rng.randint(3, 9)):
        arrivals.setdefault(rng.randint(0, 25), []).append(_request(rng, f"r{i}"))
    done = _run_schedule(either_engine, arrivals)
    for request in (r for group in arrivals.values() for r in group):
        completion = done[request.request_id]
        expected = naive_greedy(either_engine.model, either_engine.encode(request), request.params.max_new_tokens,
                                either_engine.eos_token_ids)
        assert list(completion.token_ids) == expected, (schedule_seed, request.request_id)
    assert either_engine.num_live == 0


def test_a_seeded_row_samples_the_same_tokens_whoever_joins(tiny_engine: Engine) -> None:
    rng = random.Random(5)
    sampled = GenerationRequest("s", prompt="the river", params=SamplingParams(max_new_tokens=16, temperature=1.0,
                                                                             seed=11))
    alone = tiny_engine.generate([sampled]).completions[0]
    arrivals = {0: [_request(rng, "a")], 3: [sampled, _request(rng, "b")], 6: [_request(rng, "c", temperature=0.8)]}
    assert _run_schedule(tiny_engine, arrivals)["s"].token_ids == alone.token_ids


def test_every_step_reports_each_rows_token_and_the_rows_that_finished(tiny_engine: Engine) -> None:
    short = GenerationRequest("short", prompt="the cat", params=SamplingParams(max_new_tokens=2))
    long = GenerationRequest("long", prompt="a blue house", params=SamplingParams(max_new_tokens=4))
    first = tiny_engine.add([long])
    assert [rid for rid, _ in first.new_tokens] == ["long"] and not first.finished
    joined = tiny_engine.add([short])
    # NOTE: servelab's paged engine prefills a newcomer in the next step, beside the decoding rows (chunked
    # prefill); transformers' prefills it whole at once
    assert [rid for rid, _ in joined.new_tokens] == ([] if tiny_engine.blocks is not None else ["short"])
    step = tiny_engine.step()
    assert [rid for rid, _ in step.new_tokens] == ["long", "short"]
    if tiny_engine.blocks is not None:
        assert not step.finished
        step2 = tiny_engine.step()
        assert [rid for rid, _ in step2.new_tokens] == ["long", "short"]
        step = replace(step, new_tokens=step.new_tokens + step2.new_tokens, finished=step2.finished)
    assert [c.request_id for c in step.finished] == ["short"] and tiny_engine.live_request_ids == ["long"]
    tokens = [t for _, t in first.new_tokens] + [t for rid, t in step.new_tokens if rid == "long"]
    while tiny_engine.num_live:
        out = tiny_engine.step()
        tokens += [t for _, t in out.new_tokens]
    assert tuple(tokens) == out.finished[0].token_ids and out.finished[0].finish_reason is FinishReason.LENGTH


def test_kv_tokens_follow_the_rows_held_at_every_step(either_engine: Engine) -> None:
    """The cache holds each row's prompt and fed tokens; the stats keep the fullest step."""
    a = GenerationRequest("a", prompt="the cat sat on the mat", params=SamplingParams(max_new_tokens=5))
    b = GenerationRequest("b", prompt="blue", params=SamplingParams(max_new_tokens=3))
    na, nb = len(either_engine.encode(a)), len(either_engine.encode(b))
    either_engine.take_stats()
    either_engine.add([a])
    either_engine.step()  # a holds its prompt and its first token
    either_engine.add([b])
    _timings, memory = either_engine.take_stats()
    if either_engine.decoder.name == "servelab":  # whole blocks, no padding: a's prompt and first token, b's prompt
        bs = either_engine.blocks.block_size
        either_engine.step()  # b's prefill runs beside a's decode step
        _timings, memory = either_engine.take_stats()
        assert memory.kv_cache_tokens == bs * (-(-(na + 2) // bs) + -(-nb // bs))
    else:  # left-padded to the wider of the two
        assert memory.kv_cache_tokens == 2 * max(na + 1, nb)
    assert memory.kv_cache_bytes == either_engine.loaded.shape.kv_cache_bytes(memory.kv_cache_tokens, 4)
    while either_engine.num_live:
        either_engine.step()
    timings, memory = either_engine.take_stats()
    assert timings.num_rows_per_step[0] == 2 and timings.num_decode_tokens == sum(timings.num_rows_per_step)
    assert memory.kv_cache_allocated_bytes > 0


def test_a_preempted_row_starts_over_and_ends_with_the_same_answer(either_engine: Engine) -> None:
    bulk = GenerationRequest("bulk", prompt="seven houses", params=SamplingParams(max_new_tokens=12,
                                                                                 temperature=0.9, seed=4))
    rng = random.Random(8)
    before, after = _request(rng, "before"), _request(rng, "after")
    alone = either_engine.generate([bulk]).completions[0]
    done = {c.request_id: c for c in either_engine.add([before, bulk, after]).finished}
    for _ in range(2):
        done.update((c.request_id, c) for c in either_engine.step().finished)
    # its request comes back as admitted: tokenised once, with its seed (the same answer when added again)
    assert either_engine.preempt(["bulk"]) == [either_engine.tokenize(bulk)]
    assert "bulk" not in either_engine.live_request_ids
    # the rows around it go on as if it had never been there
    done.update(_run_schedule(either_engine, {0: []}))
    for request in (before, after):
        expected = naive_greedy(either_engine.model, either_engine.encode(request), request.params.max_new_tokens,
                                either_engine.eos_token_ids)
        assert list(done[request.request_id].token_ids) == expected
    timings, _memory = either_engine.take_stats()
    assert timings.num_preempted == 1
    again = _run_schedule(either_engine, {0: [bulk]})
    assert again["bulk"].token_ids == alone.token_ids


def test_generate_refuses_to_run_beside_a_running_batch(tiny_engine: Engine) -> None:
    tiny_engine.add([GenerationRequest("x", prompt="cat", params=SamplingParams(max_new_tokens=3))])
    with pytest.raises(RuntimeError, match="closed batch"):
        tiny_engine.generate([GenerationRequest("y", prompt="cat", params=SamplingParams(max_new_tokens=1))])
    while tiny_engine.num_live:
        tiny_engine.step()


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_rows_joining_and_leaving_on_cuda_decode_like_naive(tiny_folder, settings) -> None:
    from tests.engine.conftest import make_config

    engine = Engine.from_config(make_config(str(tiny_folder), device="cuda"), settings)
    rng = random.Random(3)
    arrivals = {0: [_request(rng, "a"), _request(rng, "b")], 4: [_request(rng, "c")], 9: [_request(rng, "d")]}
    done = _run_schedule(engine, arrivals)
    for request in (r for group in arrivals.values() for r in group):
        expected = naive_greedy(engine.model, engine.encode(request), request.params.max_new_tokens,
                                engine.eos_token_ids)
        assert list(done[request.request_id].token_ids) == expected
    _timings, memory = engine.take_stats()
    assert memory.device.startswith("cuda")
