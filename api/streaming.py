"""Server-sent events: a completion's OpenAI chunk stream, and the event stream of GET /v1/requests/{id}.

Reads a request's token stream (servelab.queue.tokens) with an asyncio Redis client of its own, so the event
loop never blocks on Redis and a slow client holds a coroutine, never a thread; database calls go to the
thread pool. A completion stream whose client leaves before its end cancels the request (queued: it never
starts; running: its worker drops the row at its next step, keeping the text made so far; a request sent with an
Idempotency-Key is kept for the client's retry instead), and records what
the client saw (time to the first chunk from the request's arrival, the gaps between chunks).
A retried generation (its worker died) is relayed without repeating text: the stream shows a comment line
(`: restarted ...`) on the OpenAI endpoints and a `restart` event on GET /v1/requests/{id}, and carries on
where the client was, or ends with an error event if the retried text differs from what was sent.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from datetime import UTC, datetime
from typing import Any

import anyio
import redis.asyncio as aioredis
from anyio.to_thread import run_sync
from fastapi import Request
from fastapi.responses import StreamingResponse

from api.deps import ApiState
from servelab.protocol import ChunkWriter, openai_usage
from servelab.queue.submit import cancel_for_client
from servelab.queue.tokens import (Diverged, Ended, Relay, RelayItem, Restarted, Shown, StreamClock, decode_event,
                                   tokens_key)
from servelab.request import FinishReason
from servelab.store import requests as store
from servelab.store.db import session_scope
from servelab.telemetry import observe_streamed_ttft

log = logging.getLogger(__name__)
BLOCK_MS = 1_000  # one read waits this long at most; between reads the relay checks its client and deadline
KEEP_ALIVE_S = 15.0  # an idle stream sends a comment line this often (proxies, and finding a gone client)
STORE_CHECK_S = 5.0  # an idle stream reads the request's stored status this often
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEP_ALIVE = b": keep-alive\n\n"


def sse(data: dict[str, Any] | str, *, event: str | None = None) -> bytes:
    body = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return (f"event: {event}\n" if event else "").encode() + f"data: {body}\n\n".encode()


async def relay(state: ApiState, request_id: str, *, is_gone: Callable[[], Awaitable[bool]],
                read_view: Callable[[], store.RequestView], deadline_s: float) -> AsyncIterator[RelayItem | None]:
    """The request's stream from its first event, through a Relay; None when the stream has been silent for
    KEEP_ALIVE_S (the caller sends a keep-alive). Ends after the last item, when the client is gone, or at the
    deadline (monotonic seconds).

    NOTE: every STORE_CHECK_S of silence the stored status is read too: a request that ended without an `end`
    event (its worker died between the commit and the notification, or Redis lost the stream) is ended from
    the store, the text not yet shown included."""
    client = aioredis.Redis.from_url(state.runtime.urls.redis_url)
    key, last, items = tokens_key(state.settings.key_prefix, request_id), "0", Relay()
    checked = heard = time.monotonic()
    try:
        while not items.done and time.monotonic() < deadline_s:
            reply = await client.xread({key: last}, count=256, block=BLOCK_MS)
            if not reply:
                if await is_gone():
                    return
                if time.monotonic() - checked >= STORE_CHECK_S:
                    checked = time.monotonic()
                    stored = await run_sync(read_view)
                    if stored.status.is_terminal:
                        for item in _ending(stored, items.shown):
                            yield item
                        return
                if time.monotonic() - heard >= KEEP_ALIVE_S:
                    heard = time.monotonic()
                    yield None
                continue
            heard = time.monotonic()
            for _key, entries in reply:
                for entry_id, fields in entries:
                    last = entry_id
                    for item in items.feed([decode_event(fields)]):
                        yield item
    finally:
        with anyio.CancelScope(shield=True):  # NOTE: the client left: the stream's task is being cancelled
            await client.aclose()


def _watch(http: Request, state: ApiState, request_id: str, read_view: Callable[[], store.RequestView]):
    """The request's relay for one HTTP stream, closed with it: until its client goes, or the wait limit."""
    return aclosing(relay(state, request_id, is_gone=http.is_disconnected, read_view=read_view,
                          deadline_s=time.monotonic() + state.settings.max_wait_s))


