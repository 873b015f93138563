"""The interval arithmetic behind the verdicts, against values worked by hand or by a second method."""

from __future__ import annotations

import math

import numpy as np
import pytest

from servelab.analysis.stats import (
    geometric_mean_interval,
    mcnemar_exact_p,
    paired_perplexity_ratio,
    paired_proportion_difference,
    ratio_of_runs,
    repeats_to_settle,
    t95,
)


def test_t_quantiles_are_student_s_at_every_degree_of_freedom() -> None:
    assert t95(1) == pytest.approx(12.706, abs=1e-3) and t95(4) == pytest.approx(2.776, abs=1e-3)
    assert t95(60) == pytest.approx(2.000, abs=1e-3)  # not the normal 1.96 past 30 degrees of freedom
    assert t95(2) > t95(2.5) > t95(3)  # Welch's fractional degrees of freedom


def test_a_paired_ratio_is_a_t_interval_on_the_log_ratios() -> None:
    cand, base = [110.0, 120.0, 100.0, 115.0], [100.0, 105.0, 95.0, 100.0]
    logs = np.log(np.array(cand) / np.array(base))
    half = t95(3) * logs.std(ddof=1) / 2
    ratio = ratio_of_runs(cand, base, paired=True)
    assert (ratio.value, ratio.low, ratio.high) == pytest.approx(
        (math.exp(logs.mean()), math.exp(logs.mean() - half), math.exp(logs.mean() + half)))
    assert ratio.paired and ratio.num_runs == 4 and ratio.unit_sd == pytest.approx(logs.std(ddof=1))
    swapped = ratio_of_runs(base, cand, paired=True)  # symmetric in which side is the baseline
    assert (swapped.value, swapped.low, swapped.high) == pytest.approx((1 / ratio.value, 1 / ratio.high, 1 / ratio.low))


def test_an_unpaired_ratio_is_welch_s_interval_on_the_logs() -> None:
    cand, base = [110.0, 120.0, 100.0], [100.0, 105.0, 95.0, 101.0, 98.0]
    lc, lb = np.log(cand), np.log(base)
    vc, vb = lc.var(ddof=1) / 3, lb.var(ddof=1) / 5
    dof = (vc + vb) ** 2 / (vc**2 / 2 + vb**2 / 4)
    half = t95(dof) * math.sqrt(vc + vb)
    ratio = ratio_of_runs(cand, base, paired=False)
    centre = lc.mean() - lb.mean()
    assert (ratio.low, ratio.high) == pytest.approx((math.exp(centre - half), math.exp(centre + half)))
    assert not ratio.paired and ratio.num_runs == 3


def test_ratios_without_an_interval_say_so() -> None:
    assert not ratio_of_runs([2.0], [1.0], paired=True).has_interval
    some_zero = ratio_of_runs([2.0, 0.0], [1.0, 1.0], paired=True)  # a 0 has no log: the ratio of means, no interval
    assert some_zero.value == pytest.approx(1.0) and not some_zero.has_interval and some_zero.unit_sd is None
    nothing = ratio_of_runs([0.0, 0.0], [50.0, 60.0], paired=True)  # the candidate produced nothing: exactly x0
    assert (nothing.value, nothing.low, nothing.high) == (0.0, 0.0, 0.0)
    assert math.isnan(ratio_of_runs([0.0, 0.0], [0.0, 0.0], paired=True).value)  # neither measured it
    same = ratio_of_runs([30.0, 30.0], [100.0, 100.0], paired=True)  # no spread: the interval is the point
    assert (same.value, same.low, same.high) == pytest.approx((0.3, 0.3, 0.3))
    assert geometric_mean_interval([4.0, 9.0]).value == pytest.approx(6.0)


def test_the_repeats_to_settle_are_the_fewest_whose_interval_clears_the_limit() -> None:
    ratio = ratio_of_runs([1.30, 1.10, 1.45], [1.0, 1.0, 1.0], paired=True)
    assert ratio.low < 1.2 < ratio.high
    needed = repeats_to_settle(ratio, 1.2)
    distance = math.log(ratio.value) - math.log(1.2)

    def half(n: int) -> float:
        return t95(n - 1) * ratio.unit_sd / math.sqrt(n)

    assert half(needed) < distance <= half(needed - 1)
    assert repeats_to_settle(ratio, ratio.value) is None  # on the limit: nothing settles it


def test_a_paired_accuracy_difference_follows_newcombe() -> None:
    # no discordant passage: the interval is bounded by the discordance rate, where a bootstrap gives [0, 0]
    same = paired_proportion_difference([1] * 30 + [0] * 70, [1] * 30 + [0] * 70)
    assert same.value == 0 and same.low == -same.high and 0.03 < same.high < 0.04  # 3.84 / (100 + 3.84)
    half = paired_proportion_difference([1] * 16 + [0] * 16, [1] * 16 + [0] * 16)  # never zero-width, even at 50 %
    assert half.high == pytest.approx(1.959964**2 / (32 + 1.959964**2))
    # many passages: close to the Wald interval, sqrt(b + c - (b - c)^2 / n) / n
    n, only_c, only_b = 2000, 100, 60
    cand = [1] * 500 + [1] * only_c + [0] * only_b + [0] * (n - 500 - only_c - only_b)
    base = [1] * 500 + [0] * only_c + [1] * only_b + [0] * (n - 500 - only_c - only_b)
    wald = 1.959964 * math.sqrt(only_c + only_b - (only_c - only_b) ** 2 / n) / n
    diff = paired_proportion_difference(cand, base)
    assert diff.value == pytest.approx(0.02)
    assert diff.high - diff.value == pytest.approx(wald, rel=0.05) and diff.value - diff.low == pytest.approx(wald, rel=0.05)
    # small and lopsided: inside [-1, 1], excludes 0 when only one side wins many passages
    lopsided = paired_proportion_difference([0] * 10, [1] * 10)
    assert lopsided.low == lopsided.value == -1 < lopsided.high < 0


def test_mcnemar_exact_is_the_binomial_on_discordant_passages() -> None:
    assert mcnemar_exact_p([1] * 6 + [0] * 4, [0] * 6 + [0] * 4) == pytest.approx(2 * 0.5**6)
    assert mcnemar_exact_p([1, 0, 1], [1, 0, 1]) == 1.0


def test_the_perplexity_ratio_is_paired_over_passages() -> None:
    rng = np.random.default_rng(0)
    base = rng.uniform(1, 4, 200)
    cand = base + 0.1  # 0.1 nats more on every passage, one token each
    ratio = paired_perplexity_ratio(cand, base, [1] * 200, [1] * 200)
    assert ratio.value == pytest.approx(math.exp(0.1)) and ratio.low == pytest.approx(ratio.high)
    # each side per its own tokens: a tokenizer that splits every target in two halves the NLL per token
    split = paired_perplexity_ratio(base, base, [2] * 200, [1] * 200)
    assert split.value == pytest.approx(math.exp(base.sum() / 400 - base.sum() / 200))
