"""The batching policy on a fake clock: size, window and KV budget, interactive first, retries alone."""

from __future__ import annotations

from servelab.config import BatchingConfig
from servelab.engine.memory import ModelShape
from servelab.queue.batcher import BatchPolicy, Candidate


def cand(i: int, prompt: int = 10, new: int = 10, interactive: bool = True, retry: bool = False) -> Candidate:
    return Candidate(f"e{i}", f"r{i}", prompt, new, interactive, retry)


POLICY = BatchPolicy(max_batch_size=4, max_wait_ms=50, max_batch_tokens=10_000)


def test_burst_larger_than_max_batch_size_fills_a_batch_and_leaves_the_rest() -> None:
    batch, rest = POLICY.select([cand(i) for i in range(6)])
    assert [c.entry_id for c in batch] == ["e0", "e1", "e2", "e3"]
    assert [c.entry_id for c in rest] == ["e4", "e5"]
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
    assert [c.entry_id for c in batch] == ["e0"] and [c.entry_id for c in rest] == ["e1"]


def test_interactive_requests_go_before_bulk() -> None:
    waiting = [cand(0, interactive=False), cand(1, interactive=False), cand(2), cand(3, interactive=False), cand(4)]
    batch, rest = BatchPolicy(max_batch_size=3, max_wait_ms=0, max_batch_tokens=10_000).select(waiting)
    assert [c.entry_id for c in batch] == ["e2", "e4", "e0"]
    assert [c.entry_id for c in rest] == ["e1", "e3"]


def test_a_retried_request_runs_alone() -> None:
    batch, rest = POLICY.select([cand(0, retry=True), cand(1), cand(2)])
    assert [c.entry_id for c in batch] == ["e0"]
    batch, rest = POLICY.select([cand(1), cand(0, retry=True), cand(2)])
    assert [c.entry_id for c in batch] == ["e1"]


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
