"""The OpenAI surface as its users' tools expect it, with the official openai package against the real api
process: retries that cannot duplicate work (an Idempotency-Key; a long wait answered with a 504 the client
does not retry; a client that leaves cancels a request that has not started), newer fields honoured (log-probabilities
in OpenAI's shapes, checked against the reference model; penalties; n choices) or refused by name,
GET /v1/models/{id}, DELETE /v1/files/{id}, a batch's usage, log-probabilities and its files' expiry."""

from __future__ import annotations

import io
import json
import time
import uuid

import math

import httpx
import openai
import pytest
import torch
from sqlalchemy import select

from servelab.scheduler.policy import BatchPolicy
from servelab.request import ChatMessage, GenerationRequest, SamplingParams
from servelab.store import batch_jobs
from servelab.store.db import session_scope
from servelab.store.models import BatchJobRow, BatchStatus, RequestRow, RequestStatus, ResultRow
from tests.api.conftest import api_process, client_for
from tests.engine.naive import naive_decode
from tests.jobs.conftest import CHAT, line, register, wait_until

PROMPT = "once upon a time"
MESSAGES = [{"role": "user", "content": "Say hi"}]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture
def idle(make_stack, make_served, tiny_engine):
    """The real api process beside a registered worker that serves nothing until the test starts it."""
    stack = make_stack(with_worker=False)
    served = make_served(BatchPolicy(max_batch_size=8, max_wait_ms=5, max_batch_tokens=100_000))
    register(served, tiny_engine)
    served.streams.ensure_groups()
    stack.served = served
    with api_process(stack) as url:
        yield stack, served, url


def openai_client(stack, url: str, *, tenant: str = "acme", sent: list[str] | None = None, **kwargs) -> openai.OpenAI:
    """The openai client; `sent` collects each attempt's x-stainless-retry-count (the client counts its retries)."""
    hooks = {"request": [lambda request: sent.append(request.headers["x-stainless-retry-count"])]} if sent is not None else {}
    options = {"max_retries": 0, "timeout": 60, **kwargs}
    return openai.OpenAI(base_url=url, api_key=stack.key(tenant), http_client=openai.DefaultHttpxClient(event_hooks=hooks),
                         **options)


def rows(stack) -> list[RequestRow]:
    with session_scope(stack.runtime.sessions) as session:
        return list(session.scalars(select(RequestRow).where(RequestRow.serving_config_name == stack.model)
                                    .order_by(RequestRow.enqueued_at)))


def result_of(stack, request_id: str) -> ResultRow | None:
    with session_scope(stack.runtime.sessions) as session:
        return session.get(ResultRow, uuid.UUID(request_id))


# --- retries that cannot duplicate work ---


def test_a_retried_completion_with_the_same_idempotency_key_runs_once(idle) -> None:
    """The openai client times out and retries twice (its default), each time with the same key: one row, which
    the client's next call with the key answers once a worker has served it, the request having run once."""
    stack, served, url = idle
    key, sent = f"key-{uuid.uuid4()}", []
    # NOTE: the read timeout unsaid (Omit), so the client times out before the server's wait ends, and retries
    headers = {"Idempotency-Key": key, "x-stainless-read-timeout": openai.Omit()}
    impatient = openai_client(stack, url, sent=sent, max_retries=2, timeout=2)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=stack.model, prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_headers=headers)
    assert sent == ["0", "1", "2"], "the client sent the request three times"
    # NOTE: the client gave up (no worker serves yet, so no answer could come); its rows are read once written
    [row] = wait_until(lambda: rows(stack), timeout_s=30)
    assert row.status is RequestStatus.QUEUED, "a keyed request outlives its client's connection"

    served.start()
    patient = openai_client(stack, url)
    raw = patient.completions.with_raw_response.create(model=stack.model, prompt=PROMPT, max_tokens=6, temperature=0,
                                                       extra_headers={"Idempotency-Key": key})
    answer = raw.parse()
    assert raw.headers["Idempotent-Replayed"] == "true" and answer._request_id == str(row.id)
    assert answer.id == f"cmpl-{row.id}" and answer.choices[0].text == result_of(stack, str(row.id)).text
    [row] = rows(stack)
    assert row.status is RequestStatus.SUCCEEDED and row.num_attempts == 1

    with pytest.raises(openai.UnprocessableEntityError) as info:  # the key again, with another body
        patient.completions.create(model=stack.model, prompt=PROMPT, max_tokens=7, temperature=0,
                                   extra_headers={"Idempotency-Key": key})
    assert info.value.code == "idempotency_key_reused" and "fields differ: max_tokens" in info.value.message
    assert len(rows(stack)) == 1


