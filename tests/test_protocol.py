"""The OpenAI bodies' fields: each is honoured, refused with a 400 naming it, or (a label) accepted and said to
change nothing; none is dropped in silence. On every edge: the API and a batch file's lines."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from servelab.config import ServingConfig
from servelab.catalog import Catalog
from servelab.jobs.ingest import parse_line
from pydantic import ValidationError

from servelab.outputs import Alternative, TokenLogprobs
from servelab.protocol import (NO_EFFECT, NOT_HONOURED, Answer, ChatCompletionBody, Choice, CompletionBody, Rejection,
                               chat_completion_object, completion_object, openai_usage, refuse_unhonoured,
                               to_submission)
from servelab.request import FinishReason
from servelab.store.batch_jobs import LineError

REPO = Path(__file__).resolve().parents[1]
CHAT = {"model": "fp32", "messages": [{"role": "user", "content": "hi"}]}
PLAIN = {"model": "fp32", "prompt": "hi"}


def refusal(body: CompletionBody | ChatCompletionBody) -> Rejection | None:
    try:
        refuse_unhonoured(body)
    except Rejection as exc:
        return exc
    return None


@pytest.mark.parametrize("model", [CompletionBody, ChatCompletionBody])
def test_no_refused_or_no_effect_field_is_one_the_bodies_declare(model) -> None:
    """Honouring a field means declaring it and deleting its NOT_HONOURED line: never both."""
    assert not (set(NOT_HONOURED) | NO_EFFECT) & set(model.model_fields)


@pytest.mark.parametrize("name", sorted(NOT_HONOURED))
def test_a_field_not_honoured_is_refused_by_name_unless_it_asks_for_nothing(name: str) -> None:
    rule = NOT_HONOURED[name]
    refused = refusal(ChatCompletionBody.model_validate({**CHAT, name: {"asks": "something"}}))
    assert refused is not None and refused.param == name and refused.code == "unsupported_parameter"
    assert str(refused).startswith(f"{name} is not supported: {rule.why}")
    for neutral in rule.neutral:
        assert refusal(ChatCompletionBody.model_validate({**CHAT, name: neutral})) is None, (name, neutral)


def test_neutral_means_the_same_json_value_not_a_python_equal_one() -> None:
    """false == 0 in Python; `echo: 0` and `best_of: true` are not the neutral `echo: false` and `best_of: 1`."""
    assert refusal(CompletionBody.model_validate({**PLAIN, "echo": 0})).param == "echo"
    assert refusal(CompletionBody.model_validate({**PLAIN, "echo": False})) is None
    assert refusal(CompletionBody.model_validate({**PLAIN, "best_of": 1})) is None
    assert refusal(CompletionBody.model_validate({**PLAIN, "best_of": True})).param == "best_of"


def test_the_deprecated_functions_fields_are_refused_pointing_at_tools() -> None:
    functions = [{"name": "f", "parameters": {"type": "object"}}]
    refused = refusal(ChatCompletionBody.model_validate({**CHAT, "functions": functions}))
    assert refused.param == "functions" and "send tools instead" in str(refused)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert refusal(ChatCompletionBody.model_validate({**CHAT, "tools": tools})) is None  # honoured: declared


def test_an_unknown_field_is_refused_naming_it_and_labels_are_accepted() -> None:
    unknown = refusal(CompletionBody.model_validate({**PLAIN, "typical_p": 0.1}))
    assert unknown.code == "unknown_parameter" and unknown.param == "typical_p" and "'typical_p'" in str(unknown)
    assert refusal(CompletionBody.model_validate({**PLAIN, "user": "u-1", "prompt_cache_key": "k"})) is None


def test_message_fields_beyond_role_and_content_are_refused_unless_empty() -> None:
    named = {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x", "name": "bob"}]}
    assert refusal(ChatCompletionBody.model_validate(named)).param == "messages.1.name"
    echoed = {**CHAT, "messages": [{"role": "assistant", "content": "hi", "refusal": None, "tool_calls": []}]}
    assert refusal(ChatCompletionBody.model_validate(echoed)) is None


def _catalog() -> Catalog:
    return Catalog({"fp32": ServingConfig.from_yaml(REPO / "configs" / "fp32.yaml")}, frozenset())


def _line(body: dict) -> LineError | object:
    raw = json.dumps({"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": body}).encode()
    return parse_line(raw, line_no=1, endpoint="/v1/chat/completions", catalog=_catalog(), max_prompt_chars=1_000,
                      max_line_bytes=10_000)


def test_a_batch_line_asking_for_functions_goes_to_the_error_file_naming_them() -> None:
    refused = _line({**CHAT, "functions": [{"name": "f"}], "max_tokens": 2})
    assert isinstance(refused, LineError) and refused.code == "unsupported_parameter" and "functions" in refused.message


def _submission(body: CompletionBody | ChatCompletionBody):
    return to_submission(body, catalog=_catalog(), max_prompt_chars=1_000)


# --- honoured: penalties, log-probabilities, n ---


def test_penalties_and_logprobs_become_the_requests_sampling_on_both_endpoints() -> None:
    chat = _submission(ChatCompletionBody.model_validate({**CHAT, "logprobs": True, "top_logprobs": 3,
                                                          "presence_penalty": 0.5, "frequency_penalty": -1}))
    assert (chat.sampling.logprobs, chat.sampling.presence_penalty, chat.sampling.frequency_penalty) == (3, 0.5, -1.0)
    assert _submission(ChatCompletionBody.model_validate({**CHAT, "logprobs": True})).sampling.logprobs == 0
    assert _submission(ChatCompletionBody.model_validate({**CHAT, "logprobs": False, "top_logprobs": 0})
                       ).sampling.logprobs is None
    assert _submission(CompletionBody.model_validate({**PLAIN, "logprobs": 0})).sampling.logprobs == 0, \
        "completions' logprobs: 0 asks for the chosen token's log-probability"
    assert _submission(CompletionBody.model_validate({**PLAIN, "logprobs": 5})).sampling.logprobs == 5
    plain = _submission(CompletionBody.model_validate({**PLAIN, "logprobs": False, "presence_penalty": None}))
    assert plain.sampling.logprobs is None and not plain.sampling.has_penalties


@pytest.mark.parametrize(("model", "fields", "param"), [
    (CompletionBody, {"logprobs": 6}, "logprobs"), (CompletionBody, {"logprobs": True}, "logprobs"),
    (ChatCompletionBody, {"logprobs": 0}, "logprobs"), (ChatCompletionBody, {"logprobs": True, "top_logprobs": 21},
                                                         "top_logprobs"),
    (ChatCompletionBody, {"top_logprobs": 2}, "top_logprobs"), (CompletionBody, {"presence_penalty": 2.5},
                                                                "presence_penalty"),
    (ChatCompletionBody, {"frequency_penalty": -3}, "frequency_penalty"), (CompletionBody, {"n": 0}, "n"),
])
def test_out_of_bounds_values_are_refused_naming_the_field(model, fields: dict, param: str) -> None:
    with pytest.raises(ValidationError) as info:
        model.model_validate({**(CHAT if model is ChatCompletionBody else PLAIN), **fields})
    assert param in str(info.value), (fields, str(info.value))


def test_n_is_honoured_up_to_the_configs_batch_and_refused_by_name_above_it() -> None:
    assert _submission(CompletionBody.model_validate({**PLAIN, "n": 4})).num_choices == 4
    assert _submission(CompletionBody.model_validate({**PLAIN, "n": None})).num_choices == 1
    with pytest.raises(Rejection) as info:
        _submission(CompletionBody.model_validate({**PLAIN, "n": 17}))
    assert info.value.param == "n" and "max_batch_size" in str(info.value) and "between 1 and 16" in str(info.value)


@pytest.mark.parametrize(("fields", "param"), [({"n": 2}, "n"), ({"logprobs": True}, "logprobs")])
def test_what_a_stream_cannot_carry_is_refused_by_name(fields: dict, param: str) -> None:
    with pytest.raises(Rejection) as info:
        _submission(ChatCompletionBody.model_validate({**CHAT, "stream": True, **fields}))
    assert info.value.param == param and info.value.code == "unsupported_parameter" and "stream" in str(info.value)


def test_a_batch_line_asking_for_n_choices_is_refused_naming_n_and_logprobs_are_taken() -> None:
    refused = _line({**CHAT, "n": 2})
    assert isinstance(refused, LineError) and refused.code == "unsupported_parameter" and "n is 2" in refused.message
    taken = _line({**CHAT, "logprobs": True, "top_logprobs": 2})
    assert not isinstance(taken, LineError) and taken.sampling.logprobs == 2


def _entry(token: bytes, logprob: float, offset: int, *top: tuple[bytes, float]) -> TokenLogprobs:
    return TokenLogprobs(Alternative(len(token), token, logprob), offset,
                         tuple(Alternative(i, b, lp) for i, (b, lp) in enumerate(top)))


ENTRIES = (_entry(b"Hi", -0.1, 0, (b"Hi", -0.1), (b"Hey", -2.5)),
           _entry(b"\xe2\x80", -1.5, 2, (b" there", -0.9), (b"!", -1.2)))  # part of a character, not the likeliest


def test_chat_logprobs_come_in_openais_shape() -> None:
    answer = Answer("r1", "fp32", 0, 3, (Choice("Hi\u2019", FinishReason.LENGTH, 2, ENTRIES),))
    [choice] = chat_completion_object(answer)["choices"]
    assert choice["logprobs"] == {"refusal": None, "content": [
        {"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": [
            {"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}, {"token": "Hey", "logprob": -2.5, "bytes": [72, 101, 121]}]},
        {"token": "bytes:\\xe2\\x80", "logprob": -1.5, "bytes": [226, 128], "top_logprobs": [
            {"token": " there", "logprob": -0.9, "bytes": [32, 116, 104, 101, 114, 101]},
            {"token": "!", "logprob": -1.2, "bytes": [33]}]}]}


def test_completion_logprobs_come_in_the_legacy_shape_with_the_chosen_token_among_the_top() -> None:
    answer = Answer("r1", "fp32", 0, 3, (Choice("Hi\u2019", FinishReason.LENGTH, 2, ENTRIES),))
    [choice] = completion_object(answer)["choices"]
    assert choice["logprobs"] == {
        "tokens": ["Hi", "bytes:\\xe2\\x80"], "token_logprobs": [-0.1, -1.5], "text_offset": [0, 2],
        "top_logprobs": [{"Hi": -0.1, "Hey": -2.5}, {" there": -0.9, "!": -1.2, "bytes:\\xe2\\x80": -1.5}]}


def test_n_choices_are_indexed_in_order_and_the_prompt_is_counted_once() -> None:
    answer = Answer("r1", "fp32", 0, 7, (Choice("a", FinishReason.STOP, 3), Choice("b", FinishReason.LENGTH, 5)), 4)
    body = chat_completion_object(answer)
    assert [(c["index"], c["message"]["content"], c["finish_reason"], c["logprobs"]) for c in body["choices"]] == [
        (0, "a", "stop", None), (1, "b", "length", None)]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 4}}


def test_usage_says_the_cached_prompt_tokens_as_openai_does_and_a_running_usage_leaves_them_out() -> None:
    answer = Answer("r1", "fp32", 0, 9, (Choice("a", FinishReason.STOP, 2),))
    assert completion_object(answer)["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}, "none cached: 0"
    assert completion_object(replace(answer, num_cached_tokens=8))["usage"] == {
        "prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11, "prompt_tokens_details": {"cached_tokens": 8}}
    assert openai_usage(9, 1) == {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}


# --- a model's own sampling defaults (its generation_config.json), as vLLM applies them ---


def test_fields_a_request_leaves_out_take_the_models_generation_config_values(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05,
         "eos_token_id": [1, 2]}))
    config = ServingConfig.from_yaml(REPO / "configs" / "fp32.yaml").model_copy(update={"model": str(tmp_path)})
    catalog = Catalog({"fp32": config}, frozenset())

    def sampling(body: dict):
        return to_submission(CompletionBody.model_validate(body), catalog=catalog, max_prompt_chars=1_000).sampling

    left_out = sampling({"model": "fp32", "prompt": "hi", "max_tokens": 4})
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.repetition_penalty, left_out.min_p) == (
        0.6, 0.9, 20, 1.05, 0.0)
    given = sampling({"model": "fp32", "prompt": "hi", "max_tokens": 4, "temperature": 0, "top_k": 0})
    assert (given.temperature, given.top_k, given.top_p) == (0.0, 0, 0.9)  # what a request sends wins, 0 included
    bundled = _submission(CompletionBody.model_validate({"model": "fp32", "prompt": "hi", "max_tokens": 4})).sampling
    assert (bundled.temperature, bundled.top_p) == (1.0, 1.0)  # the bundled model declares none: the API's defaults
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling({"model": "fp32", "prompt": "hi", "max_tokens": 4}).temperature == 1.0  # unreadable: said, skipped
