"""Redis Streams for request ids: one interactive and one bulk stream per serving config.

Knows the keys, the consumer group, reading new and own-pending entries, taking over entries idle
past a limit, renewing a batch's claim, acknowledging (and deleting) finished entries, the
dead-letter stream, and done-notifications for waiting callers. Carries ids only: the request row
in Postgres is the truth, and is committed before its id is added here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from servelab.queue.tokens import add_end_events
from servelab.request import StreamKind

GROUP = "workers"
NOTIFY_TTL_S = 600
# KEYS: the stream, the set of enqueued ids; ARGV: request ids. Atomic, as the MULTI pipeline it replaces was.
# NOTE: one script per stream: its group made where missing (pcall: BUSYGROUP when it exists), then the ids as
# the script's arguments (the client packs one command and reads one reply: for a 5,000-id slice about 6 us an
# id, against 30 for an XADD and a SADD each through a pipeline), and the ids into the set that lets the reaper
# find rows whose entry was lost.
ENQUEUE_SCRIPT = """
redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
for i = 2, #ARGV do
    redis.call('XADD', KEYS[1], '*', 'request_id', ARGV[i])
end
for i = 2, #ARGV, 1000 do
    redis.call('SADD', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
return #ARGV - 1
"""

@dataclass(frozen=True)
class Entry:
    stream: str
    entry_id: str
    request_id: str

    @property
    def is_interactive(self) -> bool:
        return self.stream.endswith(":" + StreamKind.INTERACTIVE.value)

    @property
    def key(self) -> str:
        """Unique among the config's streams: ids are per stream, and two streams can mint the same one."""
        return f"{self.stream} {self.entry_id}"


class RequestStreams:
    """The streams of one serving config, under one key prefix."""

    def __init__(self, client: redis.Redis, *, prefix: str, config_name: str) -> None:
        self.client = client
        self.prefix = prefix
        self.config_name = config_name
        # NOTE: interactive first: XREADGROUP answers from every stream it is given, in this order.
        self.keys = [stream_key(prefix, config_name, kind) for kind in (StreamKind.INTERACTIVE, StreamKind.BULK)]
        self.dead_letter_key = f"{prefix}:dead:{config_name}"
        self.enqueued_key = enqueued_key(prefix, config_name)

    def ensure_groups(self) -> None:
        for key in self.keys:
            try:
                self.client.xgroup_create(key, GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def enqueue(self, request_id: str, kind: StreamKind) -> int:
        return self.enqueue_many([request_id], kind)

    def enqueue_many(self, request_ids: list[str], kind: StreamKind) -> int:
        """Committed request ids onto one stream, in order, in one round trip; -> how many were added."""
        return enqueue_all(self.client, prefix=self.prefix,
                           entries=[(request_id, self.config_name, kind) for request_id in request_ids])

    def read_new(self, consumer: str, *, count: int, block_ms: int | None,
                 interactive_only: bool = False) -> list[Entry]:
        """Entries never delivered to the group, up to count per stream; block_ms None: do not wait."""
        return self._read(consumer, ">", count=count, block_ms=block_ms, keys=self.keys[:1] if interactive_only else None)

    def read_own_pending(self, consumer: str, *, count: int = 10_000) -> list[Entry]:
        """Entries delivered to this consumer name and never acknowledged: a restart takes them back."""
        return self._read(consumer, "0", count=count, block_ms=None)

    def _read(self, consumer: str, start: str, *, count: int, block_ms: int | None,
              keys: list[str] | None = None) -> list[Entry]:
        try:
            reply = self.client.xreadgroup(GROUP, consumer, {k: start for k in keys or self.keys}, count=count,
                                           block=block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_groups()  # Redis restarted empty: recreate, the reaper re-adds lost ids
            return []
        return [_entry(stream, entry_id, fields) for stream, entries in reply or [] for entry_id, fields in entries
                if fields]

    def claim_idle(self, consumer: str, *, min_idle_ms: int, count: int) -> list[Entry]:
        """Take over entries another consumer left idle longer than min_idle_ms (it died, or hung)."""
        taken: list[Entry] = []
        for key in self.keys:
            try:
                _next, entries, *_deleted = self.client.xautoclaim(key, GROUP, consumer, min_idle_ms, "0-0", count=count)
            except redis.ResponseError:
                self.ensure_groups()
                continue
            taken += [_entry(key, entry_id, fields) for entry_id, fields in entries if fields]
        return taken

    def renew(self, consumer: str, entries: list[Entry]) -> None:
        """Reset the idle time of entries this consumer is serving, so nobody takes them over."""
        for key in {e.stream for e in entries}:
            ids = [e.entry_id for e in entries if e.stream == key]
            # NOTE: JUSTID resets idle time without bumping the delivery counter.
            self.client.xclaim(key, GROUP, consumer, 0, ids, justid=True)

    def ack(self, entries: list[Entry]) -> None:
        if not entries:
            return
        pipe = self.client.pipeline(transaction=True)
        for e in entries:
            pipe.xack(e.stream, GROUP, e.entry_id)
            pipe.xdel(e.stream, e.entry_id)  # NOTE: acknowledged entries are done: keep streams short
        pipe.srem(self.enqueued_key, *{e.request_id for e in entries})
        pipe.execute()

    def dead_letter(self, entry: Entry, reason: str) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.dead_letter_key, {"request_id": entry.request_id, "reason": reason, "stream": entry.stream})
        pipe.xack(entry.stream, GROUP, entry.entry_id)
        pipe.xdel(entry.stream, entry.entry_id)
        pipe.srem(self.enqueued_key, entry.request_id)
        pipe.execute()

    def is_enqueued(self, request_ids: list[str]) -> list[bool]:
        if not request_ids:
            return []
        return [bool(v) for v in self.client.smismember(self.enqueued_key, request_ids)]

    def depth(self) -> dict[str, int]:
        """Entries not yet acknowledged per stream (waiting or being served)."""
        return {key.rsplit(":", 1)[1]: int(self.client.xlen(key)) for key in self.keys}


def enqueue_all(client: redis.Redis, *, prefix: str, entries: Sequence[tuple[str, str, StreamKind]]) -> int:
    """Committed requests (request id, config name, stream kind) onto their streams, in order within each, with
    the groups made where missing, in one round trip; -> how many were added."""
    by_stream: dict[tuple[str, StreamKind], list[str]] = {}
    for request_id, config, kind in entries:
        by_stream.setdefault((config, kind), []).append(request_id)
    if not by_stream:
        return 0
    pipe = client.pipeline(transaction=True)
    for (config, kind), request_ids in by_stream.items():
        pipe.eval(ENQUEUE_SCRIPT, 2, stream_key(prefix, config, kind), enqueued_key(prefix, config), GROUP, *request_ids)
    return sum(pipe.execute())


def stream_key(prefix: str, config_name: str, kind: StreamKind) -> str:
    return f"{prefix}:stream:{config_name}:{kind.value}"


def enqueued_key(prefix: str, config_name: str) -> str:
    return f"{prefix}:enqueued:{config_name}"


def done_key(prefix: str, request_id: str) -> str:
    return f"{prefix}:done:{request_id}"


def notify_done(client: redis.Redis, *, prefix: str, ends: dict[str, dict[str, Any]]) -> None:
    """Wake callers waiting on these requests (a list per request, so a late waiter still sees it) and end
    their token streams with each one's outcome (`end_event`), in one round trip."""
    if not ends:
        return
    pipe = client.pipeline(transaction=False)
    for request_id in ends:
        pipe.rpush(done_key(prefix, request_id), "1")
        pipe.expire(done_key(prefix, request_id), NOTIFY_TTL_S)
    add_end_events(pipe, prefix=prefix, ends=ends)
    pipe.execute()


def end_event(status: str, *, finish_reason: str | None = None, prompt_tokens: int | None = None,
              completion_tokens: int | None = None, cached_tokens: int | None = None,
              error: str | None = None) -> dict[str, Any]:
    """cached_tokens: of the prompt tokens, those served from the prefix cache (the stream's final usage)."""
    return {"status": status, "finish_reason": finish_reason, "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens, "cached_tokens": cached_tokens, "error": error}


def wait_done(client: redis.Redis, *, prefix: str, request_id: str, timeout_s: float) -> bool:
    """Block until the request's done-notification arrives, or the timeout; leaves it for other waiters."""
    key = done_key(prefix, request_id)
    if client.llen(key):
        return True
    # NOTE: BLMOVE onto the same list peeks without consuming; block in 1 s slices (client socket timeout).
    remaining = timeout_s
    while remaining > 0:
        step = min(1.0, remaining)
        if client.blmove(key, key, step, "LEFT", "RIGHT") is not None:
            return True
        remaining -= step
    return False


def _entry(stream, entry_id, fields) -> Entry:
    return Entry(_text(stream), _text(entry_id), _text(fields.get(b"request_id", fields.get("request_id"))))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def stream_depths(client: redis.Redis, *, prefix: str, config_names: list[str]) -> dict[str, dict[str, int]]:
    """config name -> stream kind -> entries not yet acknowledged, for the named configs and any stream found.

    NOTE: SCAN finds streams of configs with no request rows (a config whose rows were cleaned up still has
    a stream); the names given cover configs whose stream has not been created yet.
    """
    found = {key.decode() if isinstance(key, bytes) else key
             for key in client.scan_iter(match=f"{prefix}:stream:*", count=1000)}
    names = set(config_names) | {k[len(prefix) + len(":stream:"):].rsplit(":", 1)[0] for k in found}
    return {name: RequestStreams(client, prefix=prefix, config_name=name).depth() for name in sorted(names)}
