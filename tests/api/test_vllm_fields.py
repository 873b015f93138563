"""vLLM's API as benchmark and evaluation clients use it (AIPerf, GuideLLM): GET /health and /version, the extra
sampling fields honoured on single requests, streams and batch lines, and refusals that point to the right place.
The fields' semantics are checked against their definitions in tests/engine/test_vllm_sampling.py."""

from __future__ import annotations

from datetime import UTC, datetime

import openai
import pytest

from servelab.catalog import load_catalog
from servelab.jobs.ingest import parse_line
from servelab.request import SamplingParams
from servelab.store.db import session_scope
from tests.api.conftest import client_for
from tests.jobs.conftest import COMPLETIONS

VLLM_FIELDS = {"ignore_eos": True, "min_tokens": 3, "stop_token_ids": [7, 9], "repetition_penalty": 1.1,
               "min_p": 0.05, "include_stop_str_in_output": True, "skip_special_tokens": False}


@pytest.fixture(scope="module")
def served(module_stack, module_api):
    """One stack and api process for the module: each test reads back only its own requests."""
    return module_stack, openai.OpenAI(base_url=module_api, api_key=module_stack.key("acme"), max_retries=0,
                                       timeout=60)


def test_health_and_version_answer_as_vllms(make_stack) -> None:
    client = client_for(make_stack(with_worker=False))
    health = client.get("/health")
    assert health.status_code == 200 and health.content == b""
    version = client.get("/version")
    assert version.status_code == 200 and isinstance(version.json()["version"], str) and version.json()["version"]


def test_ignore_eos_answers_exactly_the_asked_length_whole_and_streamed(served) -> None:
    stack, client = served
    for max_tokens in (1, 5, 17):
        whole = client.completions.create(model=stack.model, prompt="hi", max_tokens=max_tokens,
                                          extra_body={"ignore_eos": True, "min_tokens": max_tokens})
        assert whole.usage.completion_tokens == max_tokens
        chunks = list(client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert chunks[-1].usage.completion_tokens == max_tokens


def test_every_vllm_field_is_accepted_and_reaches_the_worker(served) -> None:
    stack, client = served
    whole = client.completions.create(model=stack.model, prompt="hi", max_tokens=6, temperature=0.7, seed=1,
                                      extra_body=VLLM_FIELDS)
    assert whole.usage.completion_tokens >= 3
    streamed = list(client.completions.create(model=stack.model, prompt="hi", max_tokens=6, temperature=0.7, seed=1,
                                              stream=True, extra_body=VLLM_FIELDS))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(served) -> None:
    """As GuideLLM asks for it: every chunk's usage, the prompt's count throughout, completion tokens growing
    to the final count, which the last chunk and the whole answer agree on."""
    stack, client = served
    body = dict(model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**body)
    chunks = list(client.chat.completions.create(**body, stream=True,
                                                 stream_options={"include_usage": True, "continuous_usage_stats": True}))
    texts = [c for c in chunks[1:] if c.choices and c.choices[0].delta.content]
    assert texts and all(c.usage is not None for c in chunks[1:])
    assert {c.usage.prompt_tokens for c in chunks[1:]} == {whole.usage.prompt_tokens}
    made = [c.usage.completion_tokens for c in texts]
    assert made == sorted(made) and 1 <= made[0] and made[-1] <= 12
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 12
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks[1:])
    plain = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 12


def test_refusals_point_to_the_request_fields_not_to_configs(served) -> None:
    stack, client = served
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=stack.model, prompt="hi", max_tokens=4, stream=True,
                                  stream_options={"include_usage": True, "no_such_option": True})
    assert "configs/" not in refused.value.body["message"] and "openapi.json" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=stack.model, prompt="hi", max_tokens=4, extra_body={"min_tokens": 5})
    assert refused.value.body["param"] == "min_tokens" and "min_tokens" in refused.value.body["message"]


def test_a_batch_line_carries_the_vllm_fields(make_stack) -> None:
    stack = make_stack(with_worker=False)
    with session_scope(stack.runtime.sessions) as session:
        catalog = load_catalog(session, configs_dir=stack.settings.configs_dir, live_since=datetime.now(UTC))
    raw = ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "fp32", '
           '"prompt": "hi", "max_tokens": 8, "ignore_eos": true, "min_tokens": 3, "stop_token_ids": [7, 9], '
           '"repetition_penalty": 1.1, "min_p": 0.05, "include_stop_str_in_output": true, '
           '"skip_special_tokens": false}}').encode()
    parsed = parse_line(raw, line_no=1, endpoint=COMPLETIONS, catalog=catalog, max_prompt_chars=1_000,
                        max_line_bytes=10_000)
    assert parsed.sampling == SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True, min_tokens=3,
                                             stop_token_ids=(7, 9), repetition_penalty=1.1, min_p=0.05,
                                             include_stop_str_in_output=True, skip_special_tokens=False)
