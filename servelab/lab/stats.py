"""Statistics for measured figures: percentiles, confidence intervals, ratios with intervals.

Pure arithmetic on plain numbers (numpy only): no torch, no I/O, seeded resampling so the same
data always gives the same interval. Does not know what the numbers measure.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Hashable, TypeVar

K = TypeVar("K", bound=Hashable)

import numpy as np

Z95 = 1.959963984540054
# two-sided 95 % Student t quantiles for small degrees of freedom (1..30); beyond that, the normal one
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


@dataclass(frozen=True)
class Estimate:
    """A figure with its 95 % confidence interval (low, high); the interval is None when it cannot be had."""

    value: float
    low: float | None = None
    high: float | None = None

    @property
    def has_interval(self) -> bool:
        return self.low is not None and self.high is not None

    def overlaps(self, other: Estimate) -> bool:
        if not (self.has_interval and other.has_interval):
            return True
        return self.low <= other.high and other.low <= self.high

    def as_dict(self) -> dict[str, float | None]:
        return {"value": self.value, "low": self.low, "high": self.high}


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in 0..100."""
    assert len(values) > 0, "percentile of nothing"
    return float(np.percentile(np.asarray(values, dtype=float), q))


def mean_interval(values: Sequence[float]) -> Estimate:
    """Mean with a Student-t interval: for figures measured once per repeat."""
    arr = np.asarray(values, dtype=float)
    mean = float(arr.mean())
    if len(arr) < 2:
        return Estimate(mean)
    half = _t95(len(arr) - 1) * float(arr.std(ddof=1)) / math.sqrt(len(arr))
    return Estimate(mean, mean - half, mean + half)


def wilson_interval(num_successes: int, num_trials: int) -> Estimate:
    """A proportion with Wilson's score interval (sound at 0 % and 100 %, unlike the normal one)."""
    assert num_trials > 0, "no trials"
    p = num_successes / num_trials
    denom = 1 + Z95**2 / num_trials
    centre = (p + Z95**2 / (2 * num_trials)) / denom
    half = Z95 * math.sqrt(p * (1 - p) / num_trials + Z95**2 / (4 * num_trials**2)) / denom
    return Estimate(p, max(0.0, centre - half), min(1.0, centre + half))


def mean_of(values: np.ndarray) -> np.ndarray:
    """Mean along the last axis: a statistic bootstrap can apply to many resamples at once."""
    return np.mean(values, axis=-1)


def percentile_of(q: float) -> Callable[[np.ndarray], np.ndarray]:
    return lambda values: np.percentile(values, q, axis=-1)


def bootstrap(values: Sequence[float], statistic: Callable[[np.ndarray], float], *,
              num_resamples: int = 1000, seed: int = 0) -> Estimate:
    """Percentile bootstrap interval of a statistic of one sample (e.g. p95 latency over requests).

    The statistic must reduce the last axis (mean_of, percentile_of(q)), so resamples run as one array op.
    """
    arr = np.asarray(values, dtype=float)
    point = float(statistic(arr))
    if len(arr) < 2:
        return Estimate(point)
    stats = _resampled(arr, statistic, num_resamples, np.random.default_rng(seed))
    return Estimate(point, float(np.percentile(stats, 2.5)), float(np.percentile(stats, 97.5)))


def bootstrap_ratio(candidate: Sequence[float], baseline: Sequence[float],
                    statistic: Callable[[np.ndarray], float], *, num_resamples: int = 1000,
                    seed: int = 0) -> Estimate:
    """candidate statistic / baseline statistic, each sample resampled independently."""
    cand, base = np.asarray(candidate, dtype=float), np.asarray(baseline, dtype=float)
    base_point = float(statistic(base))
    point = float(statistic(cand)) / base_point if base_point else float("nan")
    if len(cand) < 2 or len(base) < 2 or num_resamples == 0:
        return Estimate(point)
    rng = np.random.default_rng(seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = _resampled(cand, statistic, num_resamples, rng) / _resampled(base, statistic, num_resamples, rng)
    if not np.all(np.isfinite(ratios)):  # NOTE: a resampled baseline of 0 (e.g. no queue wait): no interval
        return Estimate(point)
    return Estimate(point, float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5)))


def _resampled(arr: np.ndarray, statistic, num_resamples: int, rng: np.random.Generator) -> np.ndarray:
    # NOTE: blocks of resamples bound memory (10^5 latencies x 1000 resamples would not fit at once).
    block = max(1, min(num_resamples, 2_000_000 // len(arr)))
    out = []
    for start in range(0, num_resamples, block):
        idx = rng.integers(0, len(arr), (min(block, num_resamples - start), len(arr)))
        out.append(np.asarray(statistic(arr[idx]), dtype=float).reshape(-1))
    stats = np.concatenate(out)
    assert len(stats) == num_resamples, "the statistic must reduce the last axis only (use mean_of / percentile_of)"
    return stats


def paired_difference(candidate: Sequence[float], baseline: Sequence[float], *, num_resamples: int = 1000,
                      seed: int = 0) -> Estimate:
    """mean(candidate - baseline) over the same items (e.g. per-passage correctness), paired bootstrap."""
    diff = np.asarray(candidate, dtype=float) - np.asarray(baseline, dtype=float)
    assert diff.ndim == 1 and len(diff) > 0, "paired samples must be the same non-empty length"
    return bootstrap(diff, mean_of, num_resamples=num_resamples, seed=seed)


def _t95(dof: int) -> float:
    return T95[dof - 1] if dof <= len(T95) else Z95


def common_prefix_length(a: Sequence, b: Sequence) -> int:
    """How many leading items are equal (characters of two texts, tokens of two greedy paths): paths that
    part once never meet again, so this is the honest measure of agreement between them."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def interleaved_medians(cells: Sequence[K], measure: Callable[[K], tuple[float, ...]], *, num_rounds: int,
                        label: Callable[[K], str], progress: Callable[[str], None] = lambda message: None,
                        ) -> dict[K, tuple[float, ...]]:
    """Every cell measured once per round, in the order given, round after round; the median of each figure.

    NOTE: the one harness of the benches and the sweep: on a shared machine only figures measured close
    together compare, so no cell's rounds run back to back.
    """
    samples: dict[K, list[tuple[float, ...]]] = {cell: [] for cell in cells}
    for round_idx in range(num_rounds):
        for cell in cells:
            progress(f"round {round_idx + 1}/{num_rounds}: {label(cell)}")
            samples[cell].append(measure(cell))
    return {cell: tuple(statistics.median(column) for column in zip(*runs)) for cell, runs in samples.items()}
