"""Structured output on the OpenAI bodies: response_format and tools become one checked constraint (a bad schema is
a 400 naming its field), tools are described to the model, and answers come back in OpenAI's shapes (tool_calls,
whole or streamed). No model here: tests/engine/test_structured.py decodes with the constraints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from servelab.catalog import Catalog
from servelab.config import ServingConfig
from servelab.engine.grammar import check_constraint, constraint_json, is_tool_call
from servelab.jobs.ingest import parse_line
from servelab.protocol import (CHAT_COMPLETIONS, Answer, ChatCompletionBody, Choice, ChunkWriter, CompletionBody,
                               Rejection, chat_completion_object, to_submission)
from servelab.request import FinishReason
from servelab.store.batch_jobs import LineError

REPO = Path(__file__).resolve().parents[1]
CHAT = {"model": "fp32", "messages": [{"role": "user", "content": "weather in Paris?"}], "max_tokens": 8}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}


def _catalog() -> Catalog:
    return Catalog({"fp32": ServingConfig.from_yaml(REPO / "configs" / "fp32.yaml")}, frozenset())


def submit(**fields):
    return to_submission(ChatCompletionBody.model_validate({**CHAT, **fields}), catalog=_catalog(),
                         max_prompt_chars=10_000)


def rejected(**fields) -> Rejection:
    with pytest.raises(Rejection) as caught:
        submit(**fields)
    return caught.value


def test_response_format_becomes_the_requests_constraint_on_both_endpoints() -> None:
    assert submit().sampling.constraint is None
    assert submit(response_format={"type": "text"}).sampling.constraint is None
    assert submit(response_format={"type": "json_object"}).sampling.constraint == constraint_json({"type": "object"})
    named = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    assert submit(response_format=named).sampling.constraint == constraint_json(SCHEMA)
    plain = to_submission(CompletionBody.model_validate({"model": "fp32", "prompt": "hi", "response_format": named}),
                          catalog=_catalog(), max_prompt_chars=100)
    assert plain.sampling.constraint == constraint_json(SCHEMA) and not is_tool_call(plain.sampling.constraint)


@pytest.mark.parametrize(("schema", "said"), [({"type": "objekt"}, "objekt"),
                                              ({"$ref": "#/$defs/missing"}, "missing"),
                                              ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength"),
                                              # NOTE: llguidance 1.9.1 panics here (it cuts its message inside the
                                              # character): a 400 too, never a 500
                                              ({"pattern": ["x" * 95 + "\U00103c0a"]}, "")])
def test_a_schema_that_cannot_be_served_is_refused_naming_the_field(schema: dict, said: str) -> None:
    refused = rejected(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert refused.param == "response_format.json_schema.schema" and said in str(refused)
    assert refused.kind == "invalid"


@pytest.mark.parametrize("response_format", [{"type": "json_schema"}, {"type": "xml"},
                                             {"type": "json_schema", "json_schema": {"name": "has space"}},
                                             {"type": "json_object", "json_schema": {"name": "s"}}])
def test_a_malformed_response_format_fails_validation(response_format: dict) -> None:
    with pytest.raises(ValidationError, match="response_format"):
        ChatCompletionBody.model_validate({**CHAT, "response_format": response_format})


def test_structured_output_refuses_the_fields_that_would_fight_its_grammar() -> None:
    assert rejected(response_format={"type": "json_object"}, ignore_eos=True).param == "ignore_eos"
    assert rejected(response_format={"type": "json_object"}, min_tokens=2).param == "min_tokens"


def test_tool_choice_picks_the_calls_the_answer_may_make() -> None:
    required = json.loads(submit(tools=[WEATHER, TIME], tool_choice="required").sampling.constraint)
    assert required["tools"] and "text" not in required
    assert [c["properties"]["name"]["const"] for c in required["schema"]["anyOf"]] == ["get_weather", "get_time"]
    assert required["schema"]["anyOf"][1]["properties"]["arguments"] == {"type": "object", "properties": {},
                                                                          "additionalProperties": False}
    auto = json.loads(submit(tools=[WEATHER, TIME]).sampling.constraint)  # NOTE: auto is the default with tools
    assert auto["text"] and auto["tools"]
    named = json.loads(submit(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                  "function": {"name": "get_time"}}).sampling.constraint)
    assert named["schema"]["properties"]["name"] == {"const": "get_time"}
    for constraint in (required, auto, named):
        assert check_constraint(json.dumps(constraint)) is None
    none = submit(tools=[WEATHER], tool_choice="none")
    assert none.sampling.constraint is None and none.messages == CHAT["messages"]


def test_the_callable_tools_are_described_to_the_model_after_its_system_message() -> None:
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "weather?"}]
    sent = submit(messages=messages, tools=[WEATHER], tool_choice="required").messages
    assert [m["role"] for m in sent] == ["system", "system", "user"] and sent[0]["content"] == "Be brief."
    assert '"name": "get_weather"' in sent[1]["content"] and '"city"' in sent[1]["content"]
    assert submit(tools=[WEATHER]).messages[0]["role"] == "system"


@pytest.mark.parametrize(("fields", "param", "said"), [
    ({"tool_choice": "required"}, "tool_choice", "tools is empty"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "get_weather"),
    ({"tools": [TIME, {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools.1.function.parameters", "objekt"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format", "tools"),
])
def test_a_bad_tools_request_is_refused_naming_the_field(fields: dict, param: str, said: str) -> None:
    refused = rejected(**fields)
    assert refused.param == param and said in str(refused)


def test_an_earlier_tool_call_and_its_result_are_read_by_the_model() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    sent = submit(messages=messages, tools=[WEATHER]).messages
    assert sent[-2:] == [{"role": "assistant", "content": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
                         {"role": "tool", "content": "sunny"}]
    with pytest.raises(ValidationError, match="needs content"):
        ChatCompletionBody.model_validate({**CHAT, "messages": [{"role": "user", "content": None}]})


def _answer(*texts: str, reason: FinishReason = FinishReason.STOP) -> dict:
    choices = tuple(Choice(t, reason, 5) for t in texts)
    return chat_completion_object(Answer("req-1", "fp32", 0, 3, choices, tool_calls=True))


def test_a_tool_call_is_answered_in_openais_shape_and_text_stays_text() -> None:
    answer = _answer('{"name":"get_weather","arguments":{"city":"Paris"}}', "It is sunny.")
    call, text = answer["choices"]
    assert call["finish_reason"] == "tool_calls" and call["message"]["content"] is None
    [made] = call["message"]["tool_calls"]
    assert made["type"] == "function" and made["id"] == "call_req1_0" and made["function"]["name"] == "get_weather"
    assert json.loads(made["function"]["arguments"]) == {"city": "Paris"}
    assert text["message"] == {"role": "assistant", "content": "It is sunny."} and text["finish_reason"] == "stop"
    cut = _answer('{"name":"get_weather","argu', reason=FinishReason.LENGTH)["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == '{"name":"get_weather","argu'


def test_a_streamed_tool_call_is_held_back_and_sent_whole() -> None:
    writer = ChunkWriter(CHAT_COMPLETIONS, "req-1", "fp32", 0, include_usage=True, tool_calls=True)
    assert [writer.text(p) for p in ('{"name":"get_time",', '"arguments":{}}')] == [None, None]
    last, finish, usage = writer.closing(FinishReason.STOP, {"total_tokens": 9})
    assert last["choices"][0]["delta"]["tool_calls"] == [{"index": 0, "id": "call_req1_0", "type": "function",
                                                          "function": {"name": "get_time", "arguments": "{}"}}]
    assert finish["choices"][0]["finish_reason"] == "tool_calls" and usage["usage"] == {"total_tokens": 9}
    texting = ChunkWriter(CHAT_COMPLETIONS, "req-2", "fp32", 0, tool_calls=True)
    assert texting.text("Sunny")["choices"][0]["delta"] == {"content": "Sunny"}
    assert texting.text(" {today}")["choices"][0]["delta"] == {"content": " {today}"}
    assert [c["choices"][0]["finish_reason"] for c in texting.closing(FinishReason.STOP, None)] == ["stop"]


def _line(body: dict) -> object:
    raw = json.dumps({"custom_id": "c1", "method": "POST", "url": CHAT_COMPLETIONS, "body": body}).encode()
    return parse_line(raw, line_no=1, endpoint=CHAT_COMPLETIONS, catalog=_catalog(), max_prompt_chars=10_000,
                      max_line_bytes=100_000)


def test_batch_lines_take_the_same_structured_fields() -> None:
    accepted = _line({**CHAT, "tools": [WEATHER], "tool_choice": "required"})
    assert not isinstance(accepted, LineError) and is_tool_call(accepted.sampling.constraint)
    refused = _line({**CHAT, "response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "s", "schema": {"type": "objekt"}}}})
    assert isinstance(refused, LineError) and "response_format.json_schema.schema" in refused.message


KEYWORDS = ["type", "properties", "items", "required", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "pattern",
            "minLength", "maxLength", "minimum", "maximum", "minItems", "maxItems", "additionalProperties", "format",
            "$defs", "not", "prefixItems", "multipleOf", "exclusiveMinimum"]


def test_any_json_as_a_schema_is_checked_without_raising() -> None:
    """Whatever JSON a body sends as a schema, checking it answers (an error message or None); a library panic or
    exception would be a 500 on the api."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    leaves = st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False) | st.text(max_size=8) \
        | st.sampled_from(["string", "object", "array", "integer", "number", "boolean", "null", "#", "#/$defs/a",
                           "^[a-z]+$", "("])
    schemas = st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(KEYWORDS) | st.text(max_size=4), inner, max_size=4), max_leaves=12)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.dictionaries(st.sampled_from(KEYWORDS), schemas, max_size=4))
    def check(schema: dict) -> None:
        for constraint in (constraint_json(schema), constraint_json(schema, text=True, tools=True)):
            said = check_constraint(constraint)
            assert said is None or (isinstance(said, str) and said), constraint

    check()
