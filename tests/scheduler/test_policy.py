"""The batching policy on a fake clock: size, window and KV budget, interactive first, retries alone."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

from servelab.config import BatchingConfig
from servelab.memory import ModelShape
from servelab.request import GenerationRequest, SamplingParams
from servelab.scheduler.policy import BatchPolicy
from servelab.scheduler.state import ScheduledRequest


def cand(i: int, prompt: int = 10, new: int = 10, interactive: bool = True, retry: bool = False,
         priority: int = 0, preemptions: int = 0) -> ScheduledRequest:
    """Request i, enqueued at second i, with a prompt of `prompt` tokens that may make `new` more."""
    request = GenerationRequest(f"r{i}", prompt="x", params=SamplingParams(max_new_tokens=new),
                                prompt_token_ids=(1,) * prompt)
    return ScheduledRequest(request, f"e{i}", interactive, datetime.fromtimestamp(i, UTC), priority=priority,
                            is_retry=retry, num_preemptions=preemptions)


POLICY = BatchPolicy(max_batch_size=4, max_wait_ms=50, max_batch_tokens=10_000)


def test_burst_larger_than_max_batch_size_fills_a_batch_and_leaves_the_rest() -> None:
    batch, rest = POLICY.select([cand(i) for i in range(6)])
    assert [c.entry_key for c in batch] == ["e0", "e1", "e2", "e3"]
    assert [c.entry_key for c in rest] == ["e4", "e5"]
    assert POLICY.is_closed(batch, rest, first_seen_s=100.0, now_s=100.0)  # full: no waiting


def test_window_flushes_partial_batch_after_max_wait() -> None:
    batch, rest = POLICY.select([cand(0)])
    assert not POLICY.is_closed(batch, rest, first_seen_s=0.0, now_s=0.049)
    assert abs(POLICY.wait_left_s(first_seen_s=0.0, now_s=0.03) - 0.02) < 1e-9
    assert POLICY.is_closed(batch, rest, first_seen_s=0.0, now_s=0.050)


def test_kv_budget_caps_a_batch_of_long_requests() -> None:
    policy = BatchPolicy(max_batch_size=16, max_wait_ms=50, max_batch_tokens=3 * 300)
    batch, rest = policy.select([cand(i, prompt=200, new=100) for i in range(5)])
    assert len(batch) == 3 and len(rest) == 2
    assert policy.batch_tokens(batch) == 900
    assert policy.is_closed(batch, rest, first_seen_s=0.0, now_s=0.0)  # something waits that cannot fit


def test_budget_counts_padding_to_the_longest_prompt() -> None:
    policy = BatchPolicy(max_batch_size=16, max_wait_ms=50, max_batch_tokens=1000)
    assert policy.batch_tokens([cand(0, prompt=10, new=10), cand(1, prompt=400, new=90)]) == 2 * (400 + 90)
    batch, _ = policy.select([cand(0, prompt=10, new=10), cand(1, prompt=400, new=90), cand(2, prompt=5, new=5)])
    assert len(batch) == 2  # a third row would be padded to 400 + 90 as well


def test_a_lone_request_over_the_budget_is_still_served() -> None:
    policy = BatchPolicy(max_batch_size=16, max_wait_ms=50, max_batch_tokens=100)
    batch, rest = policy.select([cand(0, prompt=500, new=100), cand(1)])
    assert [c.entry_key for c in batch] == ["e0"] and [c.entry_key for c in rest] == ["e1"]


def test_interactive_requests_go_before_bulk_and_bulk_keeps_its_share() -> None:
    waiting = [cand(0, interactive=False), cand(1, interactive=False), cand(2), cand(3, interactive=False), cand(4)]
    policy = BatchPolicy(max_batch_size=3, max_wait_ms=0, max_batch_tokens=10_000, min_bulk_rows=0)
    batch, rest = policy.select(waiting)
    assert [c.entry_key for c in batch] == ["e2", "e4", "e0"]
    assert [c.entry_key for c in rest] == ["e1", "e3"]
    # with a bulk share of one row, interactive traffic alone cannot fill the batch
    flood = [cand(i) for i in range(10, 16)]
    batch, rest = replace(policy, min_bulk_rows=1).select([*flood, cand(0, interactive=False)])
    assert [c.entry_key for c in batch] == ["e0", "e10", "e11"]
    batch, _ = replace(policy, min_bulk_rows=1).select(flood, running=[cand(0, interactive=False)])
    assert [c.entry_key for c in batch] == ["e10", "e11"]  # bulk already holds its share


def test_priority_then_age_orders_each_class() -> None:
    waiting = [cand(5, interactive=False, priority=9), cand(3, priority=-1), cand(4, priority=2), cand(1), cand(2, priority=2)]
    assert [c.entry_key for c in POLICY.order(waiting)] == ["e2", "e4", "e1", "e3", "e5"]


CONTINUOUS = BatchPolicy(max_batch_size=3, max_wait_ms=50, max_batch_tokens=10_000, policy="continuous")


def test_continuous_admits_into_a_running_batch_up_to_its_limits() -> None:
    running = [cand(0, interactive=False), cand(1, interactive=False)]
    batch, rest = CONTINUOUS.select([cand(2, interactive=False), cand(3, interactive=False)], running=running)
    assert [c.entry_key for c in batch] == ["e2"] and [c.entry_key for c in rest] == ["e3"]
    tight = replace(CONTINUOUS, max_batch_tokens=3 * 20)
    batch, _ = tight.select([cand(2, prompt=40, interactive=False)], running=running)
    assert batch == []  # the room the cache would hold: 3 rows x 50 columns > 60
    paged = replace(tight, paged=True)  # a pool's tokens: each row holds its prompt and its first token
    batch, _ = paged.select([cand(2, prompt=37, interactive=False), cand(3, prompt=2, interactive=False)],
                            running=running)
    assert [c.entry_key for c in batch] == ["e2"]  # 11 + 11 + 38 = 60 fit; the worst case (3 x 47) would not
    assert CONTINUOUS.is_closed([cand(0)], [], first_seen_s=0.0, now_s=0.0)  # no window to wait for


def test_under_continuous_bulk_newcomers_wait_while_an_interactive_row_decodes() -> None:
    running = [cand(0), cand(1, interactive=False)]
    batch, rest = CONTINUOUS.select([cand(2, interactive=False)], running=running)
    assert batch == [] and [c.entry_key for c in rest] == ["e2"]
    batch, _ = CONTINUOUS.select([cand(3), cand(2, interactive=False)], running=running[1:])
    assert [c.entry_key for c in batch] == ["e3"]  # an interactive newcomer joins; bulk waits behind it
    batch, _ = CONTINUOUS.select([cand(2, interactive=False)], running=[cand(0)])
    assert [c.entry_key for c in batch] == ["e2"]  # unless bulk holds less than its share
    window = replace(CONTINUOUS, policy="window")
    assert [c.entry_key for c in window.select([cand(2, interactive=False)], running=running)[0]] == ["e2"]


def test_under_continuous_one_steps_newcomers_stay_within_the_prefill_budget() -> None:
    budget = replace(CONTINUOUS, max_batch_size=16, max_prefill_tokens=100)
    batch, rest = budget.select([cand(i, prompt=30, interactive=False) for i in range(5)])
    assert len(batch) == 3 and len(rest) == 2  # 3 x 30 padded tokens fit, 4 x 30 do not
    batch, _ = budget.select([cand(0, prompt=500, interactive=False)])
    assert len(batch) == 1  # one newcomer always joins, however long its prompt
    batch, _ = budget.select([cand(0, prompt=10), cand(1, prompt=60)])
    assert len(batch) == 1  # padded to the longest: 2 x 60 > 100
    window = replace(budget, policy="window")
    assert len(window.select([cand(i, prompt=30) for i in range(5)])[0]) == 5  # a window batch is whole


def test_an_interactive_request_preempts_the_newest_bulk_row_once() -> None:
    running = [cand(0, interactive=False), cand(1, interactive=False), cand(2, interactive=False)]
    assert [c.entry_key for c in CONTINUOUS.victims([cand(9)], running)] == ["e2"]
    assert CONTINUOUS.victims([cand(9, interactive=False)], running) == []  # bulk never preempts
    twice = [cand(0, interactive=False), cand(1, interactive=False), cand(2, interactive=False, preemptions=1)]
    assert [c.entry_key for c in CONTINUOUS.victims([cand(9)], twice)] == ["e1"]
    full_of_interactive = [cand(0), cand(1), cand(2, interactive=False)]
    assert CONTINUOUS.victims([cand(9)], full_of_interactive) == []  # bulk keeps its one row
    assert replace(CONTINUOUS, min_bulk_rows=0).victims([cand(9)], full_of_interactive) == [full_of_interactive[2]]
    assert CONTINUOUS.victims([cand(9)], running[:2]) == []  # a free row: nothing to preempt
    assert replace(CONTINUOUS, policy="window").victims([cand(9)], running) == []
    assert CONTINUOUS.victims([cand(9)], [cand(0, interactive=False, retry=True)]) == []  # a retry runs out


def test_a_retried_request_runs_alone() -> None:
    batch, rest = POLICY.select([cand(0, retry=True), cand(1), cand(2)])
    assert [c.entry_key for c in batch] == ["e0"]
    batch, rest = POLICY.select([cand(1), cand(2, retry=True), cand(3)])
    assert [c.entry_key for c in batch] == ["e1"]  # stops at the retry: it waits for a batch of its own


def test_kv_byte_budget_from_model_shape_and_cache_dtype() -> None:
    shape = ModelShape(num_layers=30, num_kv_heads=3, head_dim=64, vocab_size=49152)
    per_token = shape.kv_bytes_per_token(2)  # bf16 cache
    assert per_token == 2 * 30 * 3 * 64 * 2
    policy = BatchPolicy.from_config(BatchingConfig(max_batch_tokens=1_000_000, max_kv_cache_mib=100), shape,
                                     bytes_per_element=2)
    assert policy.max_batch_tokens == 100 * 2**20 // per_token == 4551
    fp32 = BatchPolicy.from_config(BatchingConfig(max_batch_tokens=1_000_000, max_kv_cache_mib=100), shape,
                                   bytes_per_element=4)
    assert fp32.max_batch_tokens == 4551 // 2  # twice the bytes per token: half the tokens
    unset = BatchPolicy.from_config(BatchingConfig(max_batch_tokens=3000), shape, bytes_per_element=2)
    assert unset.max_batch_tokens == 3000  # no memory budget: the token budget alone
