"""Routes that generate: POST /v1/requests (202 with an id) and GET /v1/requests/{id} (?wait=S, or as
server-sent events with Accept: text/event-stream), and the OpenAI-compatible POST /v1/completions and
POST /v1/chat/completions, which enqueue and wait, or stream (stream: true).

Thin: bodies are checked against servelab.request's bounds by servelab.protocol, against the cached catalog,
on the event loop; submissions that arrive together are written as one group (api/collector.py: one
transaction, then one Redis round trip, servelab.queue.submit), each answered once its row is committed and
its id added. An Idempotency-Key maps a retried submission to the request the first one made
(servelab.idempotency). A waiting call answers before the client's own read timeout, and its client leaving
cancels a request no worker has started. Blocking waits and database calls run in the thread pool (waits in
1 s slices), streams in the event loop (api/streaming.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from typing import Annotated, Any, Literal

from anyio.to_thread import run_sync
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.deps import ApiState, IdempotencyKey, State, Tenant
from api.errors import ApiError, TextCheckedRoute
from api.streaming import openai_stream, request_event_stream
from servelab.idempotency import HEADER, Fingerprint, KeyReused
from servelab.catalog import Catalog
from servelab.request import (MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOKEN_ID, FinishReason, SamplingParams,
                              bounded)
from servelab.protocol import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    Answer,
    ChatCompletionBody,
    Choice,
    ChunkWriter,
    CompletionBody,
    Rejection,
    Submission,
    chat_logprobs,
    checked_submission,
    find_config,
    is_tool_call,
    max_new_tokens,
    response_object,
    to_submission,
)
from servelab.queue.streams import wait_done
from servelab.queue.submit import Posted, cancel_for_client
from servelab.store.admission import NewRequest, QueueFull
from servelab.store.requests import RequestView, get_request_view
from servelab.store.db import session_scope
from servelab.store.models import RequestStatus, StreamKind
from servelab.telemetry import count_submission

router = APIRouter(route_class=TextCheckedRoute)
STATUS_OF_REJECTION = {"invalid": 400, "unknown_model": 404, "too_large": 413}
READ_TIMEOUT_HEADER = "x-stainless-read-timeout"  # what the openai client sends: its read timeout in seconds
CLIENT_TIMEOUT_MARGIN_S = 5.0  # the answer leaves this long before the client's read timeout (network, commits)
WAIT_SLICE_S = 1.0  # a waiting completion checks that its client is still there this often


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=10_000_000)


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int | None = bounded("max_new_tokens", None,
                                         description="default: the config's limit (decoding.max_new_tokens)")
    temperature: float = bounded("temperature", 0.0, description="0 is greedy")
    top_p: float = bounded("top_p", 1.0)
    top_k: int = bounded("top_k", 0)
    seed: int | None = bounded("seed", None)
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    presence_penalty: float = bounded("presence_penalty", 0.0)
    frequency_penalty: float = bounded("frequency_penalty", 0.0)
    logprobs: int | None = bounded("logprobs", None,
                                   description="alternatives per token: each token's log-probability and the k likeliest")
    ignore_eos: bool = False
    min_tokens: int = bounded("min_tokens", 0)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] = Field(default_factory=list,
                                                                            max_length=MAX_STOP_TOKEN_IDS)
    repetition_penalty: float = bounded("repetition_penalty", 1.0)
    min_p: float = bounded("min_p", 0.0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def params(self, num_new_tokens: int) -> SamplingParams:
        """NOTE: the fields are SamplingParams' own, by name and bound: one definition, checked once more there."""
        return SamplingParams(**{**self.model_dump(exclude={"max_new_tokens"}), "max_new_tokens": num_new_tokens,
                                 "stop": tuple(self.stop), "stop_token_ids": tuple(self.stop_token_ids)})


class RequestIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    config: str = Field(min_length=1, max_length=256, description="the serving config name")
    prompt: str | None = Field(default=None, max_length=10_000_000)
    messages: list[Message] | None = Field(default=None, min_length=1, max_length=1_000)
    sampling: Sampling = Sampling()
    priority: int = Field(default=0, ge=-100, le=100, description="stored with the request")
    stream: Literal["interactive", "bulk"] = "interactive"

    @model_validator(mode="after")
    def _prompt_xor_messages(self) -> RequestIn:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self

    def submission(self, catalog: Catalog, *, max_prompt_chars: int) -> Submission:
        """Checked against the config it names, with the same bounds and size limits as every other edge."""
        config = find_config(catalog, self.config)
        num_new_tokens = max_new_tokens(self.sampling.max_new_tokens, config, param="sampling.max_new_tokens")
        messages = [m.model_dump() for m in self.messages] if self.messages is not None else None
        return checked_submission(config, prompt=self.prompt, messages=messages, sampling=self.sampling.params(
            num_new_tokens), max_prompt_chars=max_prompt_chars)


