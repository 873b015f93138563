"""vLLM's extra sampling fields against their definitions: repetition_penalty, min_p, min_tokens, stop_token_ids,
ignore_eos, include_stop_str_in_output and skip_special_tokens; on the sampling functions alone and through the
engine (batched and cached, beside rows that ask for nothing), against the naive reference."""

from __future__ import annotations

import random

import pytest
import torch

from servelab.engine.engine import Engine
from servelab.engine.sampling import penalised, sample_next
from servelab.request import FinishReason, GenerationRequest, RequestError, SamplingParams
from tests.engine.naive import naive_greedy

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "river", "blue", "seven", "quickly", "house"]


def reference_penalised(logits: torch.Tensor, p: SamplingParams, prompt: list[int], generated: list[int]
                        ) -> torch.Tensor:
    """vLLM's definition written out: repetition penalty over prompt and output, then OpenAI's penalties."""
    out = logits.clone()
    for t in set(prompt) | set(generated):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(generated):
        out[t] -= p.presence_penalty + p.frequency_penalty * generated.count(t)
    return out


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=gen) * 3  # (B, V)
    params = [SamplingParams(repetition_penalty=1.7), SamplingParams(repetition_penalty=0.6, frequency_penalty=0.5),
              SamplingParams(repetition_penalty=1.3, presence_penalty=-1.0)]
    prompts, generated = [[1, 2, 3, 3], [5], []], [[3, 7, 7], [], [9, 9, 1]]
    out = penalised(logits, [0, 1, 2], params, generated, prompts)
    for i, p in enumerate(params):
        torch.testing.assert_close(out[i], reference_penalised(logits[i], p, prompts[i], generated[i]))
        assert int(sample_next(logits, params, [None] * 3, generated, prompts)[i]) == int(out[i].argmax())
    assert torch.equal(logits, torch.randn(3, 40, generator=torch.Generator().manual_seed(0)) * 3), "logits kept raw"


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_draws_only_tokens_at_least_min_p_times_the_likeliest(min_p: float) -> None:
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(1)) * 2
    p = SamplingParams(temperature=0.8, min_p=min_p, seed=3)
    probs = (logits[0] / 0.8).softmax(-1)
    allowed = {t for t in range(30) if probs[t] >= min_p * probs.max()}
    generator = torch.Generator().manual_seed(3)
    drawn = {int(sample_next(logits, [p], [generator], [[]])[0]) for _ in range(300)}
    assert drawn <= allowed
    if min_p <= 0.05:
        assert len(drawn) > 1, "a low min_p leaves more than the likeliest token"


def test_suppressed_tokens_are_never_picked() -> None:
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(2))
    banned = [int(logits[0].argmax()), int(logits[1].topk(2).indices[1])]
    params = [SamplingParams(), SamplingParams(temperature=1.5, seed=1)]
    generator = torch.Generator().manual_seed(1)
    for _ in range(50):
        picked = sample_next(logits, params, [None, generator], [[], []], suppressed=[[banned[0]], [banned[1]]])
        assert int(picked[0]) == int(logits[0].topk(2).indices[1]) and int(picked[1]) != banned[1]


def _request(request_id: str, prompt: str, max_new_tokens: int, **params) -> GenerationRequest:
    return GenerationRequest(request_id, prompt=prompt, params=SamplingParams(max_new_tokens=max_new_tokens, **params))


@pytest.mark.parametrize("mix_seed", range(4))
def test_vllm_fields_beside_plain_rows_decode_like_the_naive_reference(tiny_engine: Engine, mix_seed: int) -> None:
    rng = random.Random(200 + mix_seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 20))) for _ in range(4)]
    plain = tiny_engine.generate([_request(f"p{i}", prompt, 12) for i, prompt in enumerate(prompts)]).completions
    requests = []
    for i, (prompt, before) in enumerate(zip(prompts, plain)):
        fields = rng.choice([{"repetition_penalty": rng.uniform(0.5, 2.0)},
                             {"stop_token_ids": (before.token_ids[rng.randint(0, 5)],)},
                             {"min_tokens": 8, "stop_token_ids": (before.token_ids[2],)},
                             {"ignore_eos": True}, {}])
        requests.append(_request(f"r{i}", prompt, 12, **fields))
    for request, completion in zip(requests, tiny_engine.generate(requests).completions):
        p = request.params
        expected = naive_greedy(tiny_engine.model, tiny_engine.encode(request), p.max_new_tokens,
                                tiny_engine.eos_token_ids, repetition_penalty=p.repetition_penalty,
                                min_tokens=p.min_tokens, stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos)
        assert list(completion.token_ids) == expected, (mix_seed, request.request_id, p)
        assert len(completion.token_ids) >= p.min_tokens


