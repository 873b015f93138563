"""The worker's Prometheus counts against what it stored: every count made at the event agrees with the rows."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import func, select

from servelab.scheduler.policy import BatchPolicy
from servelab.request import SamplingParams
from servelab.store.db import session_scope
from servelab.store.models import BatchRow, RequestMetricsRow, RequestRow, ResultRow, StreamKind
from servelab.telemetry import REGISTRY
from tests.queue.test_worker import LONG, step_until, submit, wait_all


def sample(served, name: str, **labels: str) -> float:
    value = REGISTRY.get_sample_value(f"servelab:{name}", {"model_name": served.streams.config_name, **labels})
    return value or 0.0


def stored(served, ids: list[str]):
    keys = [uuid.UUID(i) for i in ids]
    with session_scope(served.sessions) as session:
        tokens = session.execute(select(func.sum(ResultRow.num_prompt_tokens), func.sum(ResultRow.num_generated_tokens))
                                 .where(ResultRow.request_id.in_(keys))).one()
        metrics = session.scalars(select(RequestMetricsRow).where(RequestMetricsRow.request_id.in_(keys))).all()
        batches = session.scalars(select(BatchRow).where(
            BatchRow.serving_config_name == served.streams.config_name)).all()
        preemptions = session.scalar(select(func.sum(RequestRow.num_preemptions)).where(RequestRow.id.in_(keys)))
        return tokens, [(m.queue_ms, m.ttft_ms, m.e2e_ms, list(m.itl_ms)) for m in metrics], batches, preemptions


def test_the_workers_counts_agree_with_the_rows_it_stored(make_served) -> None:
    served = make_served(BatchPolicy(max_batch_size=4, max_wait_ms=100, max_batch_tokens=100_000))
    good = submit(served, 6, sampling=SamplingParams(max_new_tokens=5))
    too_long = submit(served, 1, prompt="cat " * 400)  # over the tiny model's context: fails in the engine
    served.start()
    wait_all(served, good + too_long)
    (prompt_tokens, generated), metrics, batches, _ = stored(served, good)

    assert sample(served, "request_success_total", finished_reason="length") == 6
    assert sample(served, "request_success_total", finished_reason="error") == 1
    assert sample(served, "generation_tokens_total") == generated == 30
    assert sample(served, "prompt_tokens_total") == prompt_tokens
    # latencies from the enqueue, as a client counts them: the stored queue wait plus the engine's figures
    assert sample(served, "time_to_first_token_seconds_count") == 6  # the failed row has no latency
    assert sample(served, "time_to_first_token_seconds_sum") == pytest.approx(sum(q + t for q, t, _, _ in metrics) / 1e3, abs=1e-4)
    assert sample(served, "e2e_request_latency_seconds_sum") == pytest.approx(sum(q + e for q, _, e, _ in metrics) / 1e3, abs=1e-4)
    assert sample(served, "request_queue_time_seconds_sum") == pytest.approx(sum(q for q, _, _, _ in metrics) / 1e3, abs=1e-4)
    assert sample(served, "inter_token_latency_seconds_count") == sum(len(itl) for *_, itl in metrics) == 24
    assert sample(served, "inter_token_latency_seconds_sum") == pytest.approx(sum(sum(itl) for *_, itl in metrics) / 1e3)
    assert sample(served, "request_generation_tokens_sum") == 30
    # each decode step of r rows makes r tokens: the rows observed per step add up to the stored decode tokens
    assert sample(served, "num_rows_per_step_sum") == sum(b.num_decode_tokens for b in batches)
    # each step's tokens: the prompt tokens it computed (those found in the prefix cache were not) and those it made
    cached = sample(served, "prefix_cache_hits_total")
    assert sample(served, "iteration_tokens_total_sum") == prompt_tokens - cached + generated
    assert sample(served, "prompt_tokens_by_source_total", source="cached") == cached
    assert sample(served, "prompt_tokens_by_source_total", source="computed") == prompt_tokens - cached
    # the prefix cache's look-ups and hits: each stretch's figures, counted once and stored once
    assert sample(served, "prefix_cache_queries_total") == sum(b.num_prefix_query_tokens for b in batches)
    assert sample(served, "prefix_cache_hits_total") == sum(b.num_prefix_hit_tokens for b in batches)
    for idle in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert sample(served, idle) == 0, idle


def test_a_preemption_is_counted_by_cause_and_the_tokens_it_computes_again_apart(make_served) -> None:
    served = make_served(BatchPolicy(max_batch_size=2, max_wait_ms=0, max_batch_tokens=100_000, policy="continuous"))
    served.streams.ensure_groups()
    bulk = submit(served, 2, kind=StreamKind.BULK, sampling=LONG)
    for _ in range(5):
        served.worker.step()
    assert sample(served, "num_requests_running") == 2
    assert 0 < sample(served, "kv_cache_usage_perc") < 1
    interactive = submit(served, 1, sampling=SamplingParams(max_new_tokens=3))
    step_until(served, interactive + bulk)
    (prompt_tokens, _), _, _, preemptions = stored(served, bulk + interactive)
    assert sample(served, "num_preemptions_total", cause="priority") == preemptions == 1
    assert sample(served, "num_preemptions_total", cause="pool") == 0
    with session_scope(served.sessions) as session:
        prompt = session.scalar(select(ResultRow.num_prompt_tokens).where(ResultRow.request_id == uuid.UUID(bulk[1])))
    assert sample(served, "prompt_tokens_total") == prompt_tokens  # each request's prompt once
    # what the preempted row had computed (its prompt and the tokens it had made) is computed again, counted apart
    assert sample(served, "prompt_tokens_recomputed_total") > prompt
