"""Submissions that arrive together leave together: one group, one transaction, one round trip to Redis.

Knows asyncio: a submission joins the pending group of its event loop and awaits its own outcome. The first
of a group waits at most max_wait_ms for company; while every flush slot is busy the group keeps gathering
(group commit), and goes as soon as one is free. Does not know what a flush does (servelab.queue.submit).
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
class _Waiting(Generic[T, R]):
    item: T
    future: asyncio.Future[R]
    arrived_s: float  # monotonic


@dataclass
class _Loop(Generic[T, R]):
    """One event loop's pending group and its flush slots."""

    slots: asyncio.Semaphore
    items: list[_Waiting[T, R]] = field(default_factory=list)
    gatherer: asyncio.Task | None = None  # the task that will take the next group; None: none is gathering


@dataclass
class GroupStats:
    """What the collector has done, for tests and the bench: groups written and the items in them."""

    num_groups: int = 0
    num_items: int = 0
    max_group_size: int = 0


class Collector(Generic[T, R]):
    """Groups items for `flush` (blocking: run in a worker thread), which returns one outcome per item, in order.

    NOTE: state per event loop (uvicorn runs one; a test client may start one per request). Up to
    max_in_flight flushes run at once, so a group need not wait for the one before it to commit.
    """

    def __init__(self, flush: Callable[[Sequence[T]], list[R]], *, max_wait_ms: float, max_group_size: int,
                 max_in_flight: int = 1) -> None:
        assert max_group_size >= 1 and max_in_flight >= 1 and max_wait_ms >= 0, "positive sizes, a wait >= 0"
        self.flush = flush
        self.max_wait_s = max_wait_ms / 1e3
        self.max_group_size = max_group_size
        self.max_in_flight = max_in_flight
        self.stats = GroupStats()
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Loop[T, R]] = weakref.WeakKeyDictionary()

    async def submit(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        state = self._loops.get(loop)
        if state is None:
            state = self._loops[loop] = _Loop(asyncio.Semaphore(self.max_in_flight))
        future: asyncio.Future[R] = loop.create_future()
        state.items.append(_Waiting(item, future, time.monotonic()))
        if state.gatherer is None:
            state.gatherer = loop.create_task(self._gather_and_flush(state))
        return await future

    async def _gather_and_flush(self, state: _Loop[T, R]) -> None:
        wait_s = self.max_wait_s - (time.monotonic() - state.items[0].arrived_s)
        if len(state.items) < self.max_group_size and wait_s > 0:
            await asyncio.sleep(wait_s)  # NOTE: only the first of a group waits; the rest arrive meanwhile
        async with state.slots:
            group, state.items = state.items[:self.max_group_size], state.items[self.max_group_size:]
            state.gatherer = None
            if state.items:  # NOTE: more than a group waited: the next one gathers from now
                state.gatherer = asyncio.get_running_loop().create_task(self._gather_and_flush(state))
            await self._flush(group)

    async def _flush(self, group: list[_Waiting[T, R]]) -> None:
        live = [w for w in group if not w.future.done()]  # NOTE: a cancelled waiter's client has gone
        if not live:
            return
        try:
            outcomes = await run_sync(self.flush, [w.item for w in live])
        except Exception as exc:  # NOTE: a flush failing as a whole fails its group, never the collector
            outcomes = [exc] * len(live)
        assert len(outcomes) == len(live), "a flush answers once per item"
        self.stats.num_groups += 1
        self.stats.num_items += len(live)
        self.stats.max_group_size = max(self.stats.max_group_size, len(live))
        for waiting, outcome in zip(live, outcomes):
            if not waiting.future.done():
                waiting.future.set_result(outcome)