def test_a_stop_token_ends_the_row_its_text_left_out_unless_asked(tiny_engine: Engine) -> None:
    plain = tiny_engine.generate([_request("plain", "the cat sat on the mat", 10)]).completions[0]
    stop_id = plain.token_ids[3]
    first = plain.token_ids.index(stop_id)
    left_out, kept = tiny_engine.generate([
        _request("out", "the cat sat on the mat", 10, stop_token_ids=(stop_id,)),
        _request("kept", "the cat sat on the mat", 10, stop_token_ids=(stop_id,), include_stop_str_in_output=True),
    ]).completions
    assert left_out.token_ids == kept.token_ids == plain.token_ids[:first + 1]
    assert left_out.finish_reason.value == "stop" and kept.finish_reason.value == "stop"
    decode = tiny_engine.tokenizer.decode
    assert left_out.text == decode(list(plain.token_ids[:first]), skip_special_tokens=True)
    assert kept.text == decode(list(plain.token_ids[:first + 1]), skip_special_tokens=True)


def test_a_stop_string_is_cut_or_kept_and_waits_for_min_tokens(tiny_engine: Engine) -> None:
    plain = tiny_engine.generate([_request("plain", "the cat sat on the mat", 16)]).completions[0]
    stop = plain.text[len(plain.text) // 3:len(plain.text) // 3 + 2]
    assert stop.strip(), plain.text
    cut, kept = tiny_engine.generate([_request("cut", "the cat sat on the mat", 16, stop=(stop,)),
                                      _request("kept", "the cat sat on the mat", 16, stop=(stop,),
                                               include_stop_str_in_output=True)]).completions
    at = plain.text.index(stop)
    assert cut.text == plain.text[:at] and kept.text == plain.text[:at + len(stop)]
    late = tiny_engine.generate([_request("late", "the cat sat on the mat", 16, stop=(stop,), min_tokens=16)])
    assert len(late.completions[0].token_ids) == 16


def test_skip_special_tokens_false_keeps_their_text(tiny_engine: Engine) -> None:
    kept, skipped = tiny_engine.generate([
        _request("kept", "the cat", 6, skip_special_tokens=False, ignore_eos=True),
        _request("skipped", "the cat", 6, ignore_eos=True)]).completions
    assert kept.token_ids == skipped.token_ids
    decode = tiny_engine.tokenizer.decode
    assert kept.text == decode(list(kept.token_ids), skip_special_tokens=False)
    assert skipped.text == decode(list(skipped.token_ids), skip_special_tokens=True)


def test_stored_sampling_without_the_new_fields_loads_with_their_defaults() -> None:
    old_row = {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": ["x"],
               "ignore_eos": False, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logprobs": None}
    assert SamplingParams.from_stored(old_row) == SamplingParams(max_new_tokens=8, stop=("x",))
    asked = SamplingParams(min_tokens=2, stop_token_ids=(5, 7), repetition_penalty=1.2, min_p=0.1,
                           include_stop_str_in_output=True, skip_special_tokens=False, ignore_eos=True)
    assert SamplingParams.from_stored(asked.to_stored()) == asked


def test_a_stop_token_id_past_the_vocabulary_fails_its_request_alone(tiny_engine: Engine) -> None:
    """An id past the logits would crash the step (and every row in it): refused at admission, by name."""
    vocab_size = tiny_engine.loaded.shape.vocab_size
    bad = GenerationRequest("bad", prompt="the cat", params=SamplingParams(
        max_new_tokens=4, min_tokens=2, stop_token_ids=(5, vocab_size)))
    with pytest.raises(RequestError, match=rf"stop_token_ids holds \[{vocab_size}\], past this model's vocabulary"):
        tiny_engine.tokenize(bad)
    good = _request("good", "the cat sat", 4)
    result = tiny_engine.generate([bad, good]).completions
    assert result[0].finish_reason is FinishReason.ERROR and "stop_token_ids" in result[0].error
    assert result[1].finish_reason is not FinishReason.ERROR and len(result[1].token_ids) >= 1
