"""The verdict's calibration on synthetic run sets of known spread and known difference (seeded): how often
it is wrong when nothing changed, at a true gain exactly on the goal, and on a known difference, both ways,
each count checked against the rate the Student-t intervals promise for that spread and difference.

Knows only the verdict (pure: no worker, no clock). The live calibration on real workers, which measures the
spread on this machine, is `servelab calibrate` (a benchmark: its figures are in the docs, not asserted here).

NOTE: each run's noise is normal on the log scale, so a paired log ratio over n rounds is normal and the
verdict's t interval is exact: P(an interval excludes the truth) = 5 %, and P(a bound clears a limit) is a
noncentral t probability. Every count is then a binomial draw, and each check accepts the central 1 - ALPHA
of that binomial: a correct verdict fails a check with probability ALPHA = 0.001 (the seed is fixed, so a run
is repeatable, and ALPHA says why a passing seed was not picked for luck: any seed passes with p >= 0.999).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import pytest
from scipy.stats import binom, nct
from scipy.stats import t as student_t

from servelab.analysis import stats
from servelab.lab.calibrate import CALIBRATION_LIMITS
from servelab.analysis.metrics import RequestSample
from servelab.analysis.verdict import Criterion, RunSet, compare, gain_criteria, latency_criteria, overall, paired_runs

ALPHA = 0.001  # the chance that one count check below fails although the verdict is right
NUM_COMPARISONS = 600
NUM_ROUNDS = 5  # the calibration's default repeats
SIGMA = 0.08  # one run's log spread (per figure): a paired log ratio has spread SIGMA * sqrt(2)
LIMIT = math.log(1.2)  # CALIBRATION_LIMITS: gain tokens/s >= x1.2, p95 TTFT and p95 E2E latency <= x1.2
CONFIG = {"name": "c", "model": "tiny", "weights": "fp32", "kv_cache_dtype": "auto", "device": "cpu",
          "num_threads": 1, "batching": {"max_batch_size": 16}, "decoding": {}, "awq": None}
HARDWARE = {"cpu": "x", "gpu": None, "num_cpus": 2, "memory_bytes": 1, "device": "cpu"}
NOW = datetime.now(UTC)


@pytest.fixture(autouse=True)
def _t_quantiles_remembered(monkeypatch) -> None:
    """NOTE: the same pure quantile, asked thousands of times (what would settle an unsure criterion looks
    at every repeat count up to 100): remembered, so the module takes seconds, not a minute."""
    monkeypatch.setattr(stats, "t95", functools.lru_cache(maxsize=None)(stats.t95))


@dataclass(frozen=True)
class Judged:
    """What compare() decides, without the figures it also reports (most of its time)."""

    criteria: tuple[Criterion, ...]
    decision: str


@dataclass(frozen=True)
class Truth:
    """The candidate's true ratios to the baseline."""

    tokens_per_s: float
    latency: float  # p95 TTFT and p95 E2E latency move together


def run_set(name: str, tokens_per_s: np.ndarray, ttft_ms: np.ndarray) -> RunSet:
    """One run per round; every request of a run has the run's latency, so its p95 is that latency."""
    samples = tuple(tuple(RequestSample(f"{name}{r}-{i}", True, NOW, NOW, 8, 1.0, float(ttft), 10.0,
                                        float(2 * ttft), (10.0,)) for i in range(3)) for r, ttft in enumerate(ttft_ms))
    return RunSet(name, tuple(f"{name}{r}" for r in range(len(ttft_ms))), {**CONFIG, "name": name}, "w", HARDWARE,
                  tuple({"output_tokens_per_s": float(v)} for v in tokens_per_s), samples,
                  tuple(range(len(ttft_ms))))


def judge_pair(base: RunSet, cand: RunSet) -> Judged:
    pairs = paired_runs(base, cand)
    criteria = [*latency_criteria(base, cand, CALIBRATION_LIMITS, pairs),
                *gain_criteria(base, cand, CALIBRATION_LIMITS, pairs)]
    return Judged(tuple(criteria), overall(criteria, CALIBRATION_LIMITS)[0])


def comparisons(truth: Truth, *, seed: int) -> list[Judged]:
    """NUM_COMPARISONS verdicts of a candidate against its baseline, NUM_ROUNDS paired rounds each. A round's
    drift (the machine's load) moves both sides alike: pairing by round cancels it."""
    rng = np.random.default_rng(seed)
    verdicts = []
    for _ in range(NUM_COMPARISONS):
        drift = rng.normal(0.0, 0.3, size=(2, NUM_ROUNDS))  # tokens/s, latency
        noise = rng.normal(0.0, SIGMA, size=(2, 2, NUM_ROUNDS))  # side, figure, round
        base = run_set("base", 100 * np.exp(drift[0] + noise[0, 0]), 200 * np.exp(drift[1] + noise[0, 1]))
        cand = run_set("cand", 100 * truth.tokens_per_s * np.exp(drift[0] + noise[1, 0]),
                       200 * truth.latency * np.exp(drift[1] + noise[1, 1]))
        judged = judge_pair(base, cand)
        if len(verdicts) < 10:  # NOTE: the shortcut decides as compare() does
            full = compare(base, cand, CALIBRATION_LIMITS)
            assert (full.decision, full.criteria) == (judged.decision, judged.criteria)
        verdicts.append(judged)
    return verdicts


