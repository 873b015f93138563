"""Every text a client sends, over the whole Unicode range, control characters included: served as the tokenizer
reads it (stored without loss), or refused with a 400 naming the field (a lone surrogate, which is not text);
never a 500. Through the real api process over HTTP, on one keep-alive connection, with a tiny-model worker."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Every code point, lone surrogates included, with NUL, controls and surrogates drawn often.
ANY_CHAR = st.one_of(st.sampled_from(["\x00", "\x01", "\x1b", "\x7f", "\ud800", "\udfff", "\ufdd0", "\ufeff"]),
                     st.characters(exclude_categories=()))
ANY_TEXT = st.text(ANY_CHAR, min_size=1, max_size=12)
PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def is_text(value: str) -> bool:
    return not any(0xD800 <= ord(c) <= 0xDFFF for c in value)


@pytest.fixture(scope="module")
def api(module_stack, module_api):
    """One stack and api process for the module: each example reads back only its own answer."""
    key = module_stack.key("acme")
    with httpx.Client(base_url=module_api, timeout=60, headers={"Authorization": f"Bearer {key}"}) as client:
        yield client, module_stack


def post(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    # NOTE: json.dumps escapes every non-ASCII character (a lone surrogate as \ud800), as a client's JSON does
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def expect_served_or_named(response: httpx.Response, fields: dict[str, str | list[str]]) -> None:
    """200 when every field is text; otherwise a 400 whose param names the first field that is not."""
    bad = [name for name, value in fields.items()
           if not all(is_text(v) for v in ([value] if isinstance(value, str) else value))]
    if not bad:
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_text" and error["param"].split(".")[0] in bad, error
    assert "lone surrogate" in error["message"]


@given(prompt=ANY_TEXT, stop=st.lists(ANY_TEXT, max_size=4))
@PROPERTY
def test_completions_serve_any_text_exactly_or_name_the_field(api, tiny_engine, prompt: str, stop: list[str]) -> None:
    client, stack = api
    response = post(client, "/completions", {"model": stack.model, "prompt": prompt, "stop": stop, "max_tokens": 1,
                                             "temperature": 0})
    expect_served_or_named(response, {"prompt": prompt, "stop": stop})
    if response.status_code == 200:  # the worker read the prompt exactly as sent: the same tokens
        assert response.json()["usage"]["prompt_tokens"] == len(tiny_engine.tokenizer.encode(
            prompt, add_special_tokens=False))


@given(system=ANY_TEXT, user=ANY_TEXT, stop=st.lists(ANY_TEXT, max_size=2), user_name=ANY_TEXT)
@PROPERTY
def test_chat_completions_serve_any_text_exactly_or_name_the_field(api, system: str, user: str, stop: list[str],
                                                                   user_name: str) -> None:
    client, stack = api
    response = post(client, "/chat/completions", {
        "model": stack.model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "stop": stop, "max_tokens": 1, "temperature": 0, "user": user_name})
    expect_served_or_named(response, {"messages": [system, user], "stop": stop, "user": user_name})


@given(text=ANY_TEXT)
@PROPERTY
def test_other_text_fields_are_never_a_500(api, text: str) -> None:
    client, stack = api
    responses = [
        post(client, "/completions", {"model": text, "prompt": "hi", "max_tokens": 1}),
        post(client, "/requests", {"config": stack.model, "prompt": text, "sampling": {"max_new_tokens": 1,
                                                                                        "stop": [text]}}),
        post(client, "/batches", {"input_file_id": text, "endpoint": "/v1/completions", "completion_window": "24h",
                                  "metadata": {text: text}}),
    ]
    for response in responses:
        assert response.status_code < 500, response.text
        if not is_text(text):
            assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_text"
    assert responses[1].status_code == (202 if is_text(text) else 400)


def test_a_nul_in_a_prompt_and_a_stop_string_is_served_and_read_back(api, tiny_engine) -> None:
    client, stack = api
    prompt = "one\x00two \x00"
    response = post(client, "/requests", {"config": stack.model, "prompt": prompt,
                                          "sampling": {"max_new_tokens": 2, "stop": ["\x00", "x\x00y"]}})
    assert response.status_code == 202
    done = client.get(f"/requests/{response.json()['id']}", params={"wait": 30}).json()
    assert done["status"] == "succeeded", done
    assert done["result"]["num_prompt_tokens"] == len(tiny_engine.tokenizer.encode(prompt, add_special_tokens=False))
