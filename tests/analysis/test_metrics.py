"""servelab.analysis.metrics: a run's prefix-cache figures from its batches, on hand-made batches, and the line
`servelab run` prints of them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from servelab.analysis.metrics import BatchSample, RequestSample, prefix_cache, prefix_hit_rate, summarise_run
from servelab.analysis.workload import SLOSpec
from servelab.cli.lab import capacity_text, prefix_cache_text

NOW = datetime(2026, 12, 3, tzinfo=UTC)


def batch(kv_bytes: int, *, queried: int = 0, hit: int = 0, block_size: int = 0, shared: int = 0,
          private: int = 0, rows: tuple[int, ...] = (2, 2), preempted: int = 0) -> BatchSample:
    return BatchSample(2, 1_000, kv_bytes, 10, rows, queried, hit, block_size, shared, private, preempted)


def test_the_hit_rate_is_hits_over_look_ups_and_undefined_without_look_ups() -> None:
    assert prefix_hit_rate(40, 30) == 0.75
    assert prefix_hit_rate(40, 0) == 0.0, "looked up and never found: a true 0 %"
    assert prefix_hit_rate(0, 0) is None, "nothing looked up (caching off): no rate, not 0 %"
    for queried, hit in ((10, 11), (0, 1), (5, -1)):
        with pytest.raises(ValueError, match="hit tokens"):
            prefix_hit_rate(queried, hit)


def test_a_runs_look_ups_add_up_over_its_batches_and_its_blocks_are_the_kv_peaks() -> None:
    batches = [batch(4_096, queried=30, hit=16, block_size=16, shared=1, private=3),
               batch(8_192, queried=20, hit=4, block_size=16, shared=2, private=6),
               batch(2_048, queried=10, hit=0, block_size=16, shared=0, private=2)]
    cache = prefix_cache(batches)
    assert (cache.num_query_tokens, cache.num_hit_tokens) == (60, 20)
    assert cache.hit_rate == pytest.approx(20 / 60), "tokens summed, not the batches' rates averaged"
    assert (cache.kv_block_size, cache.kv_blocks_shared, cache.kv_blocks_private) == (16, 2, 6)
    none = prefix_cache([batch(1_024), batch(2_048)])
    assert (none.hit_rate, none.kv_block_size, none.kv_blocks_shared) == (None, 0, 0)
    assert prefix_cache([]).hit_rate is None


def test_a_run_summary_records_the_prefix_cache() -> None:
    requests = [RequestSample(f"r{i}", True, NOW, NOW + timedelta(seconds=1), 4, 1.0, 50.0, 10.0, 90.0, (10.0,) * 3)
                for i in range(2)]
    summary = summarise_run(requests, [batch(8_192, queried=24, hit=18, block_size=16, shared=1, private=2)],
                            slo=SLOSpec(), price_per_hour=1.0).as_dict()  # as the run row stores it
    assert (summary["prefix_cache_query_tokens"], summary["prefix_cache_hit_tokens"]) == (24, 18)
    assert summary["prefix_cache_hit_rate"] == 0.75
    assert (summary["kv_block_size"], summary["kv_blocks_shared"], summary["kv_blocks_private"]) == (16, 1, 2)
    off = summarise_run(requests, [batch(8_192)], slo=SLOSpec(), price_per_hour=1.0)
    assert off.prefix_cache_hit_rate is None and off.prefix_cache_query_tokens == 0
    assert prefix_cache_text(off) == "prefix cache: n/a (no prompt token was looked up); KV cache not paged"
    on = summarise_run(requests, [batch(8_192, queried=24, hit=18, block_size=16, shared=1, private=2)],
                       slo=SLOSpec(), price_per_hour=1.0)
    assert prefix_cache_text(on) == ("prefix cache: 75.0% hit (18 of 24 prompt tokens looked up); at the KV peak "
                                     "1 shared + 2 private blocks of 16 tokens")


def test_a_run_summary_records_the_cache_capacity_at_work() -> None:
    """Preemptions summed over the batches, the most rows of a pass, and the share of the pool the KV peak held."""
    requests = [RequestSample(f"r{i}", True, NOW, NOW + timedelta(seconds=1), 4, 1.0, 50.0, 10.0, 90.0, (10.0,) * 3)
                for i in range(2)]
    batches = [batch(4_096, block_size=16, shared=0, private=5, rows=(3, 5, 4), preempted=2),
               batch(8_192, block_size=16, shared=2, private=9, rows=(2, 1), preempted=1)]
    summary = summarise_run(requests, batches, slo=SLOSpec(), price_per_hour=0.0, kv_pool_blocks=22)
    stored = summary.as_dict()
    assert (stored["num_preempted"], stored["peak_rows"], stored["kv_pool_blocks"]) == (3, 5, 22)
    assert stored["kv_pool_peak_use"] == pytest.approx(11 / 22), "the KV peak's blocks (shared + private)"
    assert capacity_text(summary) == ("KV pool: 22 blocks of 16 tokens, 50% held at the KV peak; at most 5 rows a "
                                      "pass; 3 rows preempted")
    unpaged = summarise_run(requests, [batch(8_192)], slo=SLOSpec(), price_per_hour=0.0, kv_pool_blocks=None)
    assert unpaged.kv_pool_peak_use is None and unpaged.num_preempted == 0
    assert capacity_text(unpaged) == "KV pool: not paged; at most 2 rows a pass; 0 rows preempted"