def _ending(stored: store.RequestView, shown: str) -> list[RelayItem]:
    """A finished request's end, read from the store: the rest of its text, then its outcome."""
    items: list[RelayItem] = []
    text = stored.text or ""
    if len(text) > len(shown) and text.startswith(shown):
        items.append(Shown(text[len(shown):], stored.num_prompt_tokens, stored.num_generated_tokens))
    return [*items, Ended(stored.status.value, stored.finish_reason.value if stored.finish_reason else None,
                          stored.num_prompt_tokens, stored.num_generated_tokens, stored.error,
                          stored.num_cached_tokens)]


def openai_stream(http: Request, state: ApiState, *, writer: ChunkWriter, arrived_s: float,
                  read_view: Callable[[], store.RequestView], cancel_on_leave: bool = True,
                  headers: dict[str, str] | None = None) -> StreamingResponse:
    """The chunks of a queued completion, as they are made; `data: [DONE]` at the end. A client that leaves
    first cancels the request, unless cancel_on_leave is False (a request sent with an Idempotency-Key)."""
    return StreamingResponse(_openai_chunks(http, state, writer, arrived_s, read_view, cancel_on_leave),
                             media_type="text/event-stream", headers={**HEADERS, **(headers or {})})


async def _openai_chunks(http: Request, state: ApiState, writer: ChunkWriter, arrived_s: float,
                         read_view: Callable[[], store.RequestView], cancel_on_leave: bool) -> AsyncIterator[bytes]:
    request_id, clock = writer.request_id, StreamClock(arrived_s)
    ended, gone, restarts = False, False, 0
    try:
        for chunk in writer.opening():
            yield sse(chunk)
        async with _watch(http, state, request_id, read_view) as items:
            async for item in items:
                if item is None:
                    yield KEEP_ALIVE
                    continue
                for chunk in _openai_event(item, writer, clock):
                    yield chunk
                restarts += isinstance(item, Restarted)
                ended = ended or isinstance(item, Ended | Diverged)
        if not ended:
            gone = await http.is_disconnected()
            if gone:
                return
            ended = True  # NOTE: past the wait limit: the request goes on; the client can read it later
            yield sse(_error(f"request {request_id} is still running after {state.settings.max_wait_s} s; read it "
                             f"later with GET /v1/requests/{request_id}", code="timeout", kind="server_error"))
        yield b"data: [DONE]\n\n"
    except (anyio.get_cancelled_exc_class(), GeneratorExit):
        gone = not ended  # NOTE: the client left (Starlette cancels the stream, or the iterator is closed)
        raise
    except Exception as exc:  # NOTE: Redis or the database failed: the request goes on; say so, cancel nothing
        log.warning("stream of request %s broke: %s", request_id, exc)
        ended = True
        yield sse(_error(f"the stream broke ({type(exc).__name__}); the request goes on: read it later with "
                         f"GET /v1/requests/{request_id}", code="stream_broken", kind="server_error"))
        yield b"data: [DONE]\n\n"
    finally:
        with anyio.CancelScope(shield=True):
            await run_sync(_close_stream, state, request_id, clock, restarts, gone, cancel_on_leave)
        observe_streamed_ttft(model_name=writer.model, ttft_ms=clock.ttft_ms)


def _openai_event(item: RelayItem, writer: ChunkWriter, clock: StreamClock) -> list[bytes]:
    """One relay item as OpenAI chunks (or an SSE comment, which clients skip)."""
    if isinstance(item, Shown):
        clock.mark(time.time())
        # NOTE: as vLLM's, the running usage has no cached count: the closing chunks' (the end event's) have it
        chunk = writer.text(item.text, usage(item.prompt_tokens, item.completion_tokens))
        return [] if chunk is None else [sse(chunk)]  # NOTE: None: a tool call, held back until the end
    if isinstance(item, Restarted):
        return [(f": restarted: the worker serving this request stopped; attempt {item.attempt} generates it "
                 "again and the stream goes on after the text already sent\n\n").encode()]
    if isinstance(item, Diverged):
        return [sse(_error(_diverged(writer.request_id), code="stream_diverged", kind="server_error"))]
    if item.status != "succeeded":
        return [sse(_error(item.error or f"the request ended {item.status}", code=f"request_{item.status}"))]
    return [sse(chunk) for chunk in writer.closing(FinishReason(item.finish_reason or "stop"), usage(
        item.prompt_tokens, item.completion_tokens, cached_tokens=item.cached_tokens or 0))]


