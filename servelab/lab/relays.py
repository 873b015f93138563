"""Relays for benchmarks: a process that reads requests' token streams to their ends, as the API does.

Imports no torch, so a spawned process starts in a fraction of a second.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import redis

from servelab.queue.tokens import read_to_end


def read_all(redis_url: str, prefix: str, request_ids: list[str], ready) -> None:
    """One thread per request, each reading its stream to its `end`; `ready` is set once the readers start."""
    client = redis.Redis.from_url(redis_url)
    with ThreadPoolExecutor(max_workers=len(request_ids)) as pool:
        ready.set()
        list(pool.map(lambda i: read_to_end(client, prefix=prefix, request_id=i), request_ids))
