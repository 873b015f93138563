"""Token streams: each request's text as it is made, in a bounded, expiring Redis stream of its own.

The worker writes, per engine step and for all its streamed rows at once (one pipelined round trip): a
`start` event when a row starts (again after a retry or a preemption), `text` events with the text each row
released, and reads the rows' cancel flags in the same trip. Every terminal notification adds an `end` event
(status, finish reason, usage), for streamed and unstreamed requests alike. A reader replays the stream from
its start (`0`), so a late reader misses nothing until the stream expires (TOKENS_TTL_S after its last event).

`Relay` turns the events into what a client may be shown: a restarted generation (the worker died and the
request was retried, or it was preempted) re-sends its text from the start, and the relay passes on only
what goes beyond the text already shown; if the retried text differs from it (sampling without a seed, or a
float tie broken the other way), the stream ends with an error, since shown text cannot be taken back. Each
text event says where its piece begins in its generation, so a piece sent twice (a retried round trip) is
dropped and a lost one is noticed.
Knows keys and fields; does not know HTTP or the engine.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import redis

TOKENS_TTL_S = 600  # a finished request's stream can be replayed this long
TOKENS_MAXLEN = 20_000  # events per stream at most (a generation sends at most one per token, plus start and end)
CANCEL_TTL_S = 3_600


def tokens_key(prefix: str, request_id: str) -> str:
    return f"{prefix}:tokens:{request_id}"


def cancel_key(prefix: str, request_id: str) -> str:
    return f"{prefix}:cancel:{request_id}"


@dataclass(frozen=True)
class StepEvents:
    """What one worker step publishes: rows that started, the text rows released; and whose cancel flags to read."""

    started: tuple[tuple[str, int, int], ...] = ()  # (request id, attempt: the row's started executions, prompt tokens)
    # (request id, where the piece begins in its generation, piece, tokens its generation has made so far)
    texts: tuple[tuple[str, int, str, int], ...] = ()
    watched: tuple[str, ...] = ()  # request ids whose client may cancel them

    @property
    def is_empty(self) -> bool:
        return not (self.started or self.texts or self.watched)


def publish_step(client: redis.Redis, *, prefix: str, events: StepEvents) -> list[str]:
    """One round trip: the step's events appended, the watched rows' cancel flags read; -> cancelled ids."""
    if events.is_empty:
        return []
    pipe = client.pipeline(transaction=False)
    touched: set[str] = set()
    for request_id, attempt, num_prompt_tokens in events.started:
        _add(pipe, prefix, request_id, {"kind": "start", "attempt": attempt, "prompt_tokens": num_prompt_tokens})
        touched.add(request_id)
    for request_id, at, piece, num_tokens in events.texts:
        _add(pipe, prefix, request_id, {"kind": "text", "text": piece, "at": at, "tokens": num_tokens})
        touched.add(request_id)
    for request_id in touched:
        pipe.expire(tokens_key(prefix, request_id), TOKENS_TTL_S)
    if events.watched:
        pipe.mget([cancel_key(prefix, i) for i in events.watched])
    replies = pipe.execute()
    if not events.watched:
        return []
    return [i for i, flag in zip(events.watched, replies[-1]) if flag is not None]


def add_end_events(pipe: redis.client.Pipeline, *, prefix: str, ends: dict[str, dict[str, Any]]) -> None:
    """Queue each request's `end` event on a pipeline (the caller's notification round trip)."""
    for request_id, end in ends.items():
        _add(pipe, prefix, request_id, {"kind": "end", **end})
        pipe.expire(tokens_key(prefix, request_id), TOKENS_TTL_S)


def request_cancel(client: redis.Redis, *, prefix: str, request_id: str) -> None:
    """Flag a request whose client left; the worker serving it drops its row at its next step."""
    client.set(cancel_key(prefix, request_id), "1", ex=CANCEL_TTL_S)


def _add(pipe: redis.client.Pipeline, prefix: str, request_id: str, fields: dict[str, Any]) -> None:
    pipe.xadd(tokens_key(prefix, request_id), {"e": json.dumps(fields, separators=(",", ":"))},
              maxlen=TOKENS_MAXLEN, approximate=True)


def decode_event(fields: dict) -> dict[str, Any]:
    raw = fields.get(b"e", fields.get("e"))
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


def read_to_end(client: redis.Redis, *, prefix: str, request_id: str) -> tuple[float, float]:
    """Read a request's token stream from its start, blocking, as a relay does; -> the perf_counter times at
    which its first text and its end were read."""
    key, last, first_text = tokens_key(prefix, request_id), "0", None
    while True:
        for _key, entries in client.xread({key: last}, count=256, block=1000) or []:
            for entry_id, fields in entries:
                last, event, now = entry_id, decode_event(fields), time.perf_counter()
                if event["kind"] == "text" and first_text is None:
                    first_text = now
                if event["kind"] == "end":
                    return (first_text or now), now


# --- the reader's side ---


@dataclass(frozen=True)
class Shown:
    text: str  # new text to show
    prompt_tokens: int | None = None  # the usage so far, where the worker sent it (vLLM's continuous usage)
    completion_tokens: int | None = None


@dataclass(frozen=True)
class Restarted:
    attempt: int  # the generation started again; what was shown stays valid while the new text agrees


@dataclass(frozen=True)
class Ended:
    status: str  # succeeded | failed | cancelled
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    error: str | None
    cached_tokens: int | None = None  # of the prompt tokens, served from the prefix cache (an older worker: None)


@dataclass(frozen=True)
class Diverged:
    """A restarted generation's text differs from the text already shown, which cannot be taken back."""


