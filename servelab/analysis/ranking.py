"""Several candidates, one answer: the candidates that meet every limit, ranked by the plan's chosen gain, with the
intervals of the differences between them.

Pure: takes the candidates' run sets and verdicts (servelab/analysis/verdict.py) and the level the serving criteria
were judged at; returns a Ranking. No database, no clock.

NOTE: only an accepted candidate is ranked (a rejected one failed a limit or missed the gain goal; an inconclusive
one may still fail one). Ranked candidates are ordered by their ratio to the baseline's figure, and each pair of
them is compared directly: candidate / candidate per round (both measured in the same rounds, so the pairing
cancels the round's drift as it does against the baseline), a Student-t interval on the log ratios. The pairs'
intervals are Bonferroni-adjusted, each read at 1 - (1 - level) / number of pairs, so that together they miss at
most what one criterion's interval may; two candidates whose interval holds 1 cannot be told apart on this figure.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from itertools import combinations
from typing import Any, Sequence

from servelab.analysis.stats import LEVEL, Estimate
from servelab.analysis.verdict import (THROUGHPUT_METRICS, GainGoal, Limits, RunSet, Verdict, paired_runs, run_ratio,
                                       summary_metric)


def rank_metric(limits: Limits, rank_by: str | None) -> tuple[str, bool]:
    """The figure the ranking orders by (the plan's rank_by, else its first gain goal's) and whether higher is
    better (a goal's min_ratio, or a throughput figure; lower for memory and cost)."""
    metric = rank_by or limits.gains[0].metric
    goal: GainGoal | None = next((g for g in limits.gains if g.metric == metric), None)
    if goal is not None:
        return metric, goal.min_ratio is not None
    return metric, metric in THROUGHPUT_METRICS


@dataclass(frozen=True)
class Ranked:
    name: str
    versus_baseline: Estimate  # candidate / baseline of the ranking figure, at the criteria's level


@dataclass(frozen=True)
class PairDifference:
    better: str  # ranked above
    worse: str
    ratio: Estimate  # better / worse of the ranking figure, at the pairs' adjusted level
    told_apart: bool  # the interval excludes 1 on the better side


@dataclass(frozen=True)
class Ranking:
    metric: str
    higher_is_better: bool
    level: float  # each pair's interval
    ranked: tuple[Ranked, ...]  # best first
    pairs: tuple[PairDifference, ...]
    not_ranked: tuple[tuple[str, str], ...]  # (candidate, why)

    @property
    def summary(self) -> str:
        """The answer in words: the best candidate, or the leaders that cannot be told apart, or none."""
        if not self.ranked:
            return "no candidate meets every limit: nothing to rank"
        best = self.ranked[0].name
        tied = [p.worse for p in self.pairs if p.better == best and not p.told_apart]
        if len(self.ranked) == 1:
            return f"{best} is the only candidate that meets every limit"
        if not tied:
            return f"best: {best}, ahead of every other candidate that meets every limit on {self.metric}"
        return (f"{', '.join([best, *tied])} meet every limit and cannot be told apart on {self.metric} (each pair's "
                f"interval holds x1): choose among them by another figure, or measure more rounds")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "summary": self.summary}


def rank(candidates: Sequence[RunSet], verdicts: Sequence[Verdict], limits: Limits, *, rank_by: str | None = None,
         level: float = LEVEL) -> Ranking:
    """Rank the accepted candidates by the ranking figure; `level`: the serving criteria's (95 %, or a sequential
    comparison's). A candidate's run set and verdict are matched by name."""
    metric, higher = rank_metric(limits, rank_by)
    by_name = {c.name: c for c in candidates}
    accepted, not_ranked = [], []
    for v in verdicts:
        if v.decision == "accept":
            accepted.append((v.candidate, _versus_baseline(v, metric)))
        else:
            not_ranked.append((v.candidate, v.reason))  # NOTE: a reason opens with its decision ("rejected: ...")
    # NOTE: a figure with no value (nan) sorts last; ties keep the plan's order
    accepted.sort(key=lambda pair: _sort_key(pair[1].value, higher))
    num_pairs = len(accepted) * (len(accepted) - 1) // 2
    pair_level = 1 - (1 - level) / max(num_pairs, 1)
    pairs = []
    for (better, _), (worse, _) in combinations(accepted, 2):
        a, b = by_name[better], by_name[worse]
        ratio = run_ratio(b, a, summary_metric(metric), paired_runs(b, a), pair_level)
        pairs.append(PairDifference(better, worse, ratio, _told_apart(ratio, higher)))
    return Ranking(metric, higher, pair_level, tuple(Ranked(n, e) for n, e in accepted), tuple(pairs),
                   tuple(not_ranked))


def _versus_baseline(verdict: Verdict, metric: str) -> Estimate:
    """The gain criterion's estimate where the figure is a goal (its interval at the criteria's level, a sequential
    comparison's included), else the figures table's (95 %)."""
    goal = next((c for c in verdict.criteria if c.kind == "gain" and c.name == metric), None)
    if goal is not None:
        return goal.measured
    figure = next((f for f in verdict.figures if f.name == metric), None)
    return figure.ratio if figure is not None and figure.ratio is not None else Estimate(float("nan"))


def _sort_key(value: float, higher: bool) -> float:
    if not math.isfinite(value):
        return math.inf
    return -value if higher else value


def _told_apart(ratio: Estimate, higher: bool) -> bool:
    if not ratio.has_interval or not math.isfinite(ratio.value):
        return False
    return ratio.low > 1 if higher else ratio.high < 1
