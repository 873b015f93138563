"""Statistics for measured figures: percentiles, confidence intervals, ratios with intervals.

Pure arithmetic on plain numbers (numpy, and scipy for the t and binomial distributions): no torch, no I/O,
seeded resampling so the same data always gives the same interval. Does not know what the numbers measure.
Intervals are 95 % unless a `level` is given (a sequential comparison's looks ask for wider ones).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Hashable, TypeVar

import numpy as np
from scipy import stats as distributions

K = TypeVar("K", bound=Hashable)

Z95 = 1.959963984540054
LEVEL = 0.95  # the confidence level of every interval unless one is asked for
MAX_REPEATS_ESTIMATED = 1000  # beyond this, "how many repeats would settle it" answers "none practical"


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
    half = t95(len(arr) - 1) * float(arr.std(ddof=1)) / math.sqrt(len(arr))
    return Estimate(mean, mean - half, mean + half)


def wilson_interval(num_successes: int, num_trials: int, *, level: float = LEVEL) -> Estimate:
    """A proportion with Wilson's score interval (sound at 0 % and 100 %, unlike the normal one)."""
    assert num_trials > 0, "no trials"
    z = z_quantile(level)
    p = num_successes / num_trials
    denom = 1 + z**2 / num_trials
    centre = (p + z**2 / (2 * num_trials)) / denom
    half = z * math.sqrt(p * (1 - p) / num_trials + z**2 / (4 * num_trials**2)) / denom
    return Estimate(p, max(0.0, centre - half), min(1.0, centre + half))


def percentile_of(q: float) -> Callable[[np.ndarray], np.ndarray]:
    return lambda values: np.percentile(values, q, axis=-1)


def bootstrap(values: Sequence[float], statistic: Callable[[np.ndarray], float], *,
              num_resamples: int = 1000, seed: int = 0) -> Estimate:
    """Percentile bootstrap interval of a statistic of one sample (e.g. p95 latency over requests).

    The statistic must reduce the last axis (percentile_of(q), a lambda over index arrays), so resamples run as one array op.
    """
    arr = np.asarray(values, dtype=float)
    point = float(statistic(arr))
    if len(arr) < 2:
        return Estimate(point)
    stats = _resampled(arr, statistic, num_resamples, np.random.default_rng(seed))
    return Estimate(point, float(np.percentile(stats, 2.5)), float(np.percentile(stats, 97.5)))


@dataclass(frozen=True)
class RunRatio(Estimate):
    """candidate / baseline of a figure measured once per run, its interval from the spread across runs.

    `unit_sd` is the spread of one repeat on the log scale (the paired log ratios' standard deviation, or
    both sides' added in quadrature when unpaired): with n repeats the standard error is unit_sd / sqrt(n), which
    is what repeats_to_settle extrapolates from.
    """

    num_runs: int = 0  # pairs when paired, else the smaller side
    paired: bool = False
    unit_sd: float | None = None


def geometric_mean_interval(values: Sequence[float], *, level: float = LEVEL) -> RunRatio:
    """Geometric mean of per-run figures (> 0) with a Student-t interval (95 %: `level`) on the log scale."""
    arr = np.asarray(values, dtype=float)
    if not len(arr) or np.any(~np.isfinite(arr)) or np.any(arr <= 0):
        return RunRatio(float("nan"))
    logs = np.log(arr)
    n, centre = len(logs), float(logs.mean())
    if n < 2:
        return RunRatio(math.exp(centre), num_runs=1, paired=True)
    unit = float(logs.std(ddof=1))
    half = t_quantile(n - 1, level) * unit / math.sqrt(n)
    return RunRatio(math.exp(centre), math.exp(centre - half), math.exp(centre + half), n, True, unit)


