"""servelab.telemetry: a finished row's latencies as a client counts them, and a spec table that is what is exported."""

from __future__ import annotations

import re
import uuid
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from prometheus_client import generate_latest

from servelab.outputs import BatchTimings, Completion
from servelab.request import FinishReason
from servelab.telemetry import (QUEUE_DEPTH, REGISTRY, SPECS, RequestTimes, WorkerMeter, count_submission,
                                observe_streamed_ttft)

ENQUEUED_S = 1_700_000_000.0


def row(*, started_at_s: float, token_times_ms: tuple[float, ...], reason=FinishReason.LENGTH) -> Completion:
    return Completion(str(uuid.uuid4()), "t", tuple(range(len(token_times_ms))), 4, reason,
                      ttft_ms=token_times_ms[0], token_times_ms=token_times_ms, e2e_ms=token_times_ms[-1],
                      started_at_s=started_at_s)


def test_a_finished_rows_latencies_count_from_its_enqueue() -> None:
    times = RequestTimes.of(row(started_at_s=ENQUEUED_S + 2.0, token_times_ms=(50.0, 70.0, 100.0)),
                            enqueued_at_s=ENQUEUED_S)
    assert times.queue_s == pytest.approx(2.0)
    assert (times.ttft_s, times.e2e_s) == (pytest.approx(2.05), pytest.approx(2.1))
    assert times.tpot_s == pytest.approx(0.025) and times.itl_s == pytest.approx((0.02, 0.03))


def test_a_row_whose_clock_starts_before_its_recorded_enqueue_waited_zero() -> None:
    """The enqueue time is PostgreSQL's clock, the start the worker's: hosts may disagree by a little."""
    times = RequestTimes.of(row(started_at_s=ENQUEUED_S - 0.5, token_times_ms=(10.0,)), enqueued_at_s=ENQUEUED_S)
    assert (times.queue_s, times.ttft_s, times.tpot_s, times.itl_s) == (0.0, pytest.approx(0.01), None, ())


def test_the_spec_table_is_exactly_what_a_process_exports() -> None:
    """The dashboard test checks its queries against SPECS: SPECS must be what the registry writes."""
    model = f"spec-{uuid.uuid4().hex[:6]}"
    meter = WorkerMeter(model)
    meter.turn(num_prompt_tokens=4, num_cached_tokens=1, num_step_tokens=5, num_generated_tokens=2, num_step_rows=2,
               num_running=2, num_waiting=1, kv_cache_usage=0.25)
    meter.preempted(cause="pool", num_lost_tokens=3)
    meter.threads(2)
    done = row(started_at_s=ENQUEUED_S + 1, token_times_ms=(5.0, 9.0))
    meter.finished([done], enqueued_at={done.request_id: datetime.fromtimestamp(ENQUEUED_S, UTC)})
    count_submission(endpoint="/v1/completions", model_name=model, outcome="accepted")
    observe_streamed_ttft(model_name=model, ttft_ms=12.0)
    exported = set(re.findall(rf'^(servelab:[A-Za-z0-9_:]+)\{{[^}}]*model_name="{model}"', generate_latest(REGISTRY)
                              .decode(), flags=re.M))
    specified = {name for spec in SPECS.values() if spec.name != QUEUE_DEPTH for name in spec.sample_names}
    assert exported == specified


def test_the_prefix_cache_counters_move_by_each_stretchs_look_ups_and_hits() -> None:
    """Tokens, as vLLM's prefix_cache_queries / _hits; a stretch that looked nothing up (caching off) adds 0."""
    model = f"prefix-{uuid.uuid4().hex[:6]}"
    meter = WorkerMeter(model)

    def counted() -> tuple[float | None, float | None]:
        return tuple(REGISTRY.get_sample_value(f"servelab:prefix_cache_{kind}_total", {"model_name": model})
                     for kind in ("queries", "hits"))

    assert counted() == (0.0, 0.0), "exported from the worker's start, before any stretch"
    stretch = BatchTimings(1.0, 2.0, (2, 2), 40, 2, num_prefix_query_tokens=40, num_prefix_hit_tokens=32)
    meter.stretch(stretch)
    meter.stretch(BatchTimings(1.0, 2.0, (1,), 7, 0))
    meter.stretch(replace(stretch, num_prefix_query_tokens=9, num_prefix_hit_tokens=0))
    assert counted() == (49.0, 32.0)
