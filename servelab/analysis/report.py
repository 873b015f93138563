"""The printed report of a comparison: each candidate's verdict, criteria and figures as a table, and the plan's
one answer over every candidate.

Pure formatting of the Verdicts servelab/analysis/verdict.py reaches; prints nothing itself.
"""

from __future__ import annotations

import math

from servelab.analysis.ranking import Ranking
from servelab.analysis.sequential import ALPHA, SequentialRecord
from servelab.analysis.verdict import COST_METRICS, Limits, Verdict

NO_PRICE = "no price set: set SERVELAB_PRICE_PER_HOUR (the machine's price per hour) when running"


def format_verdicts(verdicts: tuple[Verdict, ...] | list[Verdict]) -> str:
    lines = []
    for v in verdicts:
        lines.append(f"== {v.candidate} vs {v.baseline}: {v.decision.upper()} ==")
        lines.append(f"   {v.reason}")
        for hint in v.to_settle:
            lines.append(f"   to settle: {hint}")
        for w in v.warnings:
            lines.append(f"   warning: {w}")
        for check in v.repeat_checks:
            lines.append(f"   runs: {check}")
        # NOTE: a sequential comparison's criteria are read at its looks' level (each note says which), not 95 %
        header = "interval" if any("sequential interval" in c.note for c in v.criteria) else "95% interval"
        lines.append(f"   {'criterion':<34} {'measured':>10} {header:>22} {'limit':>10}  result")
        for c in v.criteria:
            interval = f"[{c.measured.low:.3g}, {c.measured.high:.3g}]" if c.measured.has_interval else "-"
            lines.append(f"   {c.kind + ': ' + c.name:<34} {c.measured.value + 0.0:>10.3g} {interval:>22} {c.limit:>10}  "
                         f"{OUTCOME_LABELS[c.outcome]:<6} {c.note}")
        lines.append(f"   {'figure':<40} {'baseline':>12} {'candidate':>12} {'ratio':>8} {'95% interval':>20}")
        for f in v.figures:
            if f.name in COST_METRICS and not (f.baseline or f.candidate):
                lines.append(f"   {f.name:<40} {NO_PRICE}")
                continue
            ratio, interval = _ratio(f), "-"
            if ratio != "-" and f.ratio.has_interval:
                interval = f"[{f.ratio.low:+.3f}, {f.ratio.high:+.3f}]" if _is_difference(f) else \
                    f"[{f.ratio.low:.3f}, {f.ratio.high:.3f}]"
            lines.append(f"   {f.name:<40} {_num(f.baseline):>12} {_num(f.candidate):>12} {ratio:>8} {interval:>20}")
    return "\n".join(lines)


OUTCOME_LABELS = {"pass": "pass", "fail": "FAIL", "unsure": "unsure"}


def format_sequential(record: SequentialRecord) -> str:
    """How a comparison run until settled went: why it stopped, the levels its looks read, what settled each
    candidate and when."""
    spec, levels = record.spec, record.levels
    lines = [f"until settled: {record.stop}",
             f"   intervals: {100 * ALPHA:g} % spent over each criterion's planned looks: serving criteria at "
             f"{100 * levels.runs:.2f} % ({spec.num_round_looks} looks, rounds {spec.min_rounds}-{spec.max_rounds}), "
             f"LAMBADA at {100 * levels.passages:.2f} % ({spec.num_passage_looks} looks, {spec.passage_step} passages "
             f"a step up to {spec.max_passages}); a criterion is kept as the look that settled it read it"]
    lines += [f"   {record.settled_by(name)}" for name in record.verdicts]
    lines += [f"   {name}: rejected at look {record.decided_at[name]}, measured no more after it"
              for name in sorted(record.rejected) if record.decided_at[name] < len(record.looks)]
    for look in record.looks:
        lines.append(f"   look {look.index}: {look.num_rounds} rounds, {look.num_passages} passages, "
                     f"{look.minutes:.1f} min")
    return "\n".join(lines)


def format_ranking(ranking: Ranking) -> str:
    """The candidates that meet every limit, best first by the ranking figure, each pair's difference, and those
    left out and why."""
    better = "higher" if ranking.higher_is_better else "lower"
    lines = [f"ranking by {ranking.metric} ({better} is better): {ranking.summary}"]
    for place, r in enumerate(ranking.ranked, 1):
        e = r.versus_baseline
        interval = f" [{e.low:.3f}, {e.high:.3f}]" if e.has_interval else ""
        lines.append(f"   {place}. {r.name}: x{e.value:.3f}{interval} the baseline's")
    for p in ranking.pairs:
        e = p.ratio
        interval = f"[{e.low:.3f}, {e.high:.3f}]" if e.has_interval else "no interval"
        told = "told apart" if p.told_apart else "cannot be told apart"
        lines.append(f"   {p.better} / {p.worse}: x{e.value:.3f} {interval} ({100 * ranking.level:.2f} % interval, "
                     f"paired by round): {told}")
    lines += [f"   not ranked: {name} ({why})" for name, why in ranking.not_ranked]
    return "\n".join(lines)


def decision_of(verdicts) -> str:
    """The plan's answer. One candidate: its decision. Several (a plan that picks one): accept when one meets every
    limit (the ranking names the best), else inconclusive while one may still, else reject."""
    decisions = {v.decision for v in verdicts}
    order = ("reject", "inconclusive", "accept") if len(verdicts) == 1 else ("accept", "inconclusive", "reject")
    return next(d for d in order if d in decisions or d == order[-1])


def _is_difference(figure) -> bool:
    return "difference" in figure.name


def _ratio(figure) -> str:
    """x1.234 for a ratio, +0.012 for a difference, - where there is none (e.g. a side measured 0)."""
    if figure.ratio is None or not math.isfinite(figure.ratio.value):
        return "-"
    return f"{figure.ratio.value + 0.0:+.3f}" if _is_difference(figure) else f"x{figure.ratio.value:.3f}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def limit_rows(limits: Limits) -> list[dict[str, str]]:
    """A plan's limits as a reader's table: each criterion, its limit and which way it bounds."""
    rows = []
    if limits.max_accuracy_drop is not None:
        rows.append(("quality: LAMBADA accuracy drop", f"{limits.max_accuracy_drop} points", "at most"))
    if limits.max_perplexity_ratio is not None:
        rows.append(("quality: LAMBADA perplexity", f"x{limits.max_perplexity_ratio} the baseline's", "at most"))
    if limits.max_long_context_perplexity_ratio is not None:
        rows.append(("quality: long-context perplexity", f"x{limits.max_long_context_perplexity_ratio} the "
                     "baseline's", "at most"))
    for lat in limits.latency:
        bound = f"x{lat.max_ratio} the baseline's" if lat.max_ratio is not None else f"{lat.max_ms} ms"
        rows.append((f"latency: p{lat.percentile} {lat.metric}", bound, "at most"))
    for goal in limits.gains:
        ratio = goal.min_ratio if goal.min_ratio is not None else goal.max_ratio
        rows.append((f"gain: {goal.metric}", f"x{ratio} the baseline's",
                     "at least" if goal.min_ratio is not None else "at most"))
    if len(limits.gains) > 1:
        rows.append(("gains that must hold", "every one" if limits.gain_rule == "all" else "any one", "-"))
    return [{"criterion": c, "limit": limit, "direction": d} for c, limit, d in rows]


def is_priced(cost_per_request: float | None) -> bool:
    """Whether a run's cost figure was priced: a run made without SERVELAB_PRICE_PER_HOUR costs 0."""
    return bool(cost_per_request)