def test_a_completion_past_the_wait_limit_is_a_504_the_openai_client_does_not_retry(idle) -> None:
    """Answered before the client's read timeout (it says it: x-stainless-read-timeout), with x-should-retry:
    false and the request's id; the request goes on and is read by id once served."""
    stack, served, url = idle
    sent: list[str] = []
    client = openai_client(stack, url, sent=sent, max_retries=2, timeout=4)  # NOTE: the client's defaults, shorter
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=4, temperature=0)
    error = info.value
    assert error.status_code == 504 and error.code == "timeout" and sent == ["0"], "no retry"
    assert error.response.headers["x-should-retry"] == "false"
    [row] = rows(stack)
    assert error.request_id == str(row.id) and f"GET /v1/requests/{row.id}" in error.message
    assert row.status is RequestStatus.QUEUED, "answering 504 cancels nothing"
    served.start()
    done = httpx.get(f"{url}/requests/{row.id}", params={"wait": 30}, timeout=60,
                     headers={"Authorization": f"Bearer {stack.key('acme')}"}).json()
    assert done["status"] == "succeeded" and done["result"]["num_generated_tokens"] >= 1


def test_a_client_that_leaves_before_its_request_starts_cancels_it(idle) -> None:
    """Every choice of it (n: 2)."""
    stack, served, url = idle
    with pytest.raises(httpx.ReadTimeout):  # NOTE: a client that says no read timeout and gives up after 1.5 s
        httpx.post(f"{url}/completions", json={"model": stack.model, "prompt": PROMPT, "max_tokens": 4, "n": 2},
                   headers={"Authorization": f"Bearer {stack.key('acme')}"}, timeout=1.5)
    # NOTE: no worker serves yet, so the client's 1.5 s pass with no answer on any machine; its rows once written
    left = wait_until(lambda: found if len(found := rows(stack)) == 2 else None, timeout_s=30)
    wait_until(lambda: all(r.status is RequestStatus.CANCELLED for r in rows(stack)), timeout_s=30)
    served.start()
    other = openai_client(stack, url).completions.create(model=stack.model, prompt="the river", max_tokens=3)
    assert other.choices[0].finish_reason in ("stop", "length")
    for cancelled in (r for r in rows(stack) if r.id in {x.id for x in left}):
        assert cancelled.error == "cancelled: the client disconnected"
        assert cancelled.num_attempts == 0 and cancelled.started_at is None, "it never started"
    wait_until(lambda: served.streams.depth() == {"interactive": 0, "bulk": 0}, timeout_s=30)


def test_the_native_api_takes_the_key_too_and_a_bad_key_is_a_400_naming_it(stack) -> None:
    api = client_for(stack, stack.key("acme"))
    body = {"config": stack.model, "prompt": "hi", "sampling": {"max_new_tokens": 2}}
    first = api.post("/v1/requests", json=body, headers={"Idempotency-Key": "native-1"})
    again = api.post("/v1/requests", json=body, headers={"Idempotency-Key": "native-1"})
    assert first.status_code == again.status_code == 202 and first.json()["id"] == again.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true" and "Idempotent-Replayed" not in first.headers
    other_tenant = client_for(stack, stack.key("globex")).post("/v1/requests", json=body,
                                                                headers={"Idempotency-Key": "native-1"})
    assert other_tenant.json()["id"] != first.json()["id"], "keys are per tenant"
    chat = api.post("/v1/chat/completions", json={"model": stack.model, "messages": MESSAGES},
                    headers={"Idempotency-Key": "native-1"})
    assert chat.status_code == 422 and "not POST /v1/chat/completions" in chat.json()["error"]["message"]
    bad = api.post("/v1/requests", json=body, headers={"Idempotency-Key": "x" * 256})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Idempotency-Key"
    api.get(f"/v1/requests/{first.json()['id']}", params={"wait": 30})


