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

The same experiments with sequential looks (a look after every round, 5 % spent over the planned looks) check
the stated rate as a bound (the union bound is conservative, so no exact rate is expected), and read the fixed
95 % interval at every look as a contrast that exceeds it.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import pytest
from scipy.stats import binom, nct
from scipy.stats import t as student_t

from servelab.analysis import stats, verdict
from servelab.analysis.plan import DEFAULT_REPEATS
from servelab.analysis.sequential import ALPHA as ALPHA_SPENT
from servelab.analysis.sequential import Look, SequentialRecord, SequentialSpec
from servelab.lab.calibrate import CALIBRATION_LIMITS
from servelab.analysis.metrics import RequestSample
from servelab.analysis.verdict import (Criterion, RunSet, Verdict, compare, gain_criteria, latency_criteria, overall,
                                       paired_runs)

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


# --- sequential looks: the same run sets, judged after every round until settled (servelab/analysis/sequential.py)

SEQUENTIAL = SequentialSpec()  # the defaults: a look after every round from 3 to 12
NUM_SEQUENTIAL = 400  # comparisons per experiment: a rate of 2.5 % against the naive looks' ~9 % is told apart
STATED = ALPHA_SPENT  # a criterion wrongly passed at most 2.5 %, wrongly failed at most 2.5 %: either, 5 %


def fast_percentile(values, q: float) -> float:
    """numpy's linear percentile for a handful of values, in Python (numpy's costs 70 us a call)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    low = math.floor(pos)
    return xs[low] + (xs[min(low + 1, len(xs) - 1)] - xs[low]) * (pos - low)


@pytest.fixture
def _quick_looks(monkeypatch) -> None:
    """NOTE: a sequential comparison is judged up to ten times: the pure percentile and t quantiles it asks for
    again and again are computed in Python and remembered, so the experiments take seconds."""
    assert fast_percentile([3.0, 1.0, 2.0, 7.0], 95) == pytest.approx(stats.percentile([3.0, 1.0, 2.0, 7.0], 95))
    monkeypatch.setattr(verdict, "percentile", fast_percentile)
    monkeypatch.setattr(stats, "t_quantile", functools.lru_cache(maxsize=None)(stats.t_quantile))


def judged_verdict(base: RunSet, cand: RunSet, level: float) -> Verdict:
    """compare()'s criteria and decision at one confidence level, without its figures (as judge_pair)."""
    pairs = paired_runs(base, cand)
    criteria = [*latency_criteria(base, cand, CALIBRATION_LIMITS, pairs, level),
                *gain_criteria(base, cand, CALIBRATION_LIMITS, pairs, level)]
    decision, reason = overall(criteria, CALIBRATION_LIMITS)
    return Verdict(base.name, cand.name, (), tuple(criteria), (), decision, reason)


@dataclass(frozen=True)
class Looked:
    fixed: Verdict  # the plan's DEFAULT_REPEATS rounds, judged once at 95 %
    sequential: Verdict  # judged after every round at the spent level, until settled or the rounds run out
    sequential_rounds: int
    naive: Verdict | None = None  # judged after every round at 95 % (the fixed interval read again and again)
    naive_rounds: int = 0


def until_settled(draw, level: float) -> tuple[Verdict, int]:
    """The real stopping rule over one comparison's rounds: a look after each round from min_rounds on."""
    record = SequentialRecord(SEQUENTIAL, SEQUENTIAL.levels())
    for index, num_rounds in enumerate(range(SEQUENTIAL.min_rounds, SEQUENTIAL.max_rounds + 1), start=1):
        step = record.add(Look(index, num_rounds, 0, 0.0), [judged_verdict(*draw(num_rounds), level)],
                          CALIBRATION_LIMITS, has_passages=False)
        if step.stop:
            return record.verdicts["cand"], num_rounds
        assert step.take_round and not step.take_passages
    raise AssertionError("the round budget must stop the comparison")


def sequential_comparisons(truth: Truth, *, seed: int, naive: bool = False) -> list[Looked]:
    """NUM_SEQUENTIAL comparisons, each drawn for the whole round budget (the noise of comparisons()); the fixed
    plan reads its first DEFAULT_REPEATS rounds, the sequential one as many as it needs."""
    rng = np.random.default_rng(seed)
    looked = []
    for _ in range(NUM_SEQUENTIAL):
        drift = rng.normal(0.0, 0.3, size=(2, SEQUENTIAL.max_rounds))
        noise = rng.normal(0.0, SIGMA, size=(2, 2, SEQUENTIAL.max_rounds))

        def draw(n: int) -> tuple[RunSet, RunSet]:
            return (run_set("base", 100 * np.exp(drift[0, :n] + noise[0, 0, :n]),
                            200 * np.exp(drift[1, :n] + noise[0, 1, :n])),
                    run_set("cand", 100 * truth.tokens_per_s * np.exp(drift[0, :n] + noise[1, 0, :n]),
                            200 * truth.latency * np.exp(drift[1, :n] + noise[1, 1, :n])))

        fixed = judged_verdict(*draw(DEFAULT_REPEATS), stats.LEVEL)
        sequential, rounds = until_settled(draw, SEQUENTIAL.levels().runs)
        naive_verdict, naive_rounds = until_settled(draw, stats.LEVEL) if naive else (None, 0)
        looked.append(Looked(fixed, sequential, rounds, naive_verdict, naive_rounds))
    return looked