def p_bound_clears(true_log: float, limit_log: float, *, lower: bool) -> float:
    """P(the lower bound of the 95 % interval is at or above the limit) (lower) or P(the upper bound is at or
    below it): a noncentral t probability, n - 1 degrees of freedom."""
    n, sd = NUM_ROUNDS, SIGMA * math.sqrt(2)
    shift = (true_log - limit_log) * math.sqrt(n) / sd
    return float(nct.sf(student_t.ppf(0.975, n - 1), n - 1, shift if lower else -shift))


def assert_rate(count: int, p: float, what: str) -> None:
    low, high = binom.ppf(ALPHA / 2, NUM_COMPARISONS, p), binom.isf(ALPHA / 2, NUM_COMPARISONS, p)
    assert low <= count <= high, (f"{what}: {count} of {NUM_COMPARISONS}, expected {NUM_COMPARISONS * p:.1f} "
                                  f"(the central {1 - ALPHA:.1%} of a binomial: {low:.0f}..{high:.0f})")


def gain_of(v: Judged):
    return next(c for c in v.criteria if c.kind == "gain")


def latency_of(v: Judged, metric: str = "p95 ttft_ms ratio"):
    return next(c for c in v.criteria if c.name == metric)


def excludes_one(estimate) -> bool:
    return not estimate.low <= 1.0 <= estimate.high


def test_nothing_changed_the_intervals_exclude_x1_five_percent_of_the_time_and_nothing_is_accepted() -> None:
    verdicts = comparisons(Truth(1.0, 1.0), seed=1)
    assert_rate(sum(excludes_one(gain_of(v).measured) for v in verdicts), 0.05, "tokens/s intervals excluding x1")
    assert_rate(sum(excludes_one(latency_of(v).measured) for v in verdicts), 0.05, "p95 TTFT intervals excluding x1")
    # the verdict errs only when a bound clears a limit x1.2 away from the truth
    p_accept = p_bound_clears(0.0, LIMIT, lower=True) * p_bound_clears(0.0, LIMIT, lower=False)
    assert_rate(sum(v.decision == "accept" for v in verdicts), p_accept, "A/A wrongly accepted as a gain")
    assert_rate(sum(latency_of(v).outcome == "fail" for v in verdicts), p_bound_clears(0.0, LIMIT, lower=True),
                "A/A rejected for a latency limit")
    # and it never says anything but no gain: the goal is out of reach, or the intervals are too wide to say
    assert {v.decision for v in verdicts} <= {"reject", "inconclusive"}
    assert all(gain_of(v).outcome != "pass" for v in verdicts)


def test_a_gain_exactly_on_the_goal_is_accepted_two_and_a_half_percent_of_the_time() -> None:
    """The nominal error rate at its worst: the true gain is the goal, so a gain that passes is luck."""
    verdicts = comparisons(Truth(1.2, 1.0), seed=2)
    assert_rate(sum(gain_of(v).outcome == "pass" for v in verdicts), 0.025, "gain on the goal judged met")
    assert_rate(sum(gain_of(v).outcome == "fail" for v in verdicts), 0.025, "gain on the goal judged out of reach")
    p_accept = 0.025 * p_bound_clears(0.0, LIMIT, lower=False)
    assert_rate(sum(v.decision == "accept" for v in verdicts), p_accept, "gain on the goal accepted")


def test_a_latency_exactly_on_its_limit_is_rejected_two_and_a_half_percent_of_the_time() -> None:
    verdicts = comparisons(Truth(1.5, 1.2), seed=3)
    assert_rate(sum(latency_of(v).outcome == "fail" for v in verdicts), 0.025, "latency on its limit rejected")
    assert_rate(sum(latency_of(v).outcome == "pass" for v in verdicts), 0.025, "latency on its limit judged within")
    # TTFT and E2E latency move together here, so the two latency criteria always agree
    assert all(latency_of(v).outcome == latency_of(v, "p95 e2el_ms ratio").outcome for v in verdicts)


def test_a_known_difference_is_found_as_often_as_its_power_says_and_its_reverse_is_rejected() -> None:
    """Batching's gain as the live calibration sees it: tokens/s x1.5, p95 latency x0.7."""
    truth = Truth(1.5, 0.7)
    forward = comparisons(truth, seed=4)
    power = p_bound_clears(math.log(1.5), LIMIT, lower=True) * p_bound_clears(math.log(0.7), LIMIT, lower=False)
    assert power > 0.8, "the known difference should be found most of the time at this spread"
    assert_rate(sum(v.decision == "accept" for v in forward), power, "the known difference accepted")
    assert all(v.decision != "reject" for v in forward)  # never rejected: every bound is far from its limit

    backward = comparisons(Truth(1 / truth.tokens_per_s, 1 / truth.latency), seed=5)
    p_latency_fail = p_bound_clears(-math.log(0.7), LIMIT, lower=True)
    p_gain_out = p_bound_clears(-math.log(1.5), LIMIT, lower=False)
    p_reject = 1 - (1 - p_latency_fail) * (1 - p_gain_out)
    assert_rate(sum(v.decision == "reject" for v in backward), p_reject, "the reverse rejected")
    assert all(v.decision != "accept" for v in backward)