class RequestAccepted(BaseModel):
    id: str
    object: Literal["request"] = "request"
    status: RequestStatus
    model: str


class RequestOut(BaseModel):
    id: str
    object: Literal["request"] = "request"
    status: RequestStatus
    model: str
    priority: int
    created_at: datetime
    started_at: datetime | None
    first_token_at: datetime | None
    finished_at: datetime | None
    finish_reason: FinishReason | None
    error: str | None
    result: dict[str, Any] | None = Field(description="text, num_prompt_tokens, num_generated_tokens, "
                                                      "num_cached_tokens (prompt tokens served from the prefix "
                                                      "cache); logprobs (chat's content list) when asked")
    timings: dict[str, float | None] | None = Field(description="queue_ms, ttft_ms, tpot_ms, e2e_ms")

    @classmethod
    def of(cls, v: RequestView) -> RequestOut:
        result = None if v.text is None else {"text": v.text, "num_prompt_tokens": v.num_prompt_tokens,
                                              "num_generated_tokens": v.num_generated_tokens,
                                              "num_cached_tokens": v.num_cached_tokens or 0}
        if result is not None and v.logprobs is not None:
            result["logprobs"] = chat_logprobs(Choice.of_stored(v.text, v.finish_reason, v.num_generated_tokens,
                                                                v.logprobs).logprobs)["content"]
        return cls(id=v.id, status=v.status, model=v.serving_config_name, priority=v.priority,
                   created_at=v.enqueued_at, started_at=v.started_at, first_token_at=v.first_token_at,
                   finished_at=v.finished_at, finish_reason=v.finish_reason, error=v.error, result=result,
                   timings=v.timings_ms)


async def check(state: ApiState, body: CompletionBody | ChatCompletionBody | RequestIn) -> Submission:
    """The body against the catalog: the cached one on the event loop, or one loaded in the thread pool when it
    is old or lacks the name asked for."""
    name = body.config if isinstance(body, RequestIn) else body.model
    catalog = state.catalogs.fresh()
    if catalog is None or name not in catalog.configs:
        catalog = await run_sync(state.catalogs.with_name, name)
    max_prompt_chars = state.settings.max_prompt_chars
    try:
        if isinstance(body, RequestIn):
            return body.submission(catalog, max_prompt_chars=max_prompt_chars)
        return to_submission(body, catalog=catalog, max_prompt_chars=max_prompt_chars)
    except Rejection as exc:
        known = exc.kind != "unknown_model" and name in catalog.configs  # NOTE: labels only known names
        count_submission(endpoint=_endpoint_of(body), model_name=name if known else "", outcome=exc.code)
        raise ApiError(STATUS_OF_REJECTION[exc.kind], str(exc), code=exc.code, param=exc.param) from None


def _endpoint_of(body: CompletionBody | ChatCompletionBody | RequestIn) -> str:
    return {RequestIn: "/v1/requests", CompletionBody: COMPLETIONS}.get(type(body), CHAT_COMPLETIONS)


@dataclass(frozen=True)
class Submitted:
    request_ids: tuple[str, ...]  # one per choice (n), in order
    is_keyed: bool  # sent with an Idempotency-Key: its client may come back for it
    replayed: bool = False  # the key named an earlier submission: this call joins that one's request

    @property
    def request_id(self) -> str:
        """The first choice's: the request's id in answers and headers."""
        return self.request_ids[0]

    @property
    def cancel_on_leave(self) -> bool:
        """NOTE: a keyed request outlives its client's connection, kept for the retry the key announces."""
        return not self.is_keyed

    @property
    def headers(self) -> dict[str, str]:
        """x-request-id: the openai client reads it as `response._request_id` and `error.request_id`."""
        return {"x-request-id": self.request_id, **({"Idempotent-Replayed": "true"} if self.replayed else {})}


async def submit(state: ApiState, tenant: str, submission: Submission, *, endpoint: str,
                 kind: StreamKind = StreamKind.INTERACTIVE, priority: int = 0, key: str | None = None,
                 fingerprint: Fingerprint | None = None) -> Submitted:
    """Admit a request (n choices: n rows, enqueued together, so a worker reads them into one batch), or (key
    given) find the one an earlier submission with this key made; answered once its rows are committed and their
    ids are in the stream, with the group they were written in."""
    request = NewRequest(tenant, submission.serving_config_name, kind, submission.prompt, submission.messages,
                         submission.sampling, priority, num_choices=submission.num_choices)
    outcome = await state.submissions.submit(Posted(request, key, fingerprint))
    counted = partial(count_submission, endpoint=endpoint, model_name=submission.serving_config_name)
    if isinstance(outcome, QueueFull):
        counted(outcome="too_many_queued_requests")
        raise ApiError(429, str(outcome), code="too_many_queued_requests")
    if isinstance(outcome, KeyReused):
        counted(outcome="idempotency_key_reused")
        raise ApiError(422, str(outcome), code="idempotency_key_reused", param=HEADER)
    if isinstance(outcome, Exception):
        raise outcome
    counted(outcome="replayed" if outcome.replayed else "accepted")
    return Submitted(outcome.request_ids, is_keyed=key is not None, replayed=outcome.replayed)


