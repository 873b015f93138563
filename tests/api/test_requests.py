"""The API's own routes on real PostgreSQL and Redis: queued requests, keys and tenants, limits, operations."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

from tests.api.conftest import client_for
from tests.conftest import REPO
from tests.jobs.conftest import line


def test_a_posted_request_answers_202_at_once_and_get_with_wait_gives_result_and_timings(stack) -> None:
    api = client_for(stack, stack.key("acme"))
    posted = api.post("/v1/requests", json={"config": stack.model, "prompt": "the cat",
                                            "sampling": {"max_new_tokens": 4}, "priority": 3})
    assert posted.status_code == 202 and posted.json()["status"] == "queued"
    request_id = posted.json()["id"]
    done = api.get(f"/v1/requests/{request_id}", params={"wait": 30}).json()
    assert done["status"] == "succeeded" and done["priority"] == 3
    assert done["result"]["num_generated_tokens"] >= 1 and isinstance(done["result"]["text"], str)
    assert done["timings"]["e2e_ms"] >= done["timings"]["ttft_ms"] > 0 and done["timings"]["queue_ms"] >= 0


def test_chat_messages_are_accepted_and_a_request_failing_in_the_worker_says_why(stack) -> None:
    api = client_for(stack, stack.key("acme"))
    chat = api.post("/v1/requests", json={"config": stack.model, "messages": [{"role": "user", "content": "hi"}],
                                          "sampling": {"max_new_tokens": 2}})
    too_long = api.post("/v1/requests", json={"config": stack.model, "prompt": "cat " * 400,
                                              "sampling": {"max_new_tokens": 2}})  # > 256 context tokens
    assert api.get(f"/v1/requests/{chat.json()['id']}", params={"wait": 30}).json()["status"] == "succeeded"
    failed = api.get(f"/v1/requests/{too_long.json()['id']}", params={"wait": 30}).json()
    assert failed["status"] == "failed" and "max_context_tokens" in failed["error"]


def test_a_request_without_max_new_tokens_may_generate_up_to_the_configs_limit(stack) -> None:
    """As the schema documents: not OpenAI's completions default of 16."""
    from servelab.store.db import session_scope
    from servelab.store.models import RequestRow

    api = client_for(stack, stack.key("acme"))
    limit = stack.served.worker.engine.config.decoding.max_new_tokens
    assert limit > 16
    ids = [api.post("/v1/requests", json={"config": stack.model, **what}).json()["id"]
           for what in ({"prompt": "the cat"}, {"messages": [{"role": "user", "content": "hi"}]})]
    with session_scope(stack.runtime.sessions) as session:
        assert [session.get(RequestRow, uuid.UUID(i)).sampling["max_new_tokens"] for i in ids] == [limit, limit]
    too_many = api.post("/v1/requests", json={"config": stack.model, "prompt": "hi",
                                              "sampling": {"max_new_tokens": limit + 1}})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "sampling.max_new_tokens"
    assert f"generates at most {limit} tokens" in too_many.json()["error"]["message"]
    for request_id in ids:  # served, so that the tenant's queue is empty for the tests after this one
        assert api.get(f"/v1/requests/{request_id}", params={"wait": 60}).json()["status"] == "succeeded"


def test_unknown_config_is_404_naming_the_known_ones(stack) -> None:
    api = client_for(stack, stack.key("acme"))
    answer = api.post("/v1/requests", json={"config": "nope", "prompt": "hi"})
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert error["code"] == "model_not_found" and stack.model in error["message"] and "fp32" in error["message"]


def test_missing_or_wrong_keys_are_401_with_a_message(stack) -> None:
    for headers in ({}, {"Authorization": "Bearer sl-wrong"}, {"Authorization": "Basic abc"}):
        answer = client_for(stack).get("/v1/batches", headers=headers)
        assert answer.status_code == 401, headers
        assert answer.json()["error"]["message"] and answer.json()["error"]["type"] == "authentication_error"


