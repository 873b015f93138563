"""Streaming through the queue, with the official openai package's streaming iterator against the real api
process: chunks in order that add up to the unstreamed answer, usage when asked, stop strings and multi-byte
characters never split or shown; a client that leaves cancels its request (running: its row leaves the batch
at the worker's next step; queued: it never starts); GET /v1/requests/{id} as an event stream."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid

import httpx
import openai
import pytest
from sqlalchemy import select

from servelab.scheduler.policy import BatchPolicy
from servelab.store.db import session_scope
from servelab.store.models import RequestRow, RequestStatus, ResultRow, StreamMetricsRow
from tests.api.conftest import api_process
from tests.jobs.conftest import register, wait_until

PROMPTS = ["once upon a time", "the river ran", "seven blue houses"]


@pytest.fixture(scope="module")
def streaming(module_stack, module_api):
    """One stack and api process for the module's streaming tests: each reads back only its own requests."""
    return module_stack, module_api


def client_of(stack, url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=stack.key("acme"), max_retries=0, timeout=60)


def _text_chunks(chunks) -> list[str]:
    return [c.choices[0].text for c in chunks if c.choices]


def test_completion_chunks_add_up_to_the_unstreamed_answer_with_usage(streaming) -> None:
    stack, url = streaming
    client = client_of(stack, url)
    for prompt in PROMPTS:  # NOTE: one api process for all three (each start costs seconds of the suite)
        whole = client.completions.create(model=stack.model, prompt=prompt, max_tokens=24, temperature=0)
        chunks = list(client.completions.create(model=stack.model, prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        choice_chunks = [c for c in chunks if c.choices]
        assert "".join(_text_chunks(chunks)) == whole.choices[0].text, prompt
        assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
        assert [c.choices[0].finish_reason for c in choice_chunks[:-1]] == [None] * (len(choice_chunks) - 1)
        assert choice_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
        usage_chunk = chunks[-1]
        # NOTE: the counts, not the cached tokens: a prefix cache serves the second request's prompt, not the first's
        assert usage_chunk.choices == [] and usage_chunk.usage.model_dump(exclude={"prompt_tokens_details"}) == \
            whole.usage.model_dump(exclude={"prompt_tokens_details"})
        assert usage_chunk.usage.prompt_tokens_details.cached_tokens <= usage_chunk.usage.prompt_tokens
        assert all(c.usage is None for c in chunks[:-1])


def test_chat_opens_with_the_assistant_role_and_adds_up_to_the_unstreamed_message(streaming) -> None:
    stack, url = streaming
    client = client_of(stack, url)
    messages = [{"role": "user", "content": "Tell me about rivers"}]
    whole = client.chat.completions.create(model=stack.model, messages=messages, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=stack.model, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(getattr(c, "usage", None) is None for c in chunks), "no usage unless asked"


def test_a_stop_string_never_appears_in_any_chunk(streaming) -> None:
    stack, url = streaming
    client = client_of(stack, url)
    text = client.completions.create(model=stack.model, prompt=PROMPTS[0], max_tokens=32, temperature=0
                                     ).choices[0].text
    assert len(text) > 12, f"the tiny model's answer is too short to cut: {text!r}"
    stop = text[len(text) // 2:len(text) // 2 + 4]  # NOTE: likely across a token boundary
    expected = text[:text.find(stop)]
    chunks = _text_chunks(client.completions.create(model=stack.model, prompt=PROMPTS[0], max_tokens=32,
                                                    temperature=0, stop=[stop], stream=True))
    assert "".join(chunks) == expected
    shown = ""
    for piece in chunks:
        shown += piece
        assert stop not in shown


def test_no_chunk_splits_a_multibyte_character(streaming) -> None:
    """Seeded sampling at a high temperature makes the tiny model pick tokens from its whole byte-level
    vocabulary, pieces of UTF-8 characters among them."""
    stack, url = streaming
    client = client_of(stack, url)
    kwargs = dict(model=stack.model, prompt="naïve café 東京 🙂", max_tokens=48, temperature=1.5, seed=7)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = _text_chunks(client.completions.create(**kwargs, stream=True))
    assert "".join(chunks) == whole and any(ord(ch) > 127 for ch in whole), whole
    for piece in chunks[:-1]:
        assert not piece.endswith("\ufffd"), f"a chunk ends inside a character: {piece!r}"
        assert piece.encode("utf-8").decode("utf-8") == piece


def test_get_request_as_an_event_stream_replays_the_text_and_the_end(streaming) -> None:
    stack, url = streaming
    key = stack.key("acme")
    headers = {"Authorization": f"Bearer {key}"}
    created = httpx.post(f"{url.removesuffix('/v1')}/v1/requests", headers=headers, timeout=30,
                         json={"config": stack.model, "prompt": PROMPTS[1], "sampling": {"max_new_tokens": 12}}).json()
    events = _read_events(f"{url}/requests/{created['id']}", headers)
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "status" and kinds[-1] == "end" and set(kinds[1:-1]) <= {"token"}
    end = events[-1][1]
    done = httpx.get(f"{url}/requests/{created['id']}", headers=headers, timeout=30).json()
    assert "".join(data["text"] for kind, data in events if kind == "token") == done["result"]["text"]
    assert end["status"] == "succeeded" and end["usage"]["completion_tokens"] == done["result"]["num_generated_tokens"]
    again = _read_events(f"{url}/requests/{created['id']}", headers)  # a late reader: the stored result
    assert "".join(d["text"] for k, d in again if k == "token") == done["result"]["text"]
    missing = httpx.get(f"{url}/requests/{uuid.uuid4()}", headers={**headers, "Accept": "text/event-stream"})
    assert missing.status_code == 404


def test_streamed_ttft_is_stored_beside_the_engines(streaming) -> None:
    stack, url = streaming
    client = client_of(stack, url)
    chunks = list(client.completions.create(model=stack.model, prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                            stream=True))
    request_id = chunks[0].id.removeprefix("cmpl-")
    headers = {"Authorization": f"Bearer {stack.key('acme')}"}
    timings = wait_until(lambda: httpx.get(f"{url}/requests/{request_id}", headers=headers).json()["timings"]
                         if _stream_metrics(stack, request_id) else None, timeout_s=30)
    assert timings["streamed_ttft_ms"] >= timings["ttft_ms"] > 0  # NOTE: seen by the client after it was made
    assert _stream_metrics(stack, request_id).num_chunks == len([c for c in _text_chunks(chunks) if c])


def test_streamed_ttft_counts_from_the_requests_arrival_before_its_body_is_read(streaming) -> None:
    """As its client counts it: a body that comes HELD_S after the headers is time to first token too (before
    api.app.StampArrival, servelab's record started once the body was read and the key checked)."""
    stack, url = streaming
    held_s = 0.5
    body = json.dumps({"model": stack.model, "prompt": PROMPTS[0], "max_tokens": 2, "stream": True}).encode()
    host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Authorization: Bearer {stack.key('acme')}\r\nContent-Length: {len(body)}\r\n"
                     "Connection: close\r\n\r\n".encode())
        time.sleep(held_s)
        sock.sendall(body)
        answer = b""
        while chunk := sock.recv(65_536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in answer
    request_id = json.loads(answer.split(b"data: ", 1)[1].split(b"\n", 1)[0])["id"].removeprefix("cmpl-")
    streamed = wait_until(lambda: _stream_metrics(stack, request_id), timeout_s=30)
    assert streamed.ttft_ms >= held_s * 1e3


def test_bad_stream_options_are_refused_before_anything_is_queued(streaming) -> None:
    stack, url = streaming
    client = client_of(stack, url)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=stack.model, prompt="hi", max_tokens=2, stream=False,
                                  stream_options={"include_usage": True})
    assert "stream_options" in info.value.message


# --- cancellation: a worker stepped by the test, so "the next step" can be checked ---


@pytest.fixture
def stepped(make_stack, make_served, tiny_engine):
    stack = make_stack(with_worker=False)
    served = make_served(BatchPolicy(max_batch_size=8, max_wait_ms=5, max_batch_tokens=100_000, policy="continuous"))
    register(served, tiny_engine)
    served.streams.ensure_groups()
    stack.served = served
    with api_process(stack) as url:
        yield stack, served, url


def test_a_client_that_leaves_mid_stream_frees_its_row_at_the_next_step(stepped) -> None:
    stack, served, url = stepped
    client = client_of(stack, url)
    received, left = [], threading.Event()

    def read_three_chunks_and_leave() -> None:
        stream = client.completions.create(model=stack.model, prompt=PROMPTS[0], max_tokens=60, temperature=0,
                                           stream=True)
        for chunk in stream:
            received.append(chunk)
            if len(_text_chunks(received)) >= 3 and all(_text_chunks(received)):
                break
        stream.close()
        left.set()

    reader = threading.Thread(target=read_three_chunks_and_leave, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while not left.is_set():
        assert time.monotonic() < deadline, "the client never got three chunks"
        served.worker.step()
        time.sleep(0.05)  # NOTE: a slow decode step, so the client reads while the row runs
    request_id = received[0].id.removeprefix("cmpl-")
    wait_until(lambda: _row(stack, request_id).status is RequestStatus.CANCELLED, timeout_s=30)
    assert request_id in [r.request_id for r in served.worker.running]
    served.worker.step()
    assert not served.worker.running
    row, result = _row(stack, request_id), _result(stack, request_id)
    assert row.finish_reason.value == "cancelled" and row.error == "cancelled: the client disconnected"
    shown = "".join(_text_chunks(received))
    assert result is not None and result.text.startswith(shown) and result.num_generated_tokens < 60
    assert _stream_metrics(stack, request_id).disconnected


def test_a_queued_request_whose_client_left_never_starts(stepped) -> None:
    stack, served, url = stepped
    client = client_of(stack, url)
    stream = client.completions.create(model=stack.model, prompt=PROMPTS[1], max_tokens=8, stream=True)
    stream.response.close()  # NOTE: the client goes away before the worker has read the queue
    queued = wait_until(lambda: _ids_of(stack, RequestStatus.CANCELLED), timeout_s=30)
    served.start()
    other = client.completions.create(model=stack.model, prompt=PROMPTS[2], max_tokens=3, temperature=0)
    assert other.choices[0].finish_reason in ("stop", "length")
    [cancelled] = [_row(stack, i) for i in queued]
    assert cancelled.status is RequestStatus.CANCELLED and cancelled.num_attempts == 0 and cancelled.started_at is None
    assert served.streams.depth() == {"interactive": 0, "bulk": 0}, "its entry was acknowledged, not left behind"


# --- helpers ---


def _read_events(url: str, headers: dict[str, str]) -> list[tuple[str, dict]]:
    events, kind = [], None
    with httpx.stream("GET", url, headers={**headers, "Accept": "text/event-stream"}, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for text_line in response.iter_lines():
            if text_line.startswith("event: "):
                kind = text_line.removeprefix("event: ")
            elif text_line.startswith("data: "):
                events.append((kind, json.loads(text_line.removeprefix("data: "))))
    return events


def _row(stack, request_id: str) -> RequestRow:
    with session_scope(stack.runtime.sessions) as session:
        return session.get(RequestRow, uuid.UUID(request_id))


def _result(stack, request_id: str) -> ResultRow | None:
    with session_scope(stack.runtime.sessions) as session:
        return session.get(ResultRow, uuid.UUID(request_id))


def _stream_metrics(stack, request_id: str) -> StreamMetricsRow | None:
    with session_scope(stack.runtime.sessions) as session:
        return session.get(StreamMetricsRow, uuid.UUID(request_id))


def _ids_of(stack, status: RequestStatus) -> list[str]:
    with session_scope(stack.runtime.sessions) as session:
        return [str(i) for i in session.scalars(select(RequestRow.id).where(
            RequestRow.serving_config_name == stack.model, RequestRow.status == status))]


# --- a worker that dies mid-stream ---


def test_a_worker_dying_mid_stream_restarts_the_generation_and_the_client_reads_on(make_stack, tmp_path, tiny_folder
                                                                                   ) -> None:
    """What the client receives: the chunks sent before the death, a comment line `: restarted ...` (OpenAI
    clients skip comments), then the rest of the retried generation, never a piece twice; GET /v1/requests/{id}
    as events says `restart`."""
    from tests.queue.test_faults import WorkerProcesses

    stack = make_stack(with_worker=False)
    procs = WorkerProcesses(tmp_path, tiny_folder, stack.settings, f"dying-{uuid.uuid4().hex[:8]}", policy="continuous")
    try:
        procs.start("w-dies")
        with api_process(stack) as url:
            key = stack.key("acme")
            headers = {"Authorization": f"Bearer {key}"}
            model = procs.config.stem
            wait_until(lambda: model in [m["id"] for m in httpx.get(f"{url}/models", headers=headers).json()["data"]],
                       timeout_s=120)
            lines: list[str] = []
            events: list[tuple[str, dict]] = []

            def read() -> None:
                body = {"model": model, "prompt": "the DIE river", "max_tokens": 20, "temperature": 0, "stream": True}
                with httpx.stream("POST", f"{url}/completions", json=body, headers=headers, timeout=120) as response:
                    # NOTE: a restart slower than the api's keep-alive period (a busy machine) adds keep-alive
                    # comments, which clients skip as they skip every comment
                    lines.extend(line for line in response.iter_lines() if line and line != ": keep-alive")

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            wait_until(lambda: procs.procs[0].poll() is not None, timeout_s=120)
            request_id = json.loads(lines[0].removeprefix("data: "))["id"].removeprefix("cmpl-")
            watcher = threading.Thread(target=lambda: events.extend(_read_events(f"{url}/requests/{request_id}",
                                                                                 headers)), daemon=True)
            watcher.start()
            procs.start("w-dies")  # NOTE: the same name takes back its own entries at once
            reader.join(timeout=120)
            watcher.join(timeout=120)
            result = httpx.get(f"{url}/requests/{request_id}", headers=headers).json()
    finally:
        procs.close()
    assert lines[-1] == "data: [DONE]"
    restart = [i for i, line in enumerate(lines) if line.startswith(": restarted")]
    assert len(restart) == 1, lines
    before = [json.loads(x.removeprefix("data: "))["choices"][0]["text"] for x in lines[:restart[0]]]
    after = [json.loads(x.removeprefix("data: "))["choices"][0]["text"] for x in lines[restart[0] + 1:-1]]
    assert "".join(before), "some text was streamed before the worker died"
    assert "".join(before + after) == result["result"]["text"] and result["status"] == "succeeded"
    assert [kind for kind, _ in events].count("restart") == 1 and events[-1][0] == "end"
    assert "".join(d["text"] for k, d in events if k == "token") == result["result"]["text"]


def test_a_request_whose_end_event_never_came_is_ended_from_the_store(stepped, monkeypatch) -> None:
    """Its worker died between the commit and the notification: the stream still ends, with the rest of the
    text and the usage read from the store (within the relay's store check, 5 s of silence)."""
    from servelab.serving import worker as serving

    stack, served, url = stepped
    client = client_of(stack, url)
    monkeypatch.setattr(serving, "notify_done", lambda *args, **kwargs: None)
    chunks: list = []
    reader = threading.Thread(target=lambda: chunks.extend(client.completions.create(
        model=stack.model, prompt=PROMPTS[2], max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True})), daemon=True)
    reader.start()
    finished = 0
    deadline = time.monotonic() + 60
    while not finished:
        assert time.monotonic() < deadline, "the request never finished"
        finished = served.worker.step()
    reader.join(timeout=30)
    assert not reader.is_alive(), "the stream did not end"
    request_id = chunks[0].id.removeprefix("cmpl-")
    assert "".join(_text_chunks(chunks)) == _result(stack, request_id).text
    assert chunks[-1].usage.completion_tokens == _result(stack, request_id).num_generated_tokens