RelayItem = Shown | Restarted | Ended | Diverged


@dataclass
class Relay:
    """A stream's events -> what a client is shown: text once, in order, across restarts."""

    shown: str = ""
    _generation: str = ""  # the current generation's text
    _starts: int = 0
    _prompt_tokens: int | None = None
    done: bool = False

    def feed(self, events: Iterable[dict[str, Any]]) -> list[RelayItem]:
        items: list[RelayItem] = []
        for event in events:
            if self.done:
                break
            items += self._one(event)
        return items

    def _one(self, event: dict[str, Any]) -> list[RelayItem]:
        kind = event.get("kind")
        if kind == "start":
            self._starts += 1
            self._generation = ""
            self._prompt_tokens = event.get("prompt_tokens")
            return [Restarted(int(event.get("attempt", 0)))] if self._starts > 1 else []
        if kind == "text":
            at, piece = int(event.get("at", len(self._generation))), event["text"]
            if at + len(piece) <= len(self._generation):
                return []  # NOTE: sent twice (a round trip retried after Redis had run it)
            if at > len(self._generation):
                self.done = True
                return [Diverged()]  # NOTE: text of this generation was lost: what follows cannot be placed
            self._generation += piece[len(self._generation) - at:]
            if len(self._generation) <= len(self.shown):
                if self.shown.startswith(self._generation):
                    return []
            elif self._generation.startswith(self.shown):
                piece, self.shown = self._generation[len(self.shown):], self._generation
                return [Shown(piece, self._prompt_tokens, event.get("tokens"))]
            self.done = True
            return [Diverged()]
        if kind == "end":
            self.done = True
            if self._starts > 1 and len(self._generation) < len(self.shown) and event.get("status") == "succeeded":
                return [Diverged()]  # NOTE: the retried answer is shorter than the text already shown
            return [Ended(str(event.get("status")), event.get("finish_reason"), event.get("prompt_tokens"),
                          event.get("completion_tokens"), event.get("error"), event.get("cached_tokens"))]
        return []


@dataclass
class StreamClock:
    """When each piece was shown: the user-side TTFT and inter-token latencies, from the request's arrival."""

    arrived_s: float
    shown_at_s: list[float] = field(default_factory=list)

    def mark(self, now_s: float) -> None:
        self.shown_at_s.append(now_s)

    @property
    def ttft_ms(self) -> float | None:
        return (self.shown_at_s[0] - self.arrived_s) * 1e3 if self.shown_at_s else None

    @property
    def itl_ms(self) -> list[float]:
        t = self.shown_at_s
        return [(b - a) * 1e3 for a, b in zip(t, t[1:])]