def view(state: ApiState, tenant: str, request_id: str) -> RequestView:
    with session_scope(state.runtime.sessions) as session:
        found = get_request_view(session, request_id=request_id, tenant=tenant)
    if found is None:
        raise ApiError(404, f"no request {request_id!r}", code="request_not_found", param="id")
    return found


def choice_views(state: ApiState, tenant: str, request_ids: tuple[str, ...]) -> list[RequestView]:
    """A request's choices as they are now, in order (one database session)."""
    with session_scope(state.runtime.sessions) as session:
        found = [get_request_view(session, request_id=i, tenant=tenant) for i in request_ids]
    missing = [i for i, v in zip(request_ids, found) if v is None]
    if missing:
        raise ApiError(404, f"no request {missing[0]!r}", code="request_not_found", param="id")
    return found


def wait_for(state: ApiState, tenant: str, request_id: str, timeout_s: float) -> RequestView:
    found = view(state, tenant, request_id)
    if not found.status.is_terminal and timeout_s > 0:
        wait_done(state.runtime.redis, prefix=state.settings.key_prefix, request_id=request_id, timeout_s=timeout_s)
        found = view(state, tenant, request_id)
    return found


@router.post("/v1/requests", status_code=202, response_model=RequestAccepted, tags=["requests"])
async def create_request(body: RequestIn, state: State, tenant: Tenant, response: Response,
                         key: IdempotencyKey = None) -> RequestAccepted:
    """Queue a request and answer at once with its id; read it with GET /v1/requests/{id}."""
    submission = await check(state, body)
    submitted = await submit(state, tenant, submission, endpoint="/v1/requests", kind=StreamKind(body.stream),
                             priority=body.priority, **_keyed(key, "/v1/requests", body))
    response.headers.update(submitted.headers)
    status = RequestStatus.QUEUED
    if submitted.replayed:
        status = (await run_sync(view, state, tenant, submitted.request_id)).status
    return RequestAccepted(id=submitted.request_id, status=status, model=submission.serving_config_name)


@router.get("/v1/requests/{request_id}", response_model=RequestOut, tags=["requests"])
async def read_request(request_id: str, http: Request, state: State, tenant: Tenant,
                       wait: float = Query(default=0.0, ge=0.0, le=3600.0,
                                           description="seconds to wait for the result")) -> RequestOut | StreamingResponse:
    """Status, result and timings; with ?wait=S, waits up to S seconds (capped by the server) for the end.
    With `Accept: text/event-stream`: the request as events (status, token..., end) while it is made."""
    if "text/event-stream" in http.headers.get("accept", ""):
        await run_sync(view, state, tenant, request_id)  # NOTE: a 404 before the stream starts
        return request_event_stream(http, state, request_id=request_id,
                                    read_view=partial(view, state, tenant, request_id))
    return RequestOut.of(await run_sync(wait_for, state, tenant, request_id, min(wait, state.settings.max_wait_s)))


def _keyed(key: str | None, endpoint: str, body: BaseModel) -> dict[str, Any]:
    """submit's key arguments: none, or the key with the body's fingerprint."""
    if key is None:
        return {}
    return {"key": key, "fingerprint": Fingerprint.of(endpoint, body.model_dump(mode="json"))}


def wait_limit_s(max_wait_s: float, client_read_timeout: str | None) -> float:
    """How long a completion call waits: the server's limit, or less, so that the answer (the result, or the 504
    that says where to read it) reaches a client before its own read timeout. NOTE: a client that times out
    retries (the openai client twice, sending its read timeout as x-stainless-read-timeout); a retry without an
    Idempotency-Key would be a second request."""
    try:
        timeout_s = float(client_read_timeout or "")
    except ValueError:
        return max_wait_s
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        return max_wait_s
    return min(max_wait_s, max(timeout_s - CLIENT_TIMEOUT_MARGIN_S, timeout_s / 2))


