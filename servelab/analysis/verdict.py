"""The comparison verdict: a candidate against the baseline, figure by figure, criterion by criterion.

Pure: takes run sets (per-run summaries and request samples, the round each run was measured in, quality
outcomes, greedy texts) and the plan's limits; returns ratios with 95 % intervals, an outcome per
criterion judged at the interval's bounds (pass / fail / unsure), the overall accept / reject /
inconclusive with what would settle it, and the warnings (more than one factor changed, other hardware,
runs not interleaved). Refuses to compare runs of different workloads. No database, no clock, no torch.

NOTE: the unit of evidence for serving figures is the run. A figure is computed per run (tokens/s, or p95
TTFT over that run's requests), runs of the two sides measured in the same round are paired, and the
interval is a Student-t one over the per-round log ratios: it carries the variation between runs, which on
a shared machine is larger than the variation between the requests of one run. Past 400 lines as one piece:
every criterion is judged by the same pairing, intervals and bounds. A sequential comparison asks for wider
intervals (Levels, from servelab/analysis/sequential.py); without them every interval is 95 %.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from servelab.analysis.factors import changed_factors
from servelab.analysis.metrics import LATENCY_METRICS, RequestSample, latency_values
from servelab.analysis.stats import (
    LEVEL,
    Estimate,
    RunRatio,
    geometric_mean_interval,
    mcnemar_exact_p,
    paired_perplexity_ratio,
    paired_proportion_difference,
    percentile,
    ratio_of_runs,
    repeats_to_settle,
    wilson_interval,
)

THROUGHPUT_METRICS = ("output_tokens_per_s", "requests_per_s", "goodput_requests_per_s")
MEMORY_METRICS = ("weight_bytes", "kv_cache_peak_bytes", "working_peak_bytes")
COST_METRICS = ("cost_per_request", "cost_per_1k_output_tokens")
GAIN_METRICS = THROUGHPUT_METRICS + MEMORY_METRICS + COST_METRICS
# NOTE: shown beside the gains, never judged: how the batch formed (rows per pass, rows preempted, the paged
# pool's share held at the KV peak); what a cache factor (capacity, eviction) changes first
SHAPE_METRICS = ("mean_batch_size", "peak_rows", "num_preempted", "kv_pool_peak_use")
HARDWARE_KEYS = ("cpu", "gpu", "num_cpus", "memory_bytes", "device")
LAMBADA_PASSAGES = 5153
Outcome = Literal["pass", "fail", "unsure"]
Decision = Literal["accept", "reject", "inconclusive"]


class ComparisonRefused(ValueError):
    """Runs that must not be compared; the message says why."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LatencyLimit(_Frozen):
    metric: Literal["ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "queue_ms"]
    percentile: Literal[50, 95, 99] = 95
    max_ratio: float | None = Field(default=None, gt=0)
    max_ms: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_bound(self) -> LatencyLimit:
        if (self.max_ratio is None) == (self.max_ms is None):
            raise ValueError("give exactly one of max_ratio (against the baseline) or max_ms")
        return self


class GainGoal(_Frozen):
    metric: Literal[GAIN_METRICS]  # type: ignore[valid-type]
    min_ratio: float | None = Field(default=None, gt=0, description="higher is better: candidate / baseline >=")
    max_ratio: float | None = Field(default=None, gt=0, description="lower is better: candidate / baseline <=")

    @model_validator(mode="after")
    def _one_bound(self) -> GainGoal:
        if (self.min_ratio is None) == (self.max_ratio is None):
            raise ValueError("give exactly one of min_ratio (e.g. tokens/s x1.2) or max_ratio (e.g. memory x0.5)")
        return self


class Limits(_Frozen):
    max_accuracy_drop: float | None = Field(default=0.02, ge=0, le=1, description=(
        "absolute LAMBADA accuracy points; null: no quality limit (the verdict then says nothing about quality)"))
    max_perplexity_ratio: float | None = Field(default=None, gt=0)
    max_long_context_perplexity_ratio: float | None = Field(default=None, gt=0, description=(
        "candidate / baseline perplexity over long texts scored far into each (quality.long_context_segments), "
        "paired by segment; null: not judged"))
    latency: tuple[LatencyLimit, ...] = ()
    gains: tuple[GainGoal, ...] = Field(min_length=1)
    gain_rule: Literal["any", "all"] = "any"


@dataclass(frozen=True)
class QualityOutcome:
    """Per-passage LAMBADA outcomes on one config, in passage order."""

    passage_ids: tuple[int, ...]
    correct: tuple[int, ...]
    nll: tuple[float, ...]
    num_target_tokens: tuple[int, ...]

    @property
    def accuracy(self) -> Estimate:
        return wilson_interval(sum(self.correct), len(self.correct))

    @property
    def perplexity(self) -> float:
        return math.exp(sum(self.nll) / max(1, sum(self.num_target_tokens)))


@dataclass(frozen=True)
class RunSet:
    """The repeats of one config on one workload, run by run."""

    name: str
    run_ids: tuple[str, ...]
    config: dict[str, Any]
    workload_fingerprint: str
    hardware: dict[str, Any]
    summaries: tuple[dict[str, Any], ...]  # RunSummary.as_dict() per run
    samples: tuple[tuple[RequestSample, ...], ...]  # per run: the requests it sent
    repeat_indices: tuple[int, ...] = ()  # per run: the round it was measured in (pairs runs across configs)
    quality: QualityOutcome | None = None
    texts: dict[int, str] = field(default_factory=dict)  # workload item -> greedy text (first repeat)
    long_context: dict[str, Any] | None = None  # per-segment NLL over long texts (servelab.lab.long_context)

    def pooled(self) -> list[RequestSample]:
        return [s for run in self.samples for s in run]


@dataclass(frozen=True)
class Levels:
    """The confidence levels a comparison's criteria are judged at: the serving criteria's (over rounds) and the
    LAMBADA criteria's (over passages); the long-context ratio is measured once and stays at 95 %.

    exact_passages: a zero accuracy-drop limit is an exact count, final only once this many passages are scored
    (a sequential comparison scores them in steps; 0: whatever was scored).
    """

    runs: float = LEVEL
    passages: float = LEVEL
    exact_passages: int = 0

    @property
    def is_fixed(self) -> bool:
        return self == Levels()


@dataclass(frozen=True)
class Figure:
    name: str
    baseline: float | None
    candidate: float | None
    ratio: Estimate | None  # candidate / baseline with its interval


@dataclass(frozen=True)
class Criterion:
    kind: str  # quality | latency | gain
    name: str
    measured: Estimate
    limit: str
    outcome: Outcome  # pass: holds at the interval's unfavourable bound; fail: fails at its favourable one
    note: str = ""
    to_settle: str = ""  # for an unsure criterion: what more data would decide it


@dataclass(frozen=True)
class Verdict:
    baseline: str
    candidate: str
    figures: tuple[Figure, ...]
    criteria: tuple[Criterion, ...]
    warnings: tuple[str, ...]
    decision: Decision
    reason: str
    repeat_checks: tuple[str, ...] = ()
    to_settle: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(baseline: RunSet, candidate: RunSet, limits: Limits, *, paired_rounds: bool = True,
            levels: Levels = Levels()) -> Verdict:
    """paired_rounds: the two sides were measured in the same rounds of one plan (False: never pair them);
    levels: the intervals' confidence levels (a sequential comparison's; default 95 %)."""
    if baseline.workload_fingerprint != candidate.workload_fingerprint:
        raise ComparisonRefused(
            f"{candidate.name} ran workload {candidate.workload_fingerprint}, the baseline {baseline.name} ran "
            f"{baseline.workload_fingerprint}: different prompts, lengths or arrivals cannot be compared; "
            "run both on the same workload file"
        )
    pairs = paired_runs(baseline, candidate) if paired_rounds else None
    criteria = [*quality_criteria(baseline, candidate, limits, levels),
                *long_context_criteria(baseline, candidate, limits),
                *latency_criteria(baseline, candidate, limits, pairs, levels.runs),
                *gain_criteria(baseline, candidate, limits, pairs, levels.runs)]
    decision, reason = overall(criteria, limits, interval="95 % interval" if levels.is_fixed else SEQUENTIAL_INTERVAL)
    checks = tuple(f"{s.name}: {run_spread(s)}" for s in (baseline, candidate))
    settle = tuple(f"{c.name}: {c.to_settle}" for c in criteria if c.outcome == "unsure" and c.to_settle) \
        if decision == "inconclusive" else ()
    return Verdict(baseline.name, candidate.name, tuple(figures(baseline, candidate, pairs)), tuple(criteria),
                   tuple(warnings(baseline, candidate, pairs)), decision, reason, checks, settle)


def judge(measured: Estimate, limit: float, *, upper_is_bad: bool) -> Outcome:
    """pass when the limit holds at the interval's unfavourable bound, fail when it fails at the favourable one."""
    if not math.isfinite(measured.value) or not measured.has_interval:
        return "unsure"
    slack = 1e-9 * max(1.0, abs(limit))  # NOTE: a figure equal to its limit holds (e.g. weights exactly x0.5)

    def holds(x: float) -> bool:
        return x <= limit + slack if upper_is_bad else x >= limit - slack

    worst, best = (measured.high, measured.low) if upper_is_bad else (measured.low, measured.high)
    if holds(worst):
        return "pass"
    return "unsure" if holds(best) else "fail"


SEQUENTIAL_INTERVAL = "sequential interval"


def overall(criteria: list[Criterion], limits: Limits, *, interval: str = "95 % interval") -> tuple[Decision, str]:
    bounds = [c for c in criteria if c.kind in ("quality", "latency")]
    gains = [c for c in criteria if c.kind == "gain"]
    if limits.gain_rule == "any":
        gain_met, gain_out = any(c.outcome == "pass" for c in gains), all(c.outcome == "fail" for c in gains)
    else:
        gain_met, gain_out = all(c.outcome == "pass" for c in gains), any(c.outcome == "fail" for c in gains)
    failed = [c for c in bounds if c.outcome == "fail"]
    if failed:
        return "reject", "rejected: " + "; ".join(f"{c.name} is {_fmt_measured(c)} (limit {c.limit})"
                                                  for c in failed) + f", beyond the limit across its {interval}"
    if gain_out:
        return "reject", f"rejected: the gain goal is out of reach across the {interval}s (" + \
            "; ".join(f"{c.name} {_fmt_measured(c)} vs {c.limit}" for c in gains) + ")"
    unsure = [c for c in bounds if c.outcome == "unsure"]
    if gain_met and not unsure:
        return "accept", "accepted: every limit holds and the gain goal is met at the unfavourable end of " \
                         f"its {interval}"
    if not gain_met:
        unsure += [c for c in gains if c.outcome == "unsure"]
    return "inconclusive", "inconclusive: " + "; ".join(
        f"{c.name} {_fmt_measured(c)} straddles {c.limit}" if c.measured.has_interval
        else f"{c.name} {_fmt_measured(c)} has no interval" for c in unsure) + \
        f" (the {interval} holds both answers, or there is none; see what would settle it)"


def paired_runs(baseline: RunSet, candidate: RunSet) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Run positions pairing the two sides by round, when each side ran exactly once in the same rounds."""
    b, c = baseline.repeat_indices, candidate.repeat_indices
    if len(b) != len(baseline.run_ids) or len(c) != len(candidate.run_ids) or len(set(b)) != len(b) \
            or set(b) != set(c) or len(set(c)) != len(c):
        return None
    rounds = sorted(b)
    return tuple(b.index(r) for r in rounds), tuple(c.index(r) for r in rounds)


def run_values(run_set: RunSet, measure) -> list[float | None]:
    return [measure(run_set, i) for i in range(len(run_set.run_ids))]


def measured_values(run_set: RunSet, measure) -> list[float]:
    """The per-run figures of the runs that have one (a run with no successful request has no percentile)."""
    return [v for v in run_values(run_set, measure) if v is not None]


def run_ratio(baseline: RunSet, candidate: RunSet, measure, pairs, level: float = LEVEL) -> RunRatio:
    """candidate / baseline of a per-run figure, paired by round where the runs pair (else Welch)."""
    base, cand = run_values(baseline, measure), run_values(candidate, measure)
    if pairs is not None:
        kept = [(base[i], cand[j]) for i, j in zip(*pairs) if base[i] is not None and cand[j] is not None]
        return ratio_of_runs([c for _, c in kept], [b for b, _ in kept], paired=True, level=level)
    return ratio_of_runs([c for c in cand if c is not None], [b for b in base if b is not None], paired=False,
                         level=level)


def summary_metric(metric: str):
    def measure(run_set: RunSet, i: int) -> float | None:
        value = run_set.summaries[i].get(metric)
        return None if value is None else float(value)
    return measure


def run_percentile(metric: str, q: float):
    """The q-th percentile of a latency over one run's successful requests (every token gap for ITL)."""
    def measure(run_set: RunSet, i: int) -> float | None:
        values = latency_values([s for s in run_set.samples[i] if s.is_success], metric)
        return percentile(values, q) if values else None
    return measure


def long_context_criteria(baseline: RunSet, candidate: RunSet, limits: Limits) -> list[Criterion]:
    """The long-context perplexity ratio (candidate / baseline), paired bootstrap over the same segments."""
    limit = limits.max_long_context_perplexity_ratio
    if limit is None:
        return []
    name = "long-context perplexity ratio"
    b, c = baseline.long_context, candidate.long_context
    if b is None or c is None:
        return [Criterion("quality", name, Estimate(float("nan")), f"<= {limit}", "unsure", "not measured",
                          "measure it: set quality.long_context_segments above 0")]
    if b["fingerprint"] != c["fingerprint"]:
        return [Criterion("quality", name, Estimate(float("nan")), f"<= {limit}", "unsure",
                          "measured on different segments (another Python's pydoc topics, length or count)",
                          "measure both configs in one plan")]
    ratio = paired_perplexity_ratio(c["nll"], b["nll"], c["num_tokens"], b["num_tokens"])
    outcome = judge(ratio, limit, upper_is_bad=True)
    return [Criterion("quality", name, ratio, f"<= {limit}", outcome,
                      f"paired bootstrap over {len(b['nll'])} segments, tokens {b.get('scored_from', '?')}+ of "
                      f"{b.get('length', '?')} scored", "measure more segments (quality.long_context_segments)"
                      if outcome == "unsure" else "")]


def quality_criteria(baseline: RunSet, candidate: RunSet, limits: Limits,
                     levels: Levels = Levels()) -> list[Criterion]:
    if limits.max_accuracy_drop is None:
        return []
    if baseline.quality is None or candidate.quality is None:
        return [Criterion("quality", "LAMBADA accuracy drop", Estimate(float("nan")), f"<= {limits.max_accuracy_drop}",
                          "unsure", "not measured", "measure it: set quality.lambada_samples above 0")]
    b, c = baseline.quality, candidate.quality
    assert b.passage_ids == c.passage_ids, "quality must be measured on the same passages"
    diff = paired_proportion_difference(c.correct, b.correct, level=levels.passages)  # candidate - baseline
    drop = Estimate(-diff.value, -diff.high, -diff.low)
    note = f"paired on {len(b.correct)} passages (Newcombe); exact McNemar p = {mcnemar_exact_p(c.correct, b.correct):.3g}"
    note += _level_note(levels.passages)
    if limits.max_accuracy_drop == 0:
        # NOTE: no interval can show a drop of exactly 0; a zero limit (same weights, another batch policy or
        # decoder) is the exact check it means: not one passage the baseline gets right may be lost
        lost = sum(1 for x, y in zip(c.correct, b.correct) if y and not x)
        outcome: Outcome = "fail" if lost else "pass" if len(b.correct) >= levels.exact_passages else "unsure"
        note = f"exact: {lost} of {len(b.correct)} passages lost (a zero limit allows none); " + note
    else:
        outcome = judge(drop, limits.max_accuracy_drop, upper_is_bad=True)
    hint = f"score {levels.exact_passages} passages (now {len(b.correct)})" if limits.max_accuracy_drop == 0 else \
        _passages_to_settle(drop, limits.max_accuracy_drop, len(b.correct), log=False)
    criteria = [Criterion("quality", "LAMBADA accuracy drop", drop, f"<= {limits.max_accuracy_drop}", outcome, note,
                          hint if outcome == "unsure" else "")]
    if limits.max_perplexity_ratio is not None:
        ratio = paired_perplexity_ratio(c.nll, b.nll, c.num_target_tokens, b.num_target_tokens, level=levels.passages)
        outcome = judge(ratio, limits.max_perplexity_ratio, upper_is_bad=True)
        criteria.append(Criterion("quality", "LAMBADA perplexity ratio", ratio, f"<= {limits.max_perplexity_ratio}",
                                  outcome, "paired bootstrap over passages" + _level_note(levels.passages),
                                  _passages_to_settle(ratio, limits.max_perplexity_ratio, len(b.correct), log=True)
                                  if outcome == "unsure" else ""))
    return criteria


def latency_criteria(baseline: RunSet, candidate: RunSet, limits: Limits, pairs,
                     level: float = LEVEL) -> list[Criterion]:
    criteria = []
    for limit in limits.latency:
        name = f"p{limit.percentile} {limit.metric}"
        measure = run_percentile(limit.metric, limit.percentile)
        candidate_values = measured_values(candidate, measure)
        if not candidate_values:
            criteria.append(Criterion("latency", name, Estimate(float("nan")), "-", "fail",
                                      "the candidate completed no request"))
            continue
        if limit.max_ratio is not None:
            measured, bound, label = run_ratio(baseline, candidate, measure, pairs, level), limit.max_ratio, \
                f"<= x{limit.max_ratio}"
            name += " ratio"
        else:
            measured = geometric_mean_interval(candidate_values, level=level)
            bound, label = limit.max_ms, f"<= {limit.max_ms} ms"
        outcome = judge(measured, bound, upper_is_bad=True)
        note = _runs_note(measured) if limit.max_ratio is not None else \
            f"t interval over the candidate's {measured.num_runs} runs (geometric mean)"
        note += _level_note(level)
        criteria.append(Criterion("latency", name, measured, label, outcome, note,
                                  _repeats_to_settle(measured, bound) if outcome == "unsure" else ""))
    return criteria


def gain_criteria(baseline: RunSet, candidate: RunSet, limits: Limits, pairs,
                  level: float = LEVEL) -> list[Criterion]:
    criteria = []
    for goal in limits.gains:
        ratio = run_ratio(baseline, candidate, summary_metric(goal.metric), pairs, level)
        bound = goal.min_ratio if goal.min_ratio is not None else goal.max_ratio
        label = f">= x{goal.min_ratio}" if goal.min_ratio is not None else f"<= x{goal.max_ratio}"
        outcome = judge(ratio, bound, upper_is_bad=goal.min_ratio is None)
        criteria.append(Criterion("gain", goal.metric, ratio, label, outcome, _runs_note(ratio) + _level_note(level),
                                  _repeats_to_settle(ratio, bound) if outcome == "unsure" else ""))
    return criteria


def figures(baseline: RunSet, candidate: RunSet, pairs=None) -> list[Figure]:
    """Every figure: per-run values averaged geometrically per side, the ratio with its interval over runs."""
    rows = []
    measures = [(metric, summary_metric(metric)) for metric in GAIN_METRICS + SHAPE_METRICS]
    measures += [(f"p{q} {metric}", run_percentile(metric, q)) for metric in LATENCY_METRICS for q in (50, 95, 99)]
    for name, measure in measures:
        b, c = _geometric_mean(baseline, measure), _geometric_mean(candidate, measure)
        if b is None and c is None:
            continue
        ratio = run_ratio(baseline, candidate, measure, pairs) if b and c else None
        rows.append(Figure(name, b, c, ratio))
    if baseline.quality and candidate.quality:
        b, c = baseline.quality, candidate.quality
        diff = paired_proportion_difference(c.correct, b.correct)
        rows.append(Figure("LAMBADA accuracy (difference)", b.accuracy.value, c.accuracy.value, diff))
        rows.append(Figure("LAMBADA perplexity", b.perplexity, c.perplexity,
                           paired_perplexity_ratio(c.nll, b.nll, c.num_target_tokens, b.num_target_tokens)))
    agreement = greedy_agreement(baseline.texts, candidate.texts)
    if agreement is not None:
        rows.append(Figure("greedy outputs equal to the baseline's", 1.0, agreement.value, agreement))
    return rows


def greedy_agreement(baseline: dict[int, str], candidate: dict[int, str]) -> Estimate | None:
    common = sorted(set(baseline) & set(candidate))
    if not common:
        return None
    return wilson_interval(sum(baseline[i] == candidate[i] for i in common), len(common))


def warnings(baseline: RunSet, candidate: RunSet, pairs=None) -> list[str]:
    found = []
    changed = changed_factors(baseline.config, candidate.config)
    if len(changed) > 1:
        found.append(f"{candidate.name} changes {len(changed)} factors ({', '.join(changed)}): the verdict cannot "
                     "say which one caused a difference; change one factor at a time")
    differing = [k for k in HARDWARE_KEYS if baseline.hardware.get(k) != candidate.hardware.get(k)]
    if differing:
        found.append(f"{candidate.name} ran on other hardware than the baseline ({', '.join(differing)} differ)")
    num_runs = min(len(baseline.summaries), len(candidate.summaries))
    if num_runs < 2:
        found.append("one run per config: no interval can be had, so no serving criterion can pass or fail; "
                     "set repeats: 2 or more (6 is the default)")
    elif pairs is None:
        found.append("the runs are not paired by round (not measured interleaved in one plan): intervals are "
                     "Welch's over unpaired runs, and drift between the two sides' runs is not cancelled")
    return found


def run_spread(run_set: RunSet, metrics: tuple[str, ...] = ("ttft_ms", "tpot_ms", "e2el_ms")) -> str:
    """How much one config's repeats differ: the coefficient of variation across runs of its per-run figures."""
    if len(run_set.summaries) < 2:
        return "one run: no spread to report"
    parts = []
    for name, measure in [("output tokens/s", summary_metric("output_tokens_per_s"))] + \
            [(f"p95 {m}", run_percentile(m, 95)) for m in metrics]:
        values = measured_values(run_set, measure)
        if len(values) >= 2 and statistics.fmean(values) > 0:
            parts.append(f"{name} {100 * statistics.stdev(values) / statistics.fmean(values):.1f} %")
    threads = run_set.hardware.get("num_threads")  # NOTE: the team's size when its worker started (runs since 12-2026)
    at = f" at {threads} thread(s)" + (" (adaptive)" if run_set.hardware.get("adaptive_threads") else "") \
        if threads else ""
    return f"{len(run_set.summaries)} runs{at}; run-to-run spread (coefficient of variation): " + ", ".join(parts)


def _geometric_mean(run_set: RunSet, measure) -> float | None:
    values = measured_values(run_set, measure)
    if not values:
        return None
    if any(v <= 0 for v in values):
        return statistics.fmean(values)
    return geometric_mean_interval(values).value


def _runs_note(measured: Estimate) -> str:
    if not isinstance(measured, RunRatio) or not measured.num_runs:
        return ""
    how = "paired by round" if measured.paired else "unpaired (Welch)"
    return f"t interval over {measured.num_runs} runs, {how}"


def _level_note(level: float) -> str:
    return "" if level == LEVEL else f"; {100 * level:.2f} % sequential interval"


def _repeats_to_settle(measured: Estimate, limit: float) -> str:
    if not isinstance(measured, RunRatio) or not math.isfinite(measured.value):
        return "measure it: a side has no value for this figure (no run completed a request, or it was not set)"
    if measured.num_runs < 2:
        return "set repeats: 2 or more, so the runs give an interval"
    if measured.unit_sd is None:
        return "some runs measured 0 (no log-scale interval): find out why those runs produced nothing"
    needed = repeats_to_settle(measured, limit)
    if needed is None:
        return "no practical number of repeats: the estimate sits on the limit, within the run-to-run noise"
    return f"about {needed} repeats per config, if the run-to-run spread stays as measured (now {measured.num_runs})"


def _passages_to_settle(measured: Estimate, limit: float, num_passages: int, *, log: bool) -> str:
    if not measured.has_interval or not math.isfinite(measured.value):
        return "measure more passages: set quality.lambada_samples to 2 or more"
    f = (lambda x: math.log(x)) if log else (lambda x: x)
    distance = abs(f(measured.value) - f(limit))
    half = f(measured.high) - f(measured.value) if measured.value <= limit else f(measured.value) - f(measured.low)
    if distance == 0 or half <= 0:
        return "no practical number of passages: the estimate sits on the limit"
    needed = math.ceil(num_passages * (half / distance) ** 2)
    if needed > LAMBADA_PASSAGES:
        return f"more passages than LAMBADA holds ({LAMBADA_PASSAGES:,}): the difference is too close to the limit"
    return f"about {needed} LAMBADA passages (quality.lambada_samples; now {num_passages})"


def _fmt_measured(c: Criterion) -> str:
    if not math.isfinite(c.measured.value):
        return "not measured"
    value = f"x{c.measured.value:.3f}" if "ratio" in c.name or c.kind == "gain" else f"{c.measured.value + 0.0:.3g}"
    if c.measured.has_interval:
        value += f" [{c.measured.low:.3g}, {c.measured.high:.3g}]"
    return value
