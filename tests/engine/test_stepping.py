"""The stepping engine: rows join and leave a running batch at any step, and decode as if alone."""

from __future__ import annotations

from dataclasses import replace

import random

import pytest

from servelab.engine.engine import Engine
from servelab.scheduler.policy import BatchPolicy
from servelab.scheduler.scheduler import Preemption, Scheduler
from servelab.scheduler.state import ScheduledRequest
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
    assert [rid for rid, _ in joined.new_tokens] == ([] if tiny_engine.scheduler.pool is not None else ["short"])
    step = tiny_engine.step()
    assert [rid for rid, _ in step.new_tokens] == ["long", "short"]
    if tiny_engine.scheduler.pool is not None:
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
    either_engine.step()  # b's prefill runs in the step after a's, beside a's decode step
    _timings, memory = either_engine.take_stats()
    if either_engine.decoder.name == "servelab":  # whole blocks, no padding: a's prompt and two tokens, b's prompt
        bs = either_engine.scheduler.pool.block_size
        assert memory.kv_cache_tokens == bs * (-(-(na + 2) // bs) + -(-nb // bs))
    else:  # left-padded to the wider of the two
        assert memory.kv_cache_tokens == 2 * max(na + 2, nb)
    assert memory.kv_cache_bytes == either_engine.loaded.shape.kv_cache_bytes(memory.kv_cache_tokens, 4)
    while either_engine.num_live:
        either_engine.step()
    timings, memory = either_engine.take_stats()
    assert timings.num_rows_per_step[0] == 2 and timings.num_decode_tokens == sum(timings.num_rows_per_step)
    assert memory.kv_cache_allocated_bytes > 0


def _drive(engine: Engine, scheduler: Scheduler, arrivals: dict[int, list[ScheduledRequest]]
           ) -> tuple[dict[str, Completion], list[Preemption]]:
    """A worker's loop without its queue: each step's arrivals join the scheduler, its plan runs on the engine's
    runner, the plan is reported done and the finished rows leave; until every request has finished."""
    done, preempted, step = {}, [], 0
    while step <= max(arrivals) or scheduler.running or scheduler.waiting:
        scheduler.add(arrivals.get(step, []))
        plan = scheduler.schedule(float(step))
        out = engine.runner.execute(plan)
        scheduler.update(plan)
        scheduler.finish([c.request_id for c in out.finished])
        done.update((c.request_id, c) for c in out.finished)
        preempted += plan.preempted
        step += 1
    return done, preempted


def test_a_preempted_row_recomputes_its_tokens_and_ends_with_the_same_answer(either_engine: Engine) -> None:
    """An interactive request preempts the newest bulk row (the scheduler's plan); the row keeps its tokens and its
    seeded sampler, computes them again when it returns, and answers as if it had never left."""
    bulk = GenerationRequest("bulk", prompt="seven houses", params=SamplingParams(max_new_tokens=12,
                                                                                 temperature=0.9, seed=4))
    rng = random.Random(8)
    before, urgent = _request(rng, "before"), _request(rng, "urgent")
    alone = either_engine.generate([bulk]).completions[0]
    policy = BatchPolicy(max_batch_size=2, max_wait_ms=0, max_batch_tokens=1 << 20, policy="continuous",
                         min_bulk_rows=0, paged=either_engine.runner.block_size > 0)
    scheduler = Scheduler(policy, either_engine.new_kv_pool())
    as_bulk = lambda r: ScheduledRequest(either_engine.tokenize(r), is_interactive=False)  # noqa: E731
    done, preempted = _drive(either_engine, scheduler, {0: [as_bulk(before), as_bulk(bulk)],
                                                        3: [ScheduledRequest(either_engine.tokenize(urgent))]})
    assert [(p.request.request_id, p.cause) for p in preempted] == [("bulk", "priority")]
    assert preempted[0].num_lost_tokens > preempted[0].request.num_prompt_tokens  # it had generated tokens
    for request in (before, urgent):
        expected = naive_greedy(either_engine.model, either_engine.encode(request), request.params.max_new_tokens,
                                either_engine.eos_token_ids)
        assert list(done[request.request_id].token_ids) == expected
    assert done["bulk"].token_ids == alone.token_ids
    timings, _memory = either_engine.runner.take_stats()
    assert timings.num_preempted == 1


def test_a_prompt_computed_in_chunks_counts_its_times_from_its_first_chunk(tiny_folder, settings) -> None:
    """Its TTFT spans its whole prefill: the state a row's first chunk opens is kept through its later chunks."""
    import time

    from tests.engine.conftest import make_config

    engine = Engine.from_config(make_config(str(tiny_folder), batching={"max_prefill_tokens": 8}), settings)
    request = GenerationRequest("long", prompt="the cat sat on the mat " * 6, params=SamplingParams(max_new_tokens=2))
    assert len(engine.encode(request)) > 3 * 8
    before = time.time()
    assert engine.add([request]).new_tokens == ()  # its first chunk: no token yet
    after_first_chunk = time.time()
    done = {}
    while engine.num_live:
        done.update((c.request_id, c) for c in engine.step().finished)
    assert before <= done["long"].started_at_s <= after_first_chunk


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