def test_a_revoked_key_is_refused(stack) -> None:
    from datetime import UTC, datetime

    from servelab.store import keys
    from servelab.store.db import session_scope

    key = stack.key("acme")
    with session_scope(stack.runtime.sessions) as session:
        assert keys.revoke_key(session, key=key, now=datetime.now(UTC))
    assert client_for(stack, key).get("/v1/batches").status_code == 401


def test_one_tenant_can_neither_read_nor_cancel_anothers_requests_files_and_batches(stack) -> None:
    acme, other = client_for(stack, stack.key("acme")), client_for(stack, stack.key("globex"))
    request_id = acme.post("/v1/requests", json={"config": stack.model, "prompt": "hi",
                                                 "sampling": {"max_new_tokens": 2}}).json()["id"]
    file_id = acme.post("/v1/files", data={"purpose": "batch"},
                        files={"file": ("a.jsonl", line("x", stack.model).encode())}).json()["id"]
    batch_id = acme.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions"}).json()["id"]
    for path in (f"/v1/requests/{request_id}", f"/v1/files/{file_id}", f"/v1/files/{file_id}/content",
                 f"/v1/batches/{batch_id}"):
        assert other.get(path).status_code == 404, path
        assert acme.get(path).status_code == 200, path
    assert other.post(f"/v1/batches/{batch_id}/cancel").status_code == 404
    assert other.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions"}).status_code == 404
    assert batch_id not in [b["id"] for b in other.get("/v1/batches").json()["data"]]
    assert acme.post(f"/v1/batches/{batch_id}/cancel").json()["status"] == "cancelling"


def test_oversized_bodies_and_prompts_are_413_with_a_message(stack) -> None:
    api = client_for(stack, stack.key("acme"))
    body = api.post("/v1/requests", content=json.dumps({"config": stack.model, "prompt": "x" * 70_000}),
                    headers={"Content-Type": "application/json"})
    assert body.status_code == 413 and "64000 bytes" in body.json()["error"]["message"]
    prompt = api.post("/v1/completions", json={"model": stack.model, "prompt": "y" * 3_000})
    assert prompt.status_code == 413 and "3000 characters" in prompt.json()["error"]["message"]
    lines = "\n".join(line(f"r{i}", stack.model) for i in range(5_001)).encode()
    too_many = api.post("/v1/files", data={"purpose": "batch"}, files={"file": ("big.jsonl", lines)})
    assert too_many.status_code == 413 and "5001 lines" in too_many.json()["error"]["message"]


def test_too_many_queued_requests_is_429_with_a_message(make_stack) -> None:
    stack = make_stack(with_worker=False, max_queued_requests=3)  # fp32 has no worker: requests stay queued
    # NOTE: a tenant of this test's own: other tests of the session leave their tenants' requests queued
    api = client_for(stack, stack.key(f"limited-{uuid.uuid4().hex[:8]}"))
    codes = [api.post("/v1/requests", json={"config": "fp32", "prompt": "hi"}).status_code for _ in range(4)]
    assert codes == [202, 202, 202, 429]
    answer = api.post("/v1/requests", json={"config": "fp32", "prompt": "hi"}).json()["error"]
    assert "3 queued requests" in answer["message"] and answer["type"] == "rate_limit_error"
    other = client_for(stack, stack.key("globex"))  # the limit is per tenant
    assert other.post("/v1/requests", json={"config": "fp32", "prompt": "hi"}).status_code == 202


