"""The official openai package, unchanged, against servelab under uvicorn: completions, chat, files, batches."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest

from tests.jobs.conftest import line


@pytest.fixture(scope="module")
def client(module_served_api, module_stack) -> openai.OpenAI:
    """One stack and its processes for the module: each test sends and reads back only its own requests, files
    and batches."""
    return openai.OpenAI(base_url=module_served_api, api_key=module_stack.key("acme"), max_retries=0, timeout=60)


def test_completions_create_answers_with_text_and_usage(client, module_stack, settings) -> None:
    from servelab.engine.engine import Engine
    from servelab.request import GenerationRequest, SamplingParams

    answer = client.completions.create(model=module_stack.model, prompt="The cat", max_tokens=5, temperature=0)
    assert answer.object == "text_completion" and answer.model == module_stack.model
    # the text is the reference: the served model decoding the prompt greedily alone, outside the api and queue
    reference_engine = Engine.from_config(module_stack.served.worker.engine.config, settings)  # NOTE: not the worker's
    reference = reference_engine.generate([GenerationRequest("ref", prompt="The cat", params=SamplingParams(
        max_new_tokens=5))]).completions[0]
    assert answer.choices[0].text == reference.text and answer.choices[0].finish_reason == reference.finish_reason.value
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (reference.num_prompt_tokens,
                                                                            reference.num_generated_tokens)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_chat_completions_create_answers_as_the_assistant(client, module_stack) -> None:
    answer = client.chat.completions.create(model=module_stack.model, max_tokens=4, temperature=0, seed=1,
                                            messages=[{"role": "user", "content": "Say hi"}])
    assert answer.choices[0].message.role == "assistant" and answer.usage.completion_tokens >= 1


def test_unknown_model_is_a_not_found_error_listing_known_models(client, module_stack) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert module_stack.model in info.value.message and "fp32" in info.value.message


def test_models_list_shows_configs_with_a_live_worker(client, module_stack) -> None:
    assert module_stack.model in [m.id for m in client.models.list()]


def test_batches_create_retrieve_and_files_content(client, module_stack) -> None:
    lines = [line(f"c{i}", module_stack.model) for i in range(20)] + ["not json"]
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h",
                                  metadata={"run": "test"})
    assert batch.status == "validating" and batch.metadata == {"run": "test"}
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.3)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (21, 20, 1)
    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(f"c{i}" for i in range(20))
    assert all(o["response"]["body"]["object"] == "text_completion" for o in output)
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert [(e["line"], e["error"]["code"]) for e in errors] == [(21, "invalid_json")]
    assert batch.id in [b.id for b in client.batches.list()]


def test_files_and_batches_lists_page_with_a_cursor_to_the_end(client, module_stack) -> None:
    made = [client.files.create(file=(f"p{i}.jsonl", io.BytesIO((line(f"p{i}", module_stack.model) + "\n").encode())),
                                purpose="batch").id for i in range(5)]
    seen = [f.id for f in client.files.list(limit=2)]  # the client follows `after` while has_more is true
    assert len(seen) == len(set(seen)) and set(made) <= set(seen)  # every file once, and the loop ends
    first = client.files.list(limit=2)
    assert first.has_more and len(first.data) == 2
    oldest_first = [f.id for f in client.files.list(limit=3, order="asc")]
    assert oldest_first == list(reversed(seen))
    for file_id in made[:3]:
        client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    batches = [b.id for b in client.batches.list(limit=1)]
    assert len(batches) == len(set(batches)) >= 3


# --- structured output: response_format and tools, as the client sends and reads them ---

PET = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "indoor": {"type": "boolean"},
                                        "age": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["kind", "indoor", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "the time now"}},
         {"type": "function", "function": {"name": "adopt", "parameters": PET}}]


def test_a_json_schema_answer_parses_into_the_clients_own_model(client, module_stack) -> None:
    """The client's parse(): a pydantic model sent as a strict json_schema, the answer read back into it."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        indoor: bool
        age: int = Field(ge=0, le=9)

    for seed in range(2):
        answer = client.chat.completions.parse(model=module_stack.model, response_format=Pet, temperature=1.0,
                                               seed=seed, max_tokens=40,
                                               messages=[{"role": "user", "content": "A pet as JSON"}])
        assert isinstance(answer.choices[0].message.parsed, Pet), answer.choices[0].message.content
        assert answer.choices[0].finish_reason == "stop"


def test_tool_calls_come_back_in_openais_shape_whole_and_streamed(client, module_stack) -> None:
    import jsonschema

    answer = client.chat.completions.create(model=module_stack.model, tools=TOOLS, tool_choice="required",
                                            max_tokens=40, temperature=0,
                                            messages=[{"role": "user", "content": "Adopt a dog"}])
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_time", "adopt")
    jsonschema.validate(json.loads(call.function.arguments), PET if call.function.name == "adopt" else
                        {"type": "object", "maxProperties": 0})
    named = {"type": "function", "function": {"name": "get_time"}}
    chunks = list(client.chat.completions.create(model=module_stack.model, tools=TOOLS, tool_choice=named,
                                                 max_tokens=40, stream=True,
                                                 messages=[{"role": "user", "content": "Time?"}]))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert [d.tool_calls[0].function.name for d in deltas] == ["get_time"]
    assert deltas[0].tool_calls[0].function.arguments == "{}" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices), "a held-back call shows no text"
    # the call and its result sent back: the conversation goes on
    again = client.chat.completions.create(model=module_stack.model, tools=TOOLS, tool_choice="none", max_tokens=4,
                                           messages=[{"role": "user", "content": "Time?"}, choice.message,
                                                     {"role": "tool", "tool_call_id": call.id, "content": "noon"}])
    assert isinstance(again.choices[0].message.content, str) and again.choices[0].message.tool_calls is None


def test_a_schema_that_cannot_be_served_is_a_bad_request_naming_it(client, module_stack) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=module_stack.model, max_tokens=4, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "s", "schema": {"type": "objekt"}}})
    assert info.value.param == "response_format.json_schema.schema" and "objekt" in info.value.message
