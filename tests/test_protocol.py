"""The OpenAI bodies' fields: each is honoured, refused with a 400 naming it, or (a label) accepted and said to
change nothing; none is dropped in silence. On every edge: the API and a batch file's lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servelab.config import ServingConfig
from servelab.jobs.catalog import Catalog
from servelab.jobs.ingest import parse_line
from servelab.protocol import (NO_EFFECT, NOT_HONOURED, ChatCompletionBody, CompletionBody, Rejection,
                               refuse_unhonoured)
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
    """false == 0 in Python; in OpenAI's completions logprobs: 0 asks for the sampled token's log-probability."""
    assert refusal(CompletionBody.model_validate({**PLAIN, "logprobs": 0})).param == "logprobs"
    assert refusal(CompletionBody.model_validate({**PLAIN, "logprobs": False})) is None
    assert refusal(CompletionBody.model_validate({**PLAIN, "presence_penalty": 0.0})) is None
    assert refusal(CompletionBody.model_validate({**PLAIN, "best_of": True})).param == "best_of"


def test_tools_and_response_format_are_refused_with_a_message_that_says_so() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert "tool calling is not built" in str(refusal(ChatCompletionBody.model_validate({**CHAT, "tools": tools})))
    json_mode = ChatCompletionBody.model_validate({**CHAT, "response_format": {"type": "json_object"}})
    assert "structured output" in str(refusal(json_mode)) and refusal(json_mode).param == "response_format"


def test_an_unknown_field_is_refused_naming_it_and_labels_are_accepted() -> None:
    unknown = refusal(CompletionBody.model_validate({**PLAIN, "min_p": 0.1}))
    assert unknown.code == "unknown_parameter" and unknown.param == "min_p" and "'min_p'" in str(unknown)
    assert refusal(CompletionBody.model_validate({**PLAIN, "user": "u-1", "prompt_cache_key": "k"})) is None


def test_message_fields_beyond_role_and_content_are_refused_unless_empty() -> None:
    named = {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x", "name": "bob"}]}
    assert refusal(ChatCompletionBody.model_validate(named)).param == "messages.1.name"
    echoed = {**CHAT, "messages": [{"role": "assistant", "content": "hi", "refusal": None, "tool_calls": []}]}
    assert refusal(ChatCompletionBody.model_validate(echoed)) is None


def test_a_batch_line_asking_for_tools_goes_to_the_error_file_naming_them() -> None:
    catalog = Catalog({"fp32": ServingConfig.from_yaml(REPO / "configs" / "fp32.yaml")}, frozenset())
    body = {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "max_tokens": 2}
    raw = json.dumps({"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": body}).encode()
    refused = parse_line(raw, line_no=1, endpoint="/v1/chat/completions", catalog=catalog, max_prompt_chars=1_000,
                         max_line_bytes=10_000)
    assert isinstance(refused, LineError) and refused.code == "unsupported_parameter" and "tools" in refused.message