def test_bad_parameters_are_400_naming_the_field(stack) -> None:
    api = client_for(stack, stack.key("acme"))
    negative = api.post("/v1/completions", json={"model": stack.model, "prompt": "hi", "max_tokens": -1})
    assert negative.status_code == 400 and negative.json()["error"]["param"] == "max_tokens"
    options = api.post("/v1/chat/completions", json={"model": stack.model, "stream_options": {"include_usage": True},
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert options.status_code == 400 and "only allowed when stream is true" in options.json()["error"]["message"]
    too_many = api.post("/v1/completions", json={"model": stack.model, "prompt": "hi", "max_tokens": 65})
    assert too_many.status_code == 400 and "at most 64" in too_many.json()["error"]["message"]
    purpose = api.post("/v1/files", data={"purpose": "fine-tune"}, files={"file": ("a.jsonl", b"{}")})
    assert purpose.status_code == 400
    window = api.post("/v1/batches", json={"input_file_id": "file-x", "endpoint": "/v1/completions",
                                           "completion_window": "forever"})
    assert window.status_code == 400 and "completion_window" in window.json()["error"]["message"]
    # a NUL byte (which PostgreSQL text cannot hold) in an id or a filter is the client's error, named
    nul_file = api.post("/v1/batches", json={"input_file_id": "\x00", "endpoint": "/v1/completions"})
    assert nul_file.status_code == 400 and "input_file_id" in nul_file.json()["error"]["message"]
    for path in ("/v1/files/%00", "/v1/files/%00/content", "/v1/files?purpose=%00", "/v1/files?after=%00"):
        assert api.get(path).status_code == 400, path


def test_cancelling_a_finished_batch_is_409(stack) -> None:
    from servelab.store import batch_jobs
    from servelab.store.db import session_scope
    from servelab.store.models import BatchStatus

    api = client_for(stack, stack.key("acme"))
    file_id = api.post("/v1/files", data={"purpose": "batch"},
                       files={"file": ("a.jsonl", line("x", stack.model).encode())}).json()["id"]
    batch_id = api.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions"}).json()["id"]
    with session_scope(stack.runtime.sessions) as session:
        batch_jobs.update_job(session, job_id=batch_jobs.parse_public_id(batch_id), status=BatchStatus.COMPLETED)
    answer = api.post(f"/v1/batches/{batch_id}/cancel")
    assert answer.status_code == 409 and "completed" in answer.json()["error"]["message"]


def test_metrics_export_submissions_queue_depth_and_the_worker_counts_by_model_name(stack) -> None:
    api = client_for(stack, stack.key("acme"))
    request_id = api.post("/v1/requests", json={"config": stack.model, "prompt": "hi",
                                                "sampling": {"max_new_tokens": 3}}).json()["id"]
    api.get(f"/v1/requests/{request_id}", params={"wait": 30})
    assert api.post("/v1/requests", json={"config": "no-such-model", "prompt": "hi"}).status_code == 404
    text = client_for(stack).get("/metrics").text
    model = f'model_name="{stack.model}"'
    assert f'servelab:submissions_total{{endpoint="/v1/requests",{model},outcome="accepted"}} 1.0' in text
    # NOTE: a name that is no served config is never a label value (clients could grow the series without end)
    assert 'servelab:submissions_total{endpoint="/v1/requests",model_name="",outcome="model_not_found"}' in text
    assert "no-such-model" not in text
    assert f'servelab:queue_depth{{{model},stream="interactive"}} 0.0' in text
    # the worker runs in this process here, so its counts show too (deployed, each worker serves its own)
    assert f'servelab:request_success_total{{finished_reason="length",{model}}} 1.0' in text
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency", "request_queue_time"):
        assert f'servelab:{name}_seconds_bucket{{le="+Inf",{model}}} ' in text
    assert f"servelab:generation_tokens_total{{{model}}} 3.0" in text


def test_health_readiness_and_openapi_are_served_without_a_key(stack) -> None:
    api = client_for(stack)
    assert api.get("/healthz").json() == {"status": "ok"}
    assert api.get("/readyz").json() == {"status": "ready"}
    paths = api.get("/openapi.json").json()["paths"]
    assert {"/v1/requests", "/v1/completions", "/v1/chat/completions", "/v1/batches", "/v1/files"} <= set(paths)


def test_the_api_process_never_loads_torch() -> None:
    code = "import sys, api.app; assert not {'torch', 'transformers'} & set(sys.modules), 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
