"""Several candidates, one answer, pure: the accepted candidates ranked by the plan's figure, each pair's interval
(told apart or not), the others left out with their reason, and the plan's exit decision over several candidates."""

from __future__ import annotations

import math

import numpy as np
import pytest

from servelab.analysis.ranking import rank, rank_metric
from servelab.analysis.report import decision_of, format_ranking
from servelab.analysis.verdict import GainGoal, compare
from tests.analysis.test_verdict import BASE, LIMITS, run_set


def candidates():
    """Four candidates against BASE (about 100 tokens/s over 4 rounds): two clearly fast ones that differ by x1.15
    consistently, one fast one a few percent behind the second (not told apart from it), one too slow (rejected)."""
    fast = run_set("fast", tokens_per_s=(172.0, 176.0, 170.0, 173.0), tpot_ms=50.0, correct=34)
    second = run_set("second", tokens_per_s=(150.0, 153.0, 148.0, 151.0), tpot_ms=50.0, correct=34)
    close = run_set("close", tokens_per_s=(149.0, 155.0, 146.0, 150.0), tpot_ms=50.0, correct=34)
    slow = run_set("slow", tokens_per_s=(104.0, 105.0, 101.0, 103.0), tpot_ms=50.0, correct=34)
    return [second, slow, close, fast]


def test_accepted_candidates_are_ranked_best_first_and_each_pair_says_whether_it_can_be_told_apart() -> None:
    sets = candidates()
    verdicts = [compare(BASE, c, LIMITS) for c in sets]
    assert [v.decision for v in verdicts] == ["accept", "reject", "accept", "accept"]
    ranking = rank(sets, verdicts, LIMITS)
    assert (ranking.metric, ranking.higher_is_better) == ("output_tokens_per_s", True)
    assert [r.name for r in ranking.ranked] == ["fast", "second", "close"]
    assert ranking.ranked[0].versus_baseline.low > 1.2  # the figure against the baseline, with its interval
    assert ranking.not_ranked[0][0] == "slow" and ranking.not_ranked[0][1].startswith("rejected: the gain")
    assert ranking.level == pytest.approx(1 - 0.05 / 3)  # three pairs, Bonferroni
    pairs = {(p.better, p.worse): p for p in ranking.pairs}
    assert set(pairs) == {("fast", "second"), ("fast", "close"), ("second", "close")}
    assert pairs["fast", "second"].told_apart and pairs["fast", "close"].told_apart
    assert not pairs["second", "close"].told_apart
    ratio = pairs["fast", "second"].ratio  # fast / second per round, paired
    per_round = np.array([172.0, 176.0, 170.0, 173.0]) / np.array([150.0, 153.0, 148.0, 151.0])
    assert ratio.value == pytest.approx(math.exp(np.log(per_round).mean())) and ratio.low > 1
    close = pairs["second", "close"].ratio
    assert close.low < 1 < close.high
    assert ranking.summary.startswith("best: fast")
    printed = format_ranking(ranking)
    assert "1. fast: x1.7" in printed and "second / close" in printed and "cannot be told apart" in printed
    assert "not ranked: slow" in printed


def test_leaders_that_cannot_be_told_apart_are_named_together() -> None:
    sets = candidates()[::2]  # second, close
    ranking = rank(sets, [compare(BASE, c, LIMITS) for c in sets], LIMITS)
    assert [r.name for r in ranking.ranked] == ["second", "close"] and ranking.level == pytest.approx(0.95)
    assert ranking.summary.startswith("second, close meet every limit and cannot be told apart")


def test_a_memory_figure_ranks_lower_first_and_an_equal_figure_is_not_told_apart() -> None:
    small = run_set("small", tokens_per_s=(150.0, 153.0, 148.0, 151.0), tpot_ms=50.0, correct=34, weight_bytes=30)
    smaller = run_set("smaller", tokens_per_s=(140.0, 143.0, 138.0, 141.0), tpot_ms=50.0, correct=34,
                      weight_bytes=20)
    same = run_set("same", tokens_per_s=(160.0, 163.0, 158.0, 161.0), tpot_ms=50.0, correct=34, weight_bytes=20)
    limits = LIMITS.model_copy(update={"gains": (GainGoal(metric="weight_bytes", max_ratio=0.5),)})
    assert rank_metric(limits, None) == ("weight_bytes", False)
    assert rank_metric(LIMITS, "kv_cache_peak_bytes") == ("kv_cache_peak_bytes", False)  # not a goal: by its kind
    sets = [small, smaller, same]
    ranking = rank(sets, [compare(BASE, c, limits) for c in sets], limits)
    assert [r.name for r in ranking.ranked] == ["smaller", "same", "small"]
    pairs = {(p.better, p.worse): p for p in ranking.pairs}
    assert not pairs["smaller", "same"].told_apart and pairs["same", "small"].told_apart
    by_speed = rank(sets, [compare(BASE, c, limits) for c in sets], limits, rank_by="output_tokens_per_s")
    assert [r.name for r in by_speed.ranked] == ["same", "small", "smaller"] and by_speed.higher_is_better


def test_no_accepted_candidate_leaves_nothing_to_rank() -> None:
    slow = candidates()[1]
    ranking = rank([slow], [compare(BASE, slow, LIMITS)], LIMITS)
    assert ranking.ranked == () and ranking.pairs == () and "nothing to rank" in ranking.summary


def test_a_plan_with_several_candidates_answers_accept_when_one_meets_every_limit() -> None:
    sets = candidates()
    verdicts = [compare(BASE, c, LIMITS) for c in sets]
    assert decision_of(verdicts) == "accept"  # one rejected, three accepted: the ranking names the pick
    assert decision_of(verdicts[1:2]) == "reject"  # one candidate: its own decision
    assert decision_of([verdicts[1], verdicts[1]]) == "reject"
    unsure = verdicts[0].__class__(**{**verdicts[0].__dict__, "decision": "inconclusive"})
    assert decision_of([verdicts[1], unsure]) == "inconclusive"
    assert decision_of([verdicts[0]]) == "accept" and decision_of([verdicts[0], verdicts[1]]) == "accept"
