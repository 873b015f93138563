"""A run's aggregates from its requests' measurements: throughput, latency percentiles, goodput, memory, the
prefix cache (hit rate, blocks shared and private), cost.

Pure arithmetic on RequestSample / BatchSample dataclasses (which the store builds from rows):
no database, no torch, no clock. Metric names follow the serving benchmarks people already read:
TTFT, TPOT, ITL, E2EL, queue time, goodput.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Protocol

from servelab.analysis.stats import bootstrap, percentile, percentile_of
from servelab.analysis.workload import SLOSpec

PERCENTILES = (50, 95, 99)
LATENCY_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "queue_ms")


@dataclass(frozen=True)
class RequestSample:
    request_id: str
    is_success: bool
    submitted_at: datetime  # when the client sent it (the row's enqueued_at)
    finished_at: datetime | None
    num_output_tokens: int
    queue_ms: float | None
    ttft_ms: float | None  # client view: from submission to the first token (queue wait included)
    tpot_ms: float | None
    e2el_ms: float | None  # client view: from submission to the last token
    itl_ms: tuple[float, ...] = ()


@dataclass(frozen=True)
class BatchSample:
    num_requests: int
    weight_bytes: int
    kv_cache_bytes: int
    peak_working_bytes: int
    num_rows_per_step: tuple[int, ...] = ()  # rows that made a token at each pass
    num_prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    num_prefix_hit_tokens: int = 0  # of those, found there (not prefilled)
    kv_block_size: int = 0  # tokens per block; 0: the cache is not paged
    kv_blocks_shared: int = 0  # at the batch's KV peak: blocks two or more rows read
    kv_blocks_private: int = 0  # at the batch's KV peak: blocks one row holds
    num_preempted: int = 0  # rows taken out unfinished (the pool ran out, or an interactive call needed the room)


@dataclass(frozen=True)
class LatencySummary:
    mean: float
    p50: float
    p95: float
    p99: float
    p95_low: float | None = None  # bootstrap 95 % interval of p95
    p95_high: float | None = None


@dataclass(frozen=True)
class RunSummary:
    num_requests: int
    num_succeeded: int
    duration_s: float
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    latency: dict[str, LatencySummary]
    goodput_fraction: float | None  # share of requests meeting every SLO set; None when no SLO is set
    goodput_requests_per_s: float | None
    batch_size_counts: dict[int, int]
    mean_batch_size: float
    weight_bytes: int
    kv_cache_peak_bytes: int
    working_peak_bytes: int
    cost_per_request: float
    cost_per_1k_output_tokens: float
    # NOTE: the prefix cache over the run's batches, in tokens; the hit rate is None when nothing was looked up
    # (prefix caching off, transformers' decoder, batches stored before it was counted): n/a, never 0 %
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_hit_rate: float | None = None
    kv_block_size: int = 0  # 0: not paged
    kv_blocks_shared: int = 0  # at the run's KV peak (the batch holding the most KV bytes)
    kv_blocks_private: int = 0
    # NOTE: the cache's capacity at work: rows preempted over the run's batches, the most rows of one pass, and
    # the paged pool (its blocks, as the worker sized it; None where not paged or not recorded) and the share of
    # it the run's KV peak held
    num_preempted: int = 0
    peak_rows: int = 0
    kv_pool_blocks: int | None = None
    kv_pool_peak_use: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def summarise_run(requests: list[RequestSample], batches: list[BatchSample], *, slo: SLOSpec,
                  price_per_hour: float, kv_pool_blocks: int | None = None) -> RunSummary:
    """kv_pool_blocks: the paged pool's size as the serving worker built it (None: not paged, or not known)."""
    assert requests, "a run without requests has no summary"
    ok = [r for r in requests if r.is_success]
    start = min(r.submitted_at for r in requests)
    end = max((r.finished_at for r in requests if r.finished_at), default=start)
    duration_s = max((end - start).total_seconds(), 1e-9)
    output_tokens = sum(r.num_output_tokens for r in ok)
    cost = price_per_hour * duration_s / 3600
    meets_slo = [meets(r, slo) for r in requests] if _has_slo(slo) else None
    cache = prefix_cache(batches)
    return RunSummary(
        num_requests=len(requests), num_succeeded=len(ok), duration_s=duration_s, output_tokens=output_tokens,
        output_tokens_per_s=output_tokens / duration_s, requests_per_s=len(ok) / duration_s,
        latency={m: s for m in LATENCY_METRICS if (s := summarise_latency(latency_values(ok, m))) is not None},
        goodput_fraction=None if meets_slo is None else sum(meets_slo) / len(requests),
        goodput_requests_per_s=None if meets_slo is None else sum(meets_slo) / duration_s,
        # NOTE: the batch size is the rows of each pass (decode step or prefill), the same under every policy
        batch_size_counts=dict(sorted(Counter(n for b in batches for n in b.num_rows_per_step).items())),
        mean_batch_size=_mean([n for b in batches for n in b.num_rows_per_step]),
        weight_bytes=max((b.weight_bytes for b in batches), default=0),
        kv_cache_peak_bytes=max((b.kv_cache_bytes for b in batches), default=0),
        working_peak_bytes=max((b.peak_working_bytes for b in batches), default=0),
        cost_per_request=cost / max(len(ok), 1),
        cost_per_1k_output_tokens=cost / max(output_tokens, 1) * 1000,
        prefix_cache_query_tokens=cache.num_query_tokens, prefix_cache_hit_tokens=cache.num_hit_tokens,
        prefix_cache_hit_rate=cache.hit_rate, kv_block_size=cache.kv_block_size,
        kv_blocks_shared=cache.kv_blocks_shared, kv_blocks_private=cache.kv_blocks_private,
        num_preempted=sum(b.num_preempted for b in batches),
        peak_rows=max((n for b in batches for n in b.num_rows_per_step), default=0),
        kv_pool_blocks=kv_pool_blocks, kv_pool_peak_use=pool_peak_use(cache, kv_pool_blocks),
    )