def wrong_in_aa(v: Verdict) -> bool:
    """Nothing changed: accepted as a gain, or rejected for a latency limit."""
    return v.decision == "accept" or latency_of(v).outcome == "fail"


def wrong_on_limits(v: Verdict) -> bool:
    """The gain exactly on its goal judged met, or the latency exactly on its limit judged beyond it: each is the
    worst case of its error (a truth a hair on the other side of the limit)."""
    return gain_of(v).outcome == "pass" or latency_of(v).outcome == "fail"


def share(count: int, n: int) -> str:
    rate = stats.wilson_interval(count, n)
    return f"{count:>3}/{n} {100 * rate.value:5.1f} % [{100 * rate.low:4.1f}, {100 * rate.high:4.1f}]"


def at_most_stated(count: int) -> bool:
    """The count is within what a true rate of STATED gives (its upper 1 - ALPHA binomial quantile)."""
    return count <= binom.isf(ALPHA, NUM_SEQUENTIAL, STATED)


@pytest.mark.usefixtures("_quick_looks")
def test_sequential_looks_err_at_most_the_stated_rate_find_the_known_difference_and_naive_looks_do_not() -> None:
    """A/A (nothing changed), both criteria exactly on their limits, and the known difference both ways, each judged
    three ways on the same draws: the fixed plan (6 rounds, 95 %), sequential looks (3-12 rounds, 5 % spent over
    10 looks) and naive looks (3-12 rounds, the fixed 95 % interval read at every look). Prints the table."""
    aa = sequential_comparisons(Truth(1.0, 1.0), seed=11)
    limits = sequential_comparisons(Truth(1.2, 1.2), seed=12, naive=True)
    known = sequential_comparisons(Truth(1.5, 0.7), seed=13)
    reverse = sequential_comparisons(Truth(1 / 1.5, 1 / 0.7), seed=14)
    n = NUM_SEQUENTIAL

    def row(method: str, pick, rounds) -> str:
        return (f"{method:<26} {share(sum(wrong_in_aa(pick(x)) for x in aa), n)} "
                f"{share(sum(wrong_on_limits(pick(x)) for x in limits), n)} "
                f"{share(sum(pick(x).decision == 'accept' for x in known), n)} "
                f"{share(sum(pick(x).decision == 'reject' for x in reverse), n)}   "
                + " ".join(f"{statistics.fmean(rounds(x) for x in e):5.2f}" for e in (aa, limits, known, reverse))
                + f"   {share(sum(pick(x).decision != 'inconclusive' for x in aa), n)}")

    print(f"\n{'':<26} {'A/A wrong':<26} {'on the limits wrong':<26} {'known accepted':<26} {'reverse rejected':<26}"
          f"   mean rounds (A/A, limits, known, reverse); A/A settled; stated: at most {100 * STATED:.0f} % wrong; "
          "Wilson 95 % intervals")
    print(row(f"fixed, {DEFAULT_REPEATS} rounds", lambda x: x.fixed, lambda x: DEFAULT_REPEATS))
    print(row("sequential, 3-12 rounds", lambda x: x.sequential, lambda x: x.sequential_rounds))
    naive_wrong = sum(wrong_on_limits(x.naive) for x in limits)
    print(f"{'naive 95 % looks, 3-12':<26} {'':<26} {share(naive_wrong, n)} "
          f"{'':<53}   {'':<5} {statistics.fmean(x.naive_rounds for x in limits):5.2f}")

    assert at_most_stated(sum(wrong_in_aa(x.sequential) for x in aa)), "A/A wrongly accepted or rejected"
    assert at_most_stated(sum(wrong_on_limits(x.sequential) for x in limits)), "on the limits: wrongly settled"
    # the contrast, so this check can fail: reading the fixed interval at every look exceeds the stated rate
    assert not at_most_stated(naive_wrong), f"naive looks wrong {naive_wrong}/{n}: expected above {STATED:.0%}"
    # the known difference is still found, at least as often as the fixed plan finds it, and never reversed
    assert sum(x.sequential.decision == "accept" for x in known) >= sum(x.fixed.decision == "accept" for x in known)
    assert sum(x.sequential.decision == "reject" for x in reverse) >= \
        sum(x.fixed.decision == "reject" for x in reverse)
    assert all(x.sequential.decision != "reject" for x in known) and \
        all(x.sequential.decision != "accept" for x in reverse)
