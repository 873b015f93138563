"""Submissions that arrive together leave together: one group, one transaction, one round trip to Redis.

Knows asyncio: a submission joins the pending group of its event loop and awaits its own outcome. The first
of a group waits at most max_wait_ms for company; while a group is being written the next one gathers, and
goes as soon as the first is done (group commit). Does not know what a flush does (servelab.queue.submit).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from anyio.to_thread import run_sync

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Pending(Generic[T, R]):
    items: list[tuple[T, asyncio.Future[R]]] = field(default_factory=list)
    first_at_s: float = 0.0  # when the oldest pending item arrived (monotonic)
    flusher: asyncio.Task | None = None


@dataclass
class GroupStats:
    """What the collector has done, for tests and the bench: groups written and the items in them."""

    num_groups: int = 0
    num_items: int = 0
    max_group_size: int = 0


class Collector(Generic[T, R]):
    """Groups items for `flush` (blocking: run in a worker thread), which returns one outcome per item, in order.

    NOTE: one pending group per event loop (uvicorn runs one; a test client may start one per request), and
    one flush at a time per loop: a flush's duration is what the next group gathers for.
    """

    def __init__(self, flush: Callable[[Sequence[T]], list[R]], *, max_wait_ms: float, max_group_size: int) -> None:
        assert max_group_size >= 1 and max_wait_ms >= 0, "a group holds at least one item and waits no less than 0"
        self.flush = flush
        self.max_wait_s = max_wait_ms / 1e3
        self.max_group_size = max_group_size
        self.stats = GroupStats()
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Pending[T, R]] = (
            weakref.WeakKeyDictionary())

    async def submit(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        pending = self._by_loop.setdefault(loop, _Pending())
        if not pending.items:
            pending.first_at_s = time.monotonic()
        future: asyncio.Future[R] = loop.create_future()
        pending.items.append((item, future))
        if pending.flusher is None or pending.flusher.done():
            pending.flusher = loop.create_task(self._run(pending))
        return await future

    async def _run(self, pending: _Pending[T, R]) -> None:
        while pending.items:
            wait_s = self.max_wait_s - (time.monotonic() - pending.first_at_s)
            if len(pending.items) < self.max_group_size and wait_s > 0:
                await asyncio.sleep(wait_s)  # NOTE: only the first of a group waits; the rest arrive meanwhile
            group, pending.items = pending.items[:self.max_group_size], pending.items[self.max_group_size:]
            pending.first_at_s = time.monotonic()  # NOTE: what is left arrived during the wait: it goes next
            live = [(item, future) for item, future in group if not future.done()]  # a client that left
            if not live:
                continue
            try:
                outcomes = await run_sync(self.flush, [item for item, _ in live])
            except Exception as exc:  # NOTE: a flush failing as a whole fails its group, never the collector
                outcomes = [exc] * len(live)
            assert len(outcomes) == len(live), "a flush answers once per item"
            self._count(len(live))
            for (_, future), outcome in zip(live, outcomes):
                if not future.done():
                    future.set_result(outcome)

    def _count(self, size: int) -> None:
        self.stats.num_groups += 1
        self.stats.num_items += size
        self.stats.max_group_size = max(self.stats.max_group_size, size)