def usage(prompt_tokens: int | None, completion_tokens: int | None, *, cached_tokens: int | None = None
          ) -> dict[str, Any]:
    """OpenAI's usage object; a count the worker did not send (an older worker's events) counts 0.
    cached_tokens: given, the prompt_tokens_details (the end's usage); None, left out (the running usage)."""
    return openai_usage(prompt_tokens or 0, completion_tokens or 0, cached_tokens)


def _close_stream(state: ApiState, request_id: str, clock: StreamClock, restarts: int, disconnected: bool,
                  cancel_on_leave: bool) -> None:
    """After a completion stream: cancel the request if its client left first; record what the client saw."""
    if disconnected and cancel_on_leave:
        cancel_for_client(sessions=state.runtime.sessions, redis_client=state.runtime.redis,
                          prefix=state.settings.key_prefix, request_id=request_id, now=datetime.now(UTC))
    with session_scope(state.runtime.sessions) as session:
        store.record_stream(session, request_id=request_id, ttft_ms=clock.ttft_ms, itl_ms=clock.itl_ms,
                            num_chunks=len(clock.shown_at_s), num_restarts=restarts, disconnected=disconnected)


def request_event_stream(http: Request, state: ApiState, *, request_id: str,
                         read_view: Callable[[], store.RequestView]) -> StreamingResponse:
    """GET /v1/requests/{id} as events: `status`, then `token` events ({text}) as the text is made, `restart`
    if its worker died and it runs again, and `end` (status, finish reason, usage, error). A reader that
    leaves cancels nothing: it only watched."""
    return StreamingResponse(_request_events(http, state, request_id, read_view), media_type="text/event-stream",
                             headers=HEADERS)


async def _request_events(http: Request, state: ApiState, request_id: str,
                          read_view: Callable[[], store.RequestView]) -> AsyncIterator[bytes]:
    view = await run_sync(read_view)
    yield sse({"id": request_id, "status": view.status.value}, event="status")
    shown, ended = "", view.status.is_terminal
    if not ended:
        async with _watch(http, state, request_id, read_view) as items:
            async for item in items:
                if item is None:
                    yield KEEP_ALIVE
                    continue
                if isinstance(item, Shown):
                    shown += item.text
                    yield sse({"text": item.text}, event="token")
                elif isinstance(item, Restarted):
                    yield sse({"attempt": item.attempt}, event="restart")
                elif isinstance(item, Diverged):
                    yield sse({"message": _diverged(request_id)}, event="error")
                    return
                elif isinstance(item, Ended):
                    ended = True
        if not ended:
            return
        view = await run_sync(read_view)
    # NOTE: a finished request's text from the store: all of it for a request whose stream was not kept (bulk
    # rows publish only their end; streams expire), the rest of it otherwise
    if view.text and len(view.text) > len(shown) and view.text.startswith(shown):
        yield sse({"text": view.text[len(shown):]}, event="token")
    usage = None if view.num_prompt_tokens is None else openai_usage(
        view.num_prompt_tokens, view.num_generated_tokens or 0, view.num_cached_tokens or 0)
    yield sse({"status": view.status.value, "finish_reason": view.finish_reason.value if view.finish_reason else None,
               "usage": usage, "error": view.error, "timings": view.timings_ms}, event="end")


def _error(message: str, *, code: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code, "param": None}}


def _diverged(request_id: str) -> str:
    return (f"the worker serving request {request_id} stopped, and the retried generation's text differs from the "
            f"text already streamed; the request goes on: read its result with GET /v1/requests/{request_id}")