async def _wait_or_leave(http: Request, state: ApiState, submitted: Submitted,
                         read_views: Callable[[], list[RequestView]], wait_s: float) -> list[RequestView] | None:
    """The request's choices once all have ended, or as they are at the wait limit; None when the client left
    first. Requests no worker has started are cancelled then (they never start), unless sent with an
    Idempotency-Key; running ones go on, and their results are kept (GET /v1/requests/{id}, or the same key)."""
    deadline = time.monotonic() + wait_s
    found = await run_sync(read_views)
    while (waiting := [v for v in found if not v.status.is_terminal]) and (
            remaining_s := deadline - time.monotonic()) > 0:
        if await run_sync(partial(wait_done, state.runtime.redis, prefix=state.settings.key_prefix,
                                  request_id=waiting[0].id, timeout_s=min(WAIT_SLICE_S, remaining_s))):
            found = await run_sync(read_views)
            continue
        if await http.is_disconnected():
            if submitted.cancel_on_leave:
                for request_id in submitted.request_ids:  # NOTE: every choice; started ones go on
                    await run_sync(partial(cancel_for_client, sessions=state.runtime.sessions,
                                           redis_client=state.runtime.redis, prefix=state.settings.key_prefix,
                                           request_id=request_id, now=datetime.now(UTC), if_queued=True))
            return None
    return found


def _answer(views: list[RequestView], submitted: Submitted, wait_s: float) -> Answer:
    """The choices' answer; a choice that failed fails the call (400), one still unfinished makes it a 504."""
    first = views[0]
    ended = [v for v in views if v.status.is_terminal and (v.status is not RequestStatus.SUCCEEDED or v.text is None)]
    if ended:
        raise ApiError(400, ended[0].error or f"the request ended {ended[0].status.value}", code="request_failed",
                       headers=submitted.headers)
    if all(v.status.is_terminal for v in views):
        return Answer(first.id, first.serving_config_name, int(max(v.finished_at for v in views).timestamp()),
                      first.num_prompt_tokens, tuple(Choice.of_stored(v.text, v.finish_reason, v.num_generated_tokens,
                                                                      v.logprobs) for v in views),
                      first.num_cached_tokens or 0)
    late = next(v for v in views if not v.status.is_terminal)
    where = (f"GET /v1/requests/{first.id}" if len(views) == 1 else
             "GET /v1/requests/{id} for each of its choices: " + ", ".join(v.id for v in views))
    # NOTE: 504 with x-should-retry: false, which OpenAI's clients obey: a retry would be a second request
    raise ApiError(504, f"request {first.id} is still {late.status.value} after {wait_s:g} s and goes on; read it "
                   f"with {where}, or send the same body with the same {HEADER} to wait again",
                   code="timeout", headers={**submitted.headers, "x-should-retry": "false"})


async def _complete(http: Request, state: ApiState, tenant: str, body: CompletionBody | ChatCompletionBody,
                    endpoint: str, key: str | None) -> Response:
    """Queue the body's request (n choices: n rows, enqueued together), or join the one its Idempotency-Key made,
    then answer when every choice is done, or stream it."""
    arrived_s = getattr(http.state, "arrived_s", None) or time.time()  # NOTE: api.app.StampArrival's
    submission = await check(state, body)
    submitted = await submit(state, tenant, submission, endpoint=endpoint, **_keyed(key, endpoint, body))
    read_view = partial(view, state, tenant, submitted.request_id)
    if body.stream:
        writer = ChunkWriter(endpoint, submitted.request_id, submission.serving_config_name, int(arrived_s),
                             body.include_usage, body.continuous_usage,
                             tool_calls=is_tool_call(submission.sampling.constraint))
        return openai_stream(http, state, writer=writer, arrived_s=arrived_s, read_view=read_view,
                             cancel_on_leave=submitted.cancel_on_leave, headers=submitted.headers)
    wait_s = wait_limit_s(state.settings.max_wait_s, http.headers.get(READ_TIMEOUT_HEADER))
    read_views = partial(choice_views, state, tenant, submitted.request_ids)
    done = await _wait_or_leave(http, state, submitted, read_views, wait_s)
    if done is None:
        return Response(status_code=499)  # NOTE: nginx's "client closed request": nobody reads it
    answer = replace(_answer(done, submitted, wait_s), tool_calls=is_tool_call(submission.sampling.constraint))
    return JSONResponse(response_object(endpoint, answer), headers=submitted.headers)


@router.post("/v1/completions", response_model=None, tags=["openai"])
async def create_completion(body: CompletionBody, http: Request, state: State, tenant: Tenant,
                            key: IdempotencyKey = None) -> Response:
    """OpenAI completions: queued like any request, answered when done, or streamed as server-sent events
    with stream: true (model = serving config name)."""
    return await _complete(http, state, tenant, body, COMPLETIONS, key)


@router.post("/v1/chat/completions", response_model=None, tags=["openai"])
async def create_chat_completion(body: ChatCompletionBody, http: Request, state: State, tenant: Tenant,
                                 key: IdempotencyKey = None) -> Response:
    """OpenAI chat completions: queued like any request, answered when done, or streamed as server-sent events
    with stream: true (model = serving config name)."""
    return await _complete(http, state, tenant, body, CHAT_COMPLETIONS, key)