def ratio_of_runs(candidate: Sequence[float], baseline: Sequence[float], *, paired: bool,
                  level: float = LEVEL) -> RunRatio:
    """Ratio of geometric means of per-run figures with a Student-t 95 % interval on the log scale.

    Paired (the i-th candidate run measured beside the i-th baseline run): a one-sample t interval on the
    n log ratios, n - 1 degrees of freedom. Unpaired: Welch's interval on the difference of mean logs, with
    Welch-Satterthwaite degrees of freedom. Logs make the interval a ratio's (never below 0, symmetric in
    which side is the baseline). Every run is one draw of the figure, request-level noise included, so the
    interval covers the variation between runs as well as within them. Needs figures above 0.
    """
    cand, base = np.asarray(candidate, dtype=float), np.asarray(baseline, dtype=float)
    if not len(cand) or not len(base) or np.any(~np.isfinite(cand)) or np.any(~np.isfinite(base)):
        return RunRatio(float("nan"))
    if np.any(cand <= 0) or np.any(base <= 0):
        return _ratio_with_zeros(cand, base)
    if paired:
        assert len(cand) == len(base), "paired runs come in pairs"
        return geometric_mean_interval(cand / base, level=level)
    log_c, log_b = np.log(cand), np.log(base)
    centre, n = float(log_c.mean() - log_b.mean()), min(len(cand), len(base))
    if len(cand) < 2 or len(base) < 2:
        return RunRatio(math.exp(centre), num_runs=n)
    var_c, var_b = float(log_c.var(ddof=1)) / len(cand), float(log_b.var(ddof=1)) / len(base)
    se = math.sqrt(var_c + var_b)
    unit = math.sqrt(float(log_c.var(ddof=1)) + float(log_b.var(ddof=1)))
    if se == 0:
        return RunRatio(math.exp(centre), math.exp(centre), math.exp(centre), n, False, 0.0)
    dof = (var_c + var_b) ** 2 / (var_c**2 / (len(cand) - 1) + var_b**2 / (len(base) - 1))
    half = t_quantile(dof, level) * se
    return RunRatio(math.exp(centre), math.exp(centre - half), math.exp(centre + half), n, False, unit)


def _ratio_with_zeros(cand: np.ndarray, base: np.ndarray) -> RunRatio:
    """Figures of 0 have no log: every candidate run at 0 is exactly x0, every baseline run at 0 exactly
    infinite, both all 0 not measured; some runs at 0 give the ratio of means without an interval."""
    n = min(len(cand), len(base))
    if np.all(base == 0) and np.all(cand == 0):
        return RunRatio(float("nan"), num_runs=n)
    if np.all(cand == 0):
        return RunRatio(0.0, 0.0, 0.0, n, False, 0.0)
    if np.all(base == 0):
        return RunRatio(math.inf, math.inf, math.inf, n, False, 0.0)
    return RunRatio(float(cand.mean() / base.mean()) if base.mean() else math.inf, num_runs=n)


def repeats_to_settle(ratio: RunRatio, limit: float) -> int | None:
    """Repeats (per side) after which the interval would clear `limit`, if the spread stays as measured.

    None when it cannot be estimated (no spread measured, or the estimate sits on the limit) or exceeds
    MAX_REPEATS_ESTIMATED.
    """
    if ratio.unit_sd is None or not math.isfinite(ratio.value) or ratio.value <= 0:
        return None
    distance = abs(math.log(ratio.value) - math.log(limit))
    if distance == 0:
        return None
    for n in range(2, MAX_REPEATS_ESTIMATED + 1):
        dof = n - 1 if ratio.paired else 2 * n - 2
        if t95(dof) * ratio.unit_sd / math.sqrt(n) < distance:
            return n
    return None


def paired_proportion_difference(candidate: Sequence[int], baseline: Sequence[int], *,
                                 level: float = LEVEL) -> Estimate:
    """p(candidate) - p(baseline) of 0/1 outcomes on the same items, Newcombe's hybrid score interval.

    Newcombe (1998, method 10): the two marginal Wilson intervals combined with the correlation of the pairs.
    Sound at 0 and 1 and with few discordant pairs, where a bootstrap gives a zero-width interval; items that
    both sides get right (or wrong) narrow it, as they should. With no discordant item at all the interval is
    +-(Wilson upper bound of 0 discordant of n), never zero-width.
    """
    c, b = np.asarray(candidate, dtype=int), np.asarray(baseline, dtype=int)
    assert c.shape == b.shape and c.ndim == 1 and len(c) > 0, "paired outcomes must be the same non-empty length"
    n = len(c)
    both, only_c, only_b = int(np.sum((c == 1) & (b == 1))), int(np.sum((c == 1) & (b == 0))), \
        int(np.sum((c == 0) & (b == 1)))
    neither = n - both - only_c - only_b
    if only_c + only_b == 0:
        # NOTE: no passage differs: the difference is bounded by the discordance rate, 0 of n (Wilson upper
        # bound); Newcombe's formula alone would give a zero width at 50 % accuracy (perfect correlation)
        bound = wilson_interval(0, n, level=level).high
        return Estimate(0.0, -bound, bound)
    p1, p2 = (both + only_c) / n, (both + only_b) / n
    w1, w2 = wilson_interval(both + only_c, n, level=level), wilson_interval(both + only_b, n, level=level)
    denom = (both + only_c) * (neither + only_b) * (both + only_b) * (neither + only_c)
    phi = (both * neither - only_c * only_b) / math.sqrt(denom) if denom else 0.0
    low_gap = math.sqrt(max(0.0, (p1 - w1.low) ** 2 - 2 * phi * (p1 - w1.low) * (w2.high - p2) + (w2.high - p2) ** 2))
    high_gap = math.sqrt(max(0.0, (w1.high - p1) ** 2 - 2 * phi * (w1.high - p1) * (p2 - w2.low) + (p2 - w2.low) ** 2))
    diff = p1 - p2
    return Estimate(diff, max(-1.0, diff - low_gap), min(1.0, diff + high_gap))


