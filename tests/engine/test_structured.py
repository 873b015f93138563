"""Structured output in the engine: a constrained row's answer keeps to its JSON schema (llguidance's mask applied to
its logits, the row ended when the grammar completes), whatever its batch-mates ask for, on both decoders; rows
without a constraint decode exactly as they would alone; a constraint is compiled once per engine. The real bundled
model answers a set of schemas (nested objects, enums, arrays, required fields) with JSON that parses and validates."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from servelab.engine.engine import Engine
from servelab.engine.grammar import constraint_json
from servelab.engine.sampling import Allowed, sample_next
from servelab.request import ChatMessage, FinishReason, GenerationRequest, SamplingParams

# NOTE: bounded (enums, maxLength, maxItems, small integers), so even the tiny random model's answer closes in a few
# tokens: the test asks whether every answer keeps to the schema, not whether a random model stops talking
SMALL = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    "inner": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}},
    "required": ["kind", "ok", "tags", "inner"], "additionalProperties": False}
ONE_ANSWER = {"type": "object", "properties": {"name": {"const": "get_time"},
                                                "arguments": {"type": "object", "properties": {},
                                                              "additionalProperties": False}},
              "required": ["name", "arguments"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(3))
def test_the_mask_sets_every_refused_token_to_minus_infinity_greedy_or_sampled(seed: int) -> None:
    """sample_next with llguidance's packed bits = sample_next over logits with -inf written where a bit is 0,
    for greedy rows (whose best token may be allowed: left unmasked) and sampled ones alike, penalties included."""
    rng = np.random.default_rng(seed)
    vocab, rows = 100, 5
    logits = torch.from_numpy(rng.standard_normal((rows, vocab)).astype(np.float32))
    keep = rng.random((rows, vocab)) < 0.2
    keep[:, rng.integers(vocab)] = True
    keep[0, int(logits[0].argmax())] = True  # NOTE: row 0 greedy with its best token allowed: the fast path
    bits = np.packbits(np.pad(keep, ((0, 0), (0, 28))), axis=-1, bitorder="little").view(np.int32)  # (R, 4)
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0, seed=1, top_k=5),
              SamplingParams(temperature=0.7, seed=2, top_p=0.9, presence_penalty=1.0), SamplingParams()]
    generated = [[1, 2], [3], [4, 4], [5], []]

    def generators():
        return [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]

    constrained = [0, 1, 2, 3]  # NOTE: row 4 is free: its logits are not touched
    masked = logits.clone()
    masked[constrained] = masked[constrained].masked_fill(~torch.from_numpy(keep[constrained]), float("-inf"))
    expected = sample_next(masked, params, generators(), generated)
    got = sample_next(logits, params, generators(), generated,
                      allowed=Allowed(constrained, torch.from_numpy(bits[constrained].copy())))
    assert got.tolist() == expected.tolist()
    assert all(keep[i, t] for i, t in enumerate(got.tolist()[:4]))


def _request(request_id: str, prompt: str = "the cat sat on", *, schema: dict | None = None, **params
             ) -> GenerationRequest:
    constraint = constraint_json(schema) if schema is not None else None
    return GenerationRequest(request_id, prompt=prompt, params=SamplingParams(**{"max_new_tokens": 40, **params},
                                                                              constraint=constraint))


def test_a_schema_with_one_answer_is_answered_with_it_greedy_or_sampled(either_engine: Engine) -> None:
    result = either_engine.generate([_request("g", schema=ONE_ANSWER),
                                     _request("s", schema=ONE_ANSWER, temperature=1.0, seed=5, top_k=50)])
    for completion in result.completions:
        assert completion.text == '{"name":"get_time","arguments":{}}', completion
        assert completion.finish_reason is FinishReason.STOP, "the grammar's end ends the row, before max_new_tokens"


@pytest.mark.parametrize("seed", range(2))
def test_sampled_answers_keep_to_the_schema_beside_free_rows(either_engine: Engine, seed: int) -> None:
    requests = [_request(f"c{i}", f"story {i} of {seed}", schema=SMALL, temperature=1.5, seed=seed * 10 + i)
                for i in range(3)]
    free = [_request("free", "the river ran", max_new_tokens=12),
            _request("penalised", "the blue house", max_new_tokens=12, temperature=1.0, seed=seed, presence_penalty=1)]
    mixed = either_engine.generate([requests[0], free[0], requests[1], free[1], requests[2]]).completions
    for completion in (mixed[0], mixed[2], mixed[4]):
        assert completion.finish_reason is FinishReason.STOP, completion
        jsonschema.validate(json.loads(completion.text), SMALL)
    alone = either_engine.generate(free).completions
    assert [c.token_ids for c in (mixed[1], mixed[3])] == [c.token_ids for c in alone], \
        "a row without a constraint decodes as it does alone"


def test_a_constraint_compiles_once_per_engine_and_a_bad_one_fails_alone(tiny_engine: Engine) -> None:
    tiny_engine.generate([_request("warm", schema=ONE_ANSWER)])
    compiled = tiny_engine.decodings.grammars.num_compiled
    tiny_engine.generate([_request(f"again{i}", schema=ONE_ANSWER) for i in range(3)])
    assert tiny_engine.decodings.grammars.num_compiled == compiled, "the same schema is compiled once"
    bad = GenerationRequest("bad", prompt="x", params=SamplingParams(max_new_tokens=4, constraint='{"schema":{"type":'
                                                                                                  '"objekt"}}'))
    done = tiny_engine.generate([bad, _request("good", schema=ONE_ANSWER)]).completions
    assert done[0].finish_reason is FinishReason.ERROR and "objekt" in done[0].error
    assert done[1].text == '{"name":"get_time","arguments":{}}'


def test_a_preempted_constrained_row_recomputes_and_gives_the_same_answer(tiny_engine: Engine) -> None:
    """A constrained bulk row preempted by an interactive request keeps its tokens and its grammar's state, computes
    them again when it returns, and ends with the answer it gives alone."""
    from servelab.scheduler.policy import BatchPolicy
    from servelab.scheduler.scheduler import Scheduler
    from servelab.scheduler.state import ScheduledRequest
    from tests.engine.test_stepping import _drive

    request = _request("p", schema=SMALL, temperature=1.2, seed=11)
    whole = tiny_engine.generate([request]).completions[0]
    policy = BatchPolicy(max_batch_size=1, max_wait_ms=0, max_batch_tokens=1 << 20, policy="continuous",
                         min_bulk_rows=0, paged=True)
    urgent = GenerationRequest("urgent", prompt="the cat", params=SamplingParams(max_new_tokens=3))
    done, preempted = _drive(tiny_engine, Scheduler(policy, tiny_engine.new_kv_pool()),
                             {0: [ScheduledRequest(tiny_engine.tokenize(request), is_interactive=False)],
                              3: [ScheduledRequest(tiny_engine.tokenize(urgent))]})
    assert [p.request.request_id for p in preempted] == ["p"]
    assert done["p"].text == whole.text and done["p"].finish_reason is FinishReason.STOP


def test_max_new_tokens_cuts_a_constrained_answer_short_with_reason_length(tiny_engine: Engine) -> None:
    cut = tiny_engine.generate([_request("cut", schema=ONE_ANSWER, max_new_tokens=3)]).completions[0]
    assert cut.finish_reason is FinishReason.LENGTH and len(cut.token_ids) == 3
    assert '{"name":"get_time","arguments":{}}'.startswith(cut.text)


# The real model: each schema with a question it can answer; greedy, few tokens each, one batch.
REAL = [
    ("Describe a cat as JSON: its name, age in years and whether it is indoor.",
     {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                       "age": {"type": "integer", "minimum": 0, "maximum": 30},
                                       "indoor": {"type": "boolean"}},
      "required": ["name", "age", "indoor"], "additionalProperties": False}),
    ("What is the capital of France? Answer as JSON with the city and the country.",
     {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                       "country": {"enum": ["France", "Spain", "Italy", "Germany"]}},
      "required": ["city", "country"], "additionalProperties": False}),
    ("List three colours as JSON.",
     {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                   "minItems": 1, "maxItems": 3}},
      "required": ["colours"], "additionalProperties": False}),
    ("Give a user record as JSON: an id, a role and a nested address with a city.",
     {"type": "object", "properties": {
         "id": {"type": "integer", "minimum": 1, "maximum": 9999},
         "role": {"enum": ["admin", "user", "guest"]},
         "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                     "required": ["city", "zip"], "additionalProperties": False}},
      "required": ["id", "role", "address"], "additionalProperties": False}),
    ("Is the sky blue? Answer as JSON.",
     {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number",
                                                                                        "minimum": 0, "maximum": 1}},
      "required": ["answer"], "additionalProperties": False}),
    ("Any JSON object about dogs.", {"type": "object", "maxProperties": 2,
                                     "additionalProperties": {"type": "string", "maxLength": 16}}),
]


@pytest.mark.slow
def test_the_bundled_models_answers_parse_and_validate_against_each_schema(bundled_engine: Engine) -> None:
    requests = [GenerationRequest(f"s{i}", messages=(ChatMessage("user", question),),
                                  params=SamplingParams(max_new_tokens=64, constraint=constraint_json(schema)))
                for i, (question, schema) in enumerate(REAL)]
    for (_, schema), completion in zip(REAL, bundled_engine.generate(requests).completions):
        assert completion.finish_reason is FinishReason.STOP, completion.text
        jsonschema.validate(json.loads(completion.text), schema)