def test_an_upload_refuses_unknown_form_fields_and_bad_expiry_by_name(stack) -> None:
    api = client_for(stack, stack.key("acme"))
    upload = {"file": ("a.jsonl", line("x", stack.model).encode())}
    unknown = api.post("/v1/files", data={"purpose": "batch", "colour": "red"}, files=upload)
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "colour"
    for expiry in ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"},
                   {"expires_after[anchor]": "last_used_at", "expires_after[seconds]": "3600"},
                   {"expires_after[seconds]": "3600"}):
        refused = api.post("/v1/files", data={"purpose": "batch", **expiry}, files=upload)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "expires_after", expiry
    batch = api.post("/v1/batches", json={"input_file_id": "file-x", "endpoint": "/v1/completions",
                                          "output_expires_after": {"anchor": "created_at", "seconds": 10}})
    assert batch.status_code == 400 and "output_expires_after.seconds" in batch.json()["error"]["param"]


# --- fields: honoured, or refused by name ---


def test_newer_parameters_are_refused_by_name_and_their_neutral_values_accepted(idle) -> None:
    stack, served, url = idle
    client = openai_client(stack, url)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "objekt"}}}
    asked = [({"functions": [{"name": "f"}]}, "functions"),
             ({"response_format": bad_schema}, "response_format.json_schema.schema"),
             ({"logit_bias": {"50": 5}}, "logit_bias"), ({"extra_body": {"min_p": 1.5}}, "min_p"),
             ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
             ({"tool_choice": "required"}, "tool_choice"), ({"n": 17}, "n"), ({"n": 2, "stream": True}, "n"),
             ({"logprobs": True, "stream": True}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
             ({"presence_penalty": 2.5}, "presence_penalty")]
    for kwargs, param in asked:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=stack.model, messages=MESSAGES, max_tokens=2, **kwargs)
        assert info.value.param == param and param in info.value.message, kwargs
    assert "send tools instead" in _refusal(client, stack, functions=[{"name": "f"}])
    assert rows(stack) == [], "nothing refused was queued"
    served.start()
    answer = client.chat.completions.create(model=stack.model, messages=MESSAGES, max_tokens=2, temperature=0,
                                            tool_choice="none", response_format={"type": "text"}, presence_penalty=0,
                                            logprobs=False, user="u-1", service_tier="auto")
    assert isinstance(answer.choices[0].message.content, str)


def _reference(tiny_engine, request: GenerationRequest, **penalties) -> list[tuple[int, torch.Tensor]]:
    """The naive reference's (token, raw log-softmax) for the request, on the worker's own model."""
    return naive_decode(tiny_engine.model, tiny_engine.encode(request), request.params.max_new_tokens,
                        tiny_engine.eos_token_ids, **penalties)