def pool_peak_use(cache: PrefixCache, kv_pool_blocks: int | None) -> float | None:
    """The share of the paged pool the run's KV peak held (its blocks shared and private); None where no pool."""
    if not kv_pool_blocks or not cache.kv_block_size:
        return None
    return (cache.kv_blocks_shared + cache.kv_blocks_private) / kv_pool_blocks


class CacheFigures(Protocol):
    """A batch's KV figures, as a BatchSample or the dashboard's BatchPoint holds them."""

    kv_cache_bytes: int
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    kv_block_size: int
    kv_blocks_shared: int
    kv_blocks_private: int


@dataclass(frozen=True)
class PrefixCache:
    """A run's prefix cache over its batches (in tokens), and its paged cache's blocks at the run's KV peak."""

    num_query_tokens: int
    num_hit_tokens: int
    hit_rate: float | None  # None: nothing was looked up
    kv_block_size: int  # 0: not paged
    kv_blocks_shared: int  # of the batch holding the most KV bytes
    kv_blocks_private: int


def prefix_cache(batches: Sequence[CacheFigures]) -> PrefixCache:
    """Look-ups and hits summed over the batches; blocks of the batch with the most KV bytes (the first of equals)."""
    queried, hit = sum(b.num_prefix_query_tokens for b in batches), sum(b.num_prefix_hit_tokens for b in batches)
    peak = max(batches, key=lambda b: b.kv_cache_bytes, default=None)
    blocks = (0, 0, 0) if peak is None else (peak.kv_block_size, peak.kv_blocks_shared, peak.kv_blocks_private)
    return PrefixCache(queried, hit, prefix_hit_rate(queried, hit), *blocks)


def prefix_hit_rate(num_query_tokens: int, num_hit_tokens: int) -> float | None:
    """Hit tokens over the tokens looked up; None when none was looked up (the figure does not exist there:
    a cache that was off did not miss). More hits than look-ups is the engine's error, said here."""
    if not 0 <= num_hit_tokens <= num_query_tokens:
        raise ValueError(f"{num_hit_tokens} prefix-cache hit tokens of {num_query_tokens} looked up: hits are "
                         "counted among the look-ups, so they can be neither negative nor more")
    return num_hit_tokens / num_query_tokens if num_query_tokens else None


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def latency_values(requests: list[RequestSample], metric: str) -> list[float]:
    if metric == "itl_ms":
        return [gap for r in requests for gap in r.itl_ms]
    return [v for r in requests if (v := getattr(r, metric)) is not None]


def summarise_latency(values: list[float]) -> LatencySummary | None:
    if not values:
        return None
    p95 = bootstrap(values, percentile_of(95), num_resamples=300)
    return LatencySummary(sum(values) / len(values), percentile(values, 50), p95.value, percentile(values, 99),
                          p95.low, p95.high)


def meets(request: RequestSample, slo: SLOSpec) -> bool:
    if not request.is_success:
        return False
    checks = [(slo.ttft_ms, request.ttft_ms), (slo.tpot_ms, request.tpot_ms), (slo.e2e_ms, request.e2el_ms)]
    return all(limit is None or (value is not None and value <= limit) for limit, value in checks)


def _has_slo(slo: SLOSpec) -> bool:
    return any(v is not None for v in (slo.ttft_ms, slo.tpot_ms, slo.e2e_ms))
