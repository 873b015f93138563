"""Presence and frequency penalties and token log-probabilities: batched and cached, against the naive reference
(the penalties written out as OpenAI defines them, the raw model's log-softmax), and per row whatever its
batch-mates ask for."""

from __future__ import annotations

import math
import random

import pytest
import torch

from servelab.engine.engine import Engine
from servelab.request import GenerationRequest, SamplingParams
from tests.engine.naive import naive_decode, naive_greedy

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "river", "blue", "seven", "quickly", "house"]


def _request(request_id: str, prompt: str, max_new_tokens: int, **params) -> GenerationRequest:
    return GenerationRequest(request_id, prompt=prompt, params=SamplingParams(max_new_tokens=max_new_tokens, **params))


def _distinct(engine: Engine, **params) -> int:
    completion = engine.generate([_request("p", "the cat sat on the mat", 40, **params)]).completions[0]
    return len(set(completion.token_ids))


@pytest.mark.parametrize("mix_seed", range(4))
def test_penalised_rows_beside_plain_ones_decode_like_the_naive_reference(either_engine: Engine, mix_seed: int) -> None:
    rng = random.Random(100 + mix_seed)
    requests = []
    for i in range(rng.choice([2, 3, 5])):
        penalties = rng.choice([{"presence_penalty": rng.uniform(-2, 2)}, {"frequency_penalty": rng.uniform(-2, 2)},
                                {"presence_penalty": rng.uniform(-2, 2), "frequency_penalty": rng.uniform(-2, 2)}, {}])
        if i == 0:  # NOTE: pulled towards repeats, which always changes the tiny model's greedy text
            penalties = {"presence_penalty": rng.uniform(-2, 0), "frequency_penalty": rng.uniform(-2, -1)}
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
        requests.append(_request(f"r{i}", prompt, rng.randint(8, 24), **penalties))
    for request, completion in zip(requests, either_engine.generate(requests).completions):
        p = request.params
        expected = naive_greedy(either_engine.model, either_engine.encode(request), p.max_new_tokens,
                                either_engine.eos_token_ids, presence_penalty=p.presence_penalty,
                                frequency_penalty=p.frequency_penalty)
        assert list(completion.token_ids) == expected, (mix_seed, request.request_id, p)


def test_a_positive_penalty_repeats_fewer_tokens_and_a_negative_one_more(tiny_engine: Engine) -> None:
    plain = _distinct(tiny_engine)
    assert _distinct(tiny_engine, frequency_penalty=2.0) > plain > _distinct(tiny_engine, frequency_penalty=-2.0)
    assert _distinct(tiny_engine, presence_penalty=2.0) > plain


def test_a_seeded_penalised_row_samples_the_same_tokens_whoever_its_batch_mates(tiny_engine: Engine) -> None:
    # NOTE: the tiny random model's next-token distribution is nearly flat; at temperature 0.5 a negative penalty
    # (generated tokens pulled up) changes the draws
    row = _request("s", "the river", 16, temperature=0.5, seed=7, presence_penalty=-2.0, frequency_penalty=-1.0)
    alone = tiny_engine.generate([row]).completions[0]
    mates = [_request("m1", "blue house", 10, frequency_penalty=-1.0), _request("m2", "a cat", 20, temperature=0.8,
                                                                               seed=3, logprobs=4)]
    together = tiny_engine.generate([mates[0], row, mates[1]]).completions[1]
    assert together.token_ids == alone.token_ids
    unpenalised = tiny_engine.generate([_request("u", "the river", 16, temperature=0.5, seed=7)]).completions[0]
    assert unpenalised.token_ids != alone.token_ids, "the penalties changed what was sampled"


def test_logprobs_are_the_reference_models_log_softmax_for_the_chosen_and_top_tokens(either_engine: Engine) -> None:
    asked = _request("lp", "seven blue houses by the", 10, logprobs=5, frequency_penalty=1.0)
    plain = _request("plain", "the cat", 6)
    result = either_engine.generate([plain, asked]).completions
    assert result[0].logprobs is None, "a row that did not ask gets none"
    completion = result[1]
    reference = naive_decode(either_engine.model, either_engine.encode(asked), 10, either_engine.eos_token_ids,
                             frequency_penalty=1.0)
    assert [t.chosen.token_id for t in completion.logprobs] == list(completion.token_ids) == [t for t, _ in reference]
    for entry, (token_id, log_softmax) in zip(completion.logprobs, reference):
        assert math.isclose(entry.chosen.logprob, float(log_softmax[token_id]), abs_tol=2e-4)
        top = torch.topk(log_softmax, 5)
        assert [a.token_id for a in entry.top] == top.indices.tolist()
        assert all(math.isclose(a.logprob, v, abs_tol=2e-4) for a, v in zip(entry.top, top.values.tolist()))
        assert all(a.logprob >= b.logprob for a, b in zip(entry.top, entry.top[1:]))
        assert entry.chosen.logprob <= entry.top[0].logprob + 1e-6  # raw: the penalty may pick a less likely one
        if entry.chosen.token_id in [a.token_id for a in entry.top]:
            assert next(a for a in entry.top if a.token_id == entry.chosen.token_id).logprob == entry.chosen.logprob


def test_logprobs_zero_returns_the_chosen_token_alone_and_offsets_cut_the_text(tiny_engine: Engine) -> None:
    completion = tiny_engine.generate([_request("z", "a mat and a river", 12, logprobs=0)]).completions[0]
    assert len(completion.logprobs) == completion.num_generated_tokens and all(not t.top for t in completion.logprobs)
    offsets = [t.text_offset for t in completion.logprobs] + [len(completion.text)]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    pieces = [completion.text[a:b] for a, b in zip(offsets, offsets[1:])]
    assert "".join(pieces) == completion.text
    assert b"".join(t.chosen.token_bytes for t in completion.logprobs).decode() == completion.text


def test_greedy_logprobs_top_one_is_the_chosen_token(tiny_engine: Engine) -> None:
    completion = tiny_engine.generate([_request("g", "quickly the cat", 8, logprobs=1)]).completions[0]
    assert all(t.top[0] == t.chosen for t in completion.logprobs)
