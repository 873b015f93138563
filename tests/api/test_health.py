"""/healthz under load: it answers from the event loop while every thread of the api's pool is held by a waiting
completion call (a health check that queued behind them would mark a busy api dead and restart it).

NOTE: shown by order, not by a time budget: a route that needs a pool thread, asked first, is still unanswered
when /healthz has answered five times (the waiting calls hold the pool for max_wait_s, far longer than that)."""

from __future__ import annotations

import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
from sqlalchemy import func, select

from servelab.store.db import session_scope
from servelab.store.models import RequestRow, RequestStatus
from tests.api.conftest import api_process

NUM_WAITING = 24  # completion calls no worker serves, against a pool of 2 threads
LIVENESS_S = 120  # the test's own guard against a hang, never the assertion


def test_healthz_answers_while_waiting_completions_hold_every_thread_of_the_pool(make_stack) -> None:
    stack = make_stack(with_worker=False, api_threads=2, max_wait_s=LIVENESS_S)  # fp32 has no worker: calls wait
    tenant = f"patient-{uuid.uuid4().hex[:8]}"
    headers = {"Authorization": f"Bearer {stack.key(tenant)}"}
    started: list[subprocess.Popen] = []
    with ThreadPoolExecutor(NUM_WAITING + 1) as clients, api_process(stack, started) as url:
        waiting = [clients.submit(httpx.post, f"{url}/completions", headers=headers, timeout=LIVENESS_S,
                                  json={"model": "fp32", "prompt": f"hi {i}", "max_tokens": 1})
                   for i in range(NUM_WAITING)]
        deadline = time.monotonic() + LIVENESS_S
        while _num_queued(stack, tenant) < NUM_WAITING:
            assert time.monotonic() < deadline, "the completion calls were not all queued"
            time.sleep(0.1)
        # the pool is full: a route that needs one of its threads queues behind the waiting calls
        models = clients.submit(httpx.get, f"{url}/models", headers=headers, timeout=LIVENESS_S)
        for _ in range(5):  # while /healthz answers, every time, from the event loop
            assert httpx.get(f"{url.removesuffix('/v1')}/healthz", timeout=LIVENESS_S).json() == {"status": "ok"}
        assert not models.done(), "a route needing a pool thread answered: the pool was not full"
        assert not any(w.done() for w in waiting), "the waiting calls ended early: the pool was not full"
        started[0].kill()  # NOTE: ends the waiting calls at once (a SIGTERM would wait for them to be answered)
        assert isinstance(models.exception(timeout=LIVENESS_S), httpx.HTTPError)  # never answered: the api died first


def _num_queued(stack, tenant: str) -> int:
    with session_scope(stack.runtime.sessions) as session:
        return session.scalar(select(func.count()).where(RequestRow.tenant == tenant,
                                                         RequestRow.status == RequestStatus.QUEUED))
