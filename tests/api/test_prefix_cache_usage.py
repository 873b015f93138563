"""The prefix cache's figures wherever a user looks: each answer's usage.prompt_tokens_details.cached_tokens
(completions and chat, whole and streamed, GET /v1/requests/{id}, a batch's output lines and its usage) and the
worker's prefix_cache_queries / _hits counters, from what the engine reports, through a real worker, store,
Redis and api on the tiny model.

NOTE: what the engine finds in its prefix cache is the engine tests' concern; here the tiny engine is wrapped to
report a known count (every finished row's prompt cached but its last token), so each surface is checked
against it whatever the engine's cache holds.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from servelab.jobs.lifecycle import advance_job
from servelab.outputs import StepOutput
from servelab.scheduler.policy import BatchPolicy
from servelab.store import files
from servelab.store.db import session_scope
from servelab.telemetry import REGISTRY
from tests.api.conftest import client_for
from tests.jobs.conftest import CHAT, line, make_job, register, wait_until
from tests.jobs.test_ingest import ingest_all

PROMPT = "once upon a time"


class CachingEngine:
    """The tiny engine, its runner reporting each finished row's prompt as looked up in a prefix cache and all of it
    but its last token as found there (what the worker stores, counts and sends on); `reported` sums what it said."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self._looked_up = self._found = 0
        self.reported = {"queries": 0, "hits": 0}
        self.runner = _CachingRunner(self)

    def take_stats(self):
        timings, memory = self._engine.take_stats()
        timings = replace(timings, num_prefix_query_tokens=self._looked_up, num_prefix_hit_tokens=self._found)
        self.reported["queries"] += self._looked_up
        self.reported["hits"] += self._found
        self._looked_up = self._found = 0
        return timings, memory

    def cached(self, out: StepOutput) -> StepOutput:
        finished = tuple(replace(c, num_cached_tokens=c.num_prompt_tokens - 1) for c in out.finished)
        self._looked_up += sum(c.num_prompt_tokens for c in finished)
        self._found += sum(c.num_cached_tokens for c in finished)
        return replace(out, finished=finished)

    def __getattr__(self, name):
        return getattr(self._engine, name)


class _CachingRunner:
    """The tiny engine's runner, each step's finished rows reported as CachingEngine says."""

    def __init__(self, wrapper: CachingEngine) -> None:
        self._wrapper = wrapper

    def execute(self, plan) -> StepOutput:
        return self._wrapper.cached(self._wrapper._engine.runner.execute(plan))

    def __getattr__(self, name):
        return getattr(self._wrapper._engine.runner, name)


@pytest.fixture
def caching(make_stack, make_served, tiny_engine):
    """A stack whose worker serves through CachingEngine; -> (stack, the engine wrapper, an in-process client)."""
    stack = make_stack(with_worker=False)
    served = make_served(BatchPolicy(max_batch_size=8, max_wait_ms=5, max_batch_tokens=100_000))
    served.worker.engine = engine = CachingEngine(tiny_engine)
    register(served, tiny_engine)
    served.start()
    stack.served = served
    return stack, engine, client_for(stack, stack.key("acme"))


def cached_of(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_answers_carry_the_stored_cached_tokens_whole_streamed_and_by_id(caching) -> None:
    stack, _, client = caching
    body = {"model": stack.model, "max_tokens": 3, "temperature": 0}
    whole = client.post("/v1/completions", json={**body, "prompt": PROMPT}).json()
    usage = whole["usage"]
    assert usage["prompt_tokens"] > 1 and cached_of(usage) == usage["prompt_tokens"] - 1
    chat = client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": PROMPT}]})
    assert cached_of(chat.json()["usage"]) == chat.json()["usage"]["prompt_tokens"] - 1
    with client.stream("POST", "/v1/completions", json={**body, "prompt": PROMPT, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as streamed:
        chunks = [json.loads(x[len("data: "):]) for x in streamed.iter_lines() if x.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage, "the stream's usage is the whole answer's"
    request_id = whole["id"].removeprefix("cmpl-")
    read = client.get(f"/v1/requests/{request_id}").json()
    assert read["result"]["num_cached_tokens"] == cached_of(usage)
    with client.stream("GET", f"/v1/requests/{request_id}", headers={"Accept": "text/event-stream"}) as events:
        data = [json.loads(x[len("data: "):]) for x in events.iter_lines() if x.startswith("data: ")]
    assert data[-1]["usage"] == usage


def test_the_worker_counts_the_engines_look_ups_and_hits(caching) -> None:
    stack, engine, client = caching
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda p: client.post("/v1/completions", json={
            "model": stack.model, "prompt": p, "max_tokens": 2}).json(), ["one", "two words", "three more words"]))
    prompts = sum(a["usage"]["prompt_tokens"] for a in answers)
    counted = {kind: REGISTRY.get_sample_value(f"servelab:prefix_cache_{kind}_total", {"model_name": stack.model})
               for kind in ("queries", "hits")}
    assert engine.reported == {"queries": prompts, "hits": prompts - 3}
    assert counted == engine.reported, "each stretch's figures counted once"


def test_a_batchs_output_lines_and_usage_carry_cached_tokens(caching) -> None:
    stack, _, client = caching
    job = make_job(stack, "\n".join(line(f"c{i}", stack.model, url=CHAT, prompt=f"story number {i}")
                                    for i in range(3)).encode(), endpoint=CHAT)
    ingest_all(stack, job)
    wait_until(lambda: client.get(f"/v1/batches/{job.public_id}").json()["request_counts"]["completed"] == 3,
               timeout_s=60)
    advance_job(sessions=stack.runtime.sessions, job_id=job.id, now=datetime.now(UTC))
    batch = client.get(f"/v1/batches/{job.public_id}").json()
    assert batch["status"] == "completed"
    with session_scope(stack.runtime.sessions) as session:
        output = files.read_content(session, file_id=batch["output_file_id"], tenant="acme").decode()
    usages = [json.loads(x)["response"]["body"]["usage"] for x in output.splitlines()]
    assert len(usages) == 3 and all(cached_of(u) == u["prompt_tokens"] - 1 for u in usages)
    assert batch["usage"]["input_tokens_details"]["cached_tokens"] == sum(cached_of(u) for u in usages)