def test_chat_logprobs_come_back_in_openais_shape_with_the_reference_models_values(idle, tiny_engine) -> None:
    stack, served, url = idle
    served.start()
    answer = openai_client(stack, url).chat.completions.create(model=stack.model, messages=MESSAGES, max_tokens=6,
                                                              temperature=0, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    request = GenerationRequest("r", messages=(ChatMessage("user", "Say hi"),), params=SamplingParams(max_new_tokens=6))
    reference = _reference(tiny_engine, request)
    assert len(content) == answer.usage.completion_tokens == len(reference)
    for entry, (token_id, log_softmax) in zip(content, reference):
        assert bytes(entry.bytes) == tiny_engine.decodings.token_bytes(token_id)
        assert math.isclose(entry.logprob, float(log_softmax[token_id]), abs_tol=2e-4)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy: the likeliest
        assert entry.top_logprobs[0].logprob == entry.logprob
        top = torch.topk(log_softmax, 3)
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [tiny_engine.decodings.token_bytes(i) for i in top.indices.tolist()]
    [row] = rows(stack)
    shown = httpx.get(f"{url}/requests/{row.id}", headers={"Authorization": f"Bearer {stack.key('acme')}"}).json()
    assert shown["result"]["logprobs"] == answer.model_dump()["choices"][0]["logprobs"]["content"]


def test_completion_logprobs_come_back_in_the_legacy_shape(idle, tiny_engine) -> None:
    stack, served, url = idle
    served.start()
    answer = openai_client(stack, url).completions.create(model=stack.model, prompt=PROMPT, max_tokens=5,
                                                         temperature=0, logprobs=2, frequency_penalty=1.5)
    logprobs = answer.choices[0].logprobs
    request = GenerationRequest("r", prompt=PROMPT, params=SamplingParams(max_new_tokens=5))
    reference = _reference(tiny_engine, request, frequency_penalty=1.5)
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(reference)
    for token, logprob, top, (token_id, log_softmax) in zip(logprobs.tokens, logprobs.token_logprobs,
                                                            logprobs.top_logprobs, reference):
        assert token == tiny_engine.decodings.token_bytes(token_id).decode()
        assert math.isclose(logprob, float(log_softmax[token_id]), abs_tol=2e-4)
        assert top[token] == logprob and 2 <= len(top) <= 3, "the two likeliest and the chosen token"
        assert max(top.values()) == pytest.approx(float(log_softmax.max()), abs=2e-4)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert "".join(logprobs.tokens) == answer.choices[0].text


def test_penalties_reach_the_engine_and_decode_as_the_reference_defines_them(idle, tiny_engine) -> None:
    stack, served, url = idle
    served.start()
    client = openai_client(stack, url)
    # NOTE: negative: the tiny model's greedy text repeats nothing, so only a pull towards repeats changes it
    penalised = client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                          presence_penalty=-1.0, frequency_penalty=-2.0)
    plain = client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=12, temperature=0)
    request = GenerationRequest("r", prompt=PROMPT, params=SamplingParams(max_new_tokens=12))
    expected = [t for t, _ in _reference(tiny_engine, request, presence_penalty=-1.0, frequency_penalty=-2.0)]
    assert result_of(stack, penalised.id.removeprefix("cmpl-")).token_ids == expected
    assert penalised.choices[0].text != plain.choices[0].text


def test_n_choices_come_back_indexed_each_seeded_from_the_requests_seed(idle) -> None:
    """Choice i samples with seed + i: asked alone with that seed, it gives the same text. The prompt is counted
    once in usage; a keyed retry answers with the same choices."""
    stack, served, url = idle
    served.start()
    client = openai_client(stack, url)
    key = f"n-{uuid.uuid4()}"
    ask = dict(model=stack.model, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=40)
    answer = client.chat.completions.create(n=3, extra_headers={"Idempotency-Key": key}, **ask)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    made = sorted(rows(stack), key=lambda r: r.choice_index)  # NOTE: one transaction: one enqueued_at
    assert [(r.choice_index, r.sampling["seed"], r.first_choice_id) for r in made] == [
        (i, 40 + i, made[0].id) for i in range(3)]
    assert answer.id == f"chatcmpl-{made[0].id}"
    results = [result_of(stack, str(r.id)) for r in made]
    assert answer.usage.prompt_tokens == results[0].num_prompt_tokens
    assert answer.usage.completion_tokens == sum(r.num_generated_tokens for r in results)
    assert len({c.message.content for c in answer.choices}) > 1, "each choice samples with its own seed"
    alone = client.chat.completions.create(**{**ask, "seed": 41})
    assert alone.choices[0].message.content == answer.choices[1].message.content
    again = client.chat.completions.create(n=3, extra_headers={"Idempotency-Key": key}, **ask)
    assert again.model_dump() == answer.model_dump() and len(rows(stack)) == 4
    greedy = client.chat.completions.create(model=stack.model, messages=MESSAGES, max_tokens=4, temperature=0, n=2)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def _refusal(client: openai.OpenAI, stack, **kwargs) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=stack.model, messages=MESSAGES, max_tokens=2, **kwargs)
    return info.value.message


def test_models_retrieve_answers_a_served_model_and_404_in_openais_shape_otherwise(idle) -> None:
    stack, _, url = idle
    client = openai_client(stack, url)
    model = client.models.retrieve(stack.model)
    assert model.id == stack.model and model.object == "model"
    for name, why in (("gpt-4o", "does not exist"), ("fp32", "no worker serves it")):
        with pytest.raises(openai.NotFoundError) as info:
            client.models.retrieve(name)
        error = info.value.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "model_not_found"
        assert why in error["message"] and stack.model in error["message"]


# --- files and batches ---


