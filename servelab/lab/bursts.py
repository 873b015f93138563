"""A burst of requests through the real queue: submitted in one go, awaited together, read back from the store.

Knows how to commit a burst's rows in one transaction and add their ids with one pipelined XADD, wait for
every request's done-notification from one thread (a request's latency is when its notification arrived), and
read back from PostgreSQL the tokens made, which worker served each request and how often each started.
NOTE: one client thread, so the bench process takes no CPU from the worker processes while they serve (in a
deployment the clients are other processes, often other hosts). Does not start workers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from servelab.queue.streams import RequestStreams, done_key
from servelab.request import SamplingParams
from servelab.runtime import Runtime
from servelab.store import requests as store
from servelab.store.db import session_scope
from servelab.store.models import StreamKind

FILLER = (
    "In the quiet town by the river, the baker rose before dawn to light the ovens, "
    "and the smell of fresh bread drifted down the narrow streets where the children played. "
)


class BurstError(RuntimeError):
    """A burst that did not finish in time; the message says how many requests were left."""


@dataclass(frozen=True)
class BurstOutcome:
    """One burst through the queue: throughput, each request's latency, who served it, how often each ran."""

    num_requests: int
    output_tokens: int
    wall_s: float  # from the first row's commit to the last done-notification
    latencies_ms: tuple[float, ...]
    served_by: dict[str, int]  # worker name -> requests it finished
    num_run_twice: int  # requests started more than once (a take-over, a crash) or with other than one result

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def filler_prompt(num_words: int) -> str:
    """A prompt of about num_words tokens (common English words are about a token each)."""
    words = (FILLER * (1 + num_words // 30)).split()
    return " ".join(words[:num_words])


def send_burst(runtime: Runtime, streams: RequestStreams, *, prompts: Sequence[str], sampling: SamplingParams,
               kind: StreamKind = StreamKind.BULK, timeout_s: float = 3600.0) -> BurstOutcome:
    """Every prompt at once onto the config's stream; wait for all; read back what was made and by whom."""
    started = time.perf_counter()
    with session_scope(runtime.sessions) as session:
        ids = [store.create_request(session, serving_config_name=streams.config_name, stream=kind, prompt=p,
                                    sampling=sampling) for p in prompts]
    streams.enqueue_many(ids, kind)  # NOTE: after the commit: an entry never points at a missing row
    done_at = wait_all_done(streams.client, prefix=streams.prefix, request_ids=ids, timeout_s=timeout_s)
    wall_s = max(done_at.values()) - started
    with session_scope(runtime.sessions) as session:
        runs = store.executions(session, ids=ids)
    served_by: dict[str, int] = {}
    for run in runs:
        served_by[run.worker_name or "?"] = served_by.get(run.worker_name or "?", 0) + 1
    return BurstOutcome(
        num_requests=len(ids), output_tokens=sum(r.num_generated_tokens for r in runs), wall_s=wall_s,
        latencies_ms=tuple((done_at[i] - started) * 1e3 for i in ids), served_by=served_by,
        num_run_twice=sum(r.num_attempts != 1 or r.num_results != 1 for r in runs) + len(ids) - len(runs),
    )


def wait_all_done(client: redis.Redis, *, prefix: str, request_ids: Sequence[str], timeout_s: float) -> dict[str, float]:
    """-> request id -> time.perf_counter() when its done-notification was seen, waiting on all at once.

    NOTE: one BLPOP over every outstanding key, in 1 s slices (the client's socket timeout); it consumes the
    notification, which is fine for a bench's own requests (no other waiter)."""
    outstanding = {done_key(prefix, i): i for i in request_ids}
    done_at: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while outstanding:
        if time.monotonic() > deadline:
            raise BurstError(f"{len(outstanding)} of {len(request_ids)} requests did not finish within {timeout_s:.0f} s")
        popped = client.blpop(list(outstanding), timeout=1)
        if popped is None:
            continue
        key = popped[0].decode() if isinstance(popped[0], bytes) else popped[0]
        done_at[outstanding.pop(key)] = time.perf_counter()
    return done_at
