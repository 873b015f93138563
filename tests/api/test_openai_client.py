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