def mcnemar_exact_p(candidate: Sequence[int], baseline: Sequence[int]) -> float:
    """Two-sided exact McNemar p-value: do the items only one side gets right lean one way?"""
    c, b = np.asarray(candidate, dtype=int), np.asarray(baseline, dtype=int)
    only_c, only_b = int(np.sum((c == 1) & (b == 0))), int(np.sum((c == 0) & (b == 1)))
    if only_c + only_b == 0:
        return 1.0
    return float(distributions.binomtest(only_c, only_c + only_b, 0.5).pvalue)


def paired_perplexity_ratio(candidate_nll: Sequence[float], baseline_nll: Sequence[float],
                            candidate_tokens: Sequence[int], baseline_tokens: Sequence[int], *,
                            num_resamples: int = 1000, seed: int = 0, level: float = LEVEL) -> Estimate:
    """Candidate perplexity over the baseline's on the same passages, each per its own tokens (a tokenizer may
    differ); a bootstrap over passages, resampling both sides' passages together.

    NOTE: a level beyond 95 % reads a thinner tail, so the resamples grow to keep about 25 in each tail.
    """
    c, b, tc, tb = (np.asarray(x, dtype=float) for x in (candidate_nll, baseline_nll, candidate_tokens,
                                                          baseline_tokens))
    assert c.shape == b.shape == tc.shape == tb.shape and len(c) > 0, "paired passages must be the same length"

    def log_ratio(idx: np.ndarray) -> np.ndarray:
        return c[idx].sum(axis=-1) / np.maximum(tc[idx].sum(axis=-1), 1.0) - \
            b[idx].sum(axis=-1) / np.maximum(tb[idx].sum(axis=-1), 1.0)

    point = math.exp(float(log_ratio(np.arange(len(c)))))
    if len(c) < 2:
        return Estimate(point)
    tail = 2.5 if level == LEVEL else 100 * (1 - level) / 2
    num_resamples = max(num_resamples, math.ceil(2500 / tail))
    ratios = np.exp(_resampled(np.arange(len(c)), log_ratio, num_resamples,
                               np.random.default_rng(seed)))
    return Estimate(point, float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100 - tail)))


def _resampled(arr: np.ndarray, statistic, num_resamples: int, rng: np.random.Generator) -> np.ndarray:
    # NOTE: blocks of resamples bound memory (10^5 latencies x 1000 resamples would not fit at once).
    block = max(1, min(num_resamples, 2_000_000 // len(arr)))
    out = []
    for start in range(0, num_resamples, block):
        idx = rng.integers(0, len(arr), (min(block, num_resamples - start), len(arr)))
        out.append(np.asarray(statistic(arr[idx]), dtype=float).reshape(-1))
    stats = np.concatenate(out)
    assert len(stats) == num_resamples, "the statistic must reduce the last axis only (use percentile_of)"
    return stats


def t_quantile(dof: float, level: float = LEVEL) -> float:
    """The two-sided Student t quantile of a confidence level (t95's at 95 %)."""
    return t95(dof) if level == LEVEL else float(distributions.t.ppf(1 - (1 - level) / 2, dof))


def z_quantile(level: float = LEVEL) -> float:
    return Z95 if level == LEVEL else float(distributions.norm.ppf(1 - (1 - level) / 2))


def t95(dof: float) -> float:
    """The two-sided 95 % Student t quantile for any degrees of freedom (Welch's are fractional)."""
    assert dof > 0, "a t interval needs at least one degree of freedom"
    return float(distributions.t.ppf(0.975, dof))


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