def test_delete_file_is_tenant_scoped_and_refused_while_a_batch_reads_it(idle) -> None:
    """No jobs-worker here: the batch stays unfinished until the test ends it."""
    stack, _, url = idle
    acme, globex = openai_client(stack, url), openai_client(stack, url, tenant="globex")
    uploaded = acme.files.create(file=("in.jsonl", io.BytesIO(line("a", stack.model).encode())), purpose="batch")
    batch = acme.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.ConflictError) as info:
        acme.files.delete(uploaded.id)
    assert info.value.code == "file_in_use" and batch.id in info.value.message
    with pytest.raises(openai.NotFoundError):
        globex.files.delete(uploaded.id)
    with session_scope(stack.runtime.sessions) as session:
        batch_jobs.update_job(session, job_id=batch_jobs.parse_public_id(batch.id), status=BatchStatus.COMPLETED)
    deleted = acme.files.delete(uploaded.id)
    assert deleted.id == uploaded.id and deleted.deleted is True
    for read in (acme.files.retrieve, acme.files.content, acme.files.delete):
        with pytest.raises(openai.NotFoundError):
            read(uploaded.id)
    assert uploaded.id not in [f.id for f in acme.files.list()]
    assert acme.batches.retrieve(batch.id).input_file_id == uploaded.id, "the batch still names its input"


def test_a_finished_batch_has_openais_usage_and_its_files_expire_as_asked(served_api, jobs_worker) -> None:
    stack, url = jobs_worker, served_api
    client = openai_client(stack, url)
    lines = [line(f"c{i}", stack.model, url=CHAT, prompt=f"story {i}") for i in range(6)]
    with_logprobs = json.loads(lines[0])
    with_logprobs["body"].update(logprobs=True, top_logprobs=2)
    lines[0] = json.dumps(with_logprobs)
    lines.append(json.dumps({"custom_id": "t", "method": "POST", "url": CHAT,
                             "body": {"model": stack.model, "messages": MESSAGES, "functions": [{"name": "f"}]}}))
    lines.append(json.dumps({"custom_id": "call", "method": "POST", "url": CHAT, "body": {
        "model": stack.model, "messages": MESSAGES, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "weather"}}]}}))  # NOTE: no arguments: one answer
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch",
                                   expires_after={"anchor": "created_at", "seconds": 3_600})
    assert uploaded.expires_at == uploaded.created_at + 3_600
    key = f"batch-{uuid.uuid4()}"
    made = [client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h",
                                  output_expires_after={"anchor": "created_at", "seconds": 7_200},
                                  extra_headers={"Idempotency-Key": key}) for _ in range(2)]
    assert made[0].id == made[1].id, "a retried create answers with the first batch"
    with session_scope(stack.runtime.sessions) as session:
        assert len(session.scalars(select(BatchJobRow).where(BatchJobRow.input_file_id == uploaded.id)).all()) == 1
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(made[0].id)).status != "completed":
        assert time.monotonic() < deadline and batch.status in ("validating", "in_progress", "finalizing"), batch
        time.sleep(0.3)
    outputs = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert len(outputs) == 7 and batch.request_counts.failed == 1
    for o in outputs:  # NOTE: the output line's body is the chat response, log-probabilities where asked
        body = o["response"]["body"]
        if o["custom_id"] == "call":  # NOTE: a function of no arguments: the grammar leaves one answer to give
            assert body["choices"][0]["finish_reason"] == "tool_calls", body
            [call] = body["choices"][0]["message"]["tool_calls"]
            assert call["function"] == {"name": "weather", "arguments": "{}"} and call["type"] == "function"
        if o["custom_id"] == "c0":
            content = body["choices"][0]["logprobs"]["content"]
            assert len(content) == body["usage"]["completion_tokens"] and all(len(t["top_logprobs"]) == 2 for t in content)
        else:
            assert body["choices"][0]["logprobs"] is None
    assert batch.usage.input_tokens == sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in outputs) > 0
    assert batch.usage.output_tokens == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in outputs) > 0
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    assert batch.usage.input_tokens_details.cached_tokens == sum(
        o["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outputs)
    [refused] = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert refused["error"]["code"] == "unsupported_parameter" and "functions" in refused["error"]["message"]
    for file_id in (batch.output_file_id, batch.error_file_id):
        written = client.files.retrieve(file_id)
        assert written.expires_at == written.created_at + 7_200
