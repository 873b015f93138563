"""The comparison verdict: a candidate against the baseline, figure by figure, criterion by criterion.

Pure: takes run sets (summaries, pooled per-request samples, quality outcomes, greedy texts) and the
plan's limits; returns ratios with 95 % intervals, a pass / fail per criterion with the reason, the
overall accept / reject, and the warnings (more than one factor changed, other hardware). Refuses to
compare runs of different workloads. No database, no clock, no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from servelab.lab.metrics import LATENCY_METRICS, RequestSample, latency_values
from servelab.lab.stats import (
    Estimate,
    bootstrap_ratio,
    mean_interval,
    mean_of,
    paired_difference,
    percentile,
    percentile_of,
    wilson_interval,
)

THROUGHPUT_METRICS = ("output_tokens_per_s", "requests_per_s", "goodput_requests_per_s")
MEMORY_METRICS = ("weight_bytes", "kv_cache_peak_bytes", "working_peak_bytes")
COST_METRICS = ("cost_per_request", "cost_per_1k_output_tokens")
GAIN_METRICS = THROUGHPUT_METRICS + MEMORY_METRICS + COST_METRICS
# NOTE: the factors a comparison varies; a candidate should change exactly one of them.
FACTORS = {"model": ("model",), "weight precision": ("weights", "awq"), "cache precision": ("kv_cache_dtype",),
           "batching": ("batching",), "decoding limits": ("decoding",), "device": ("device",),
           "threads": ("num_threads",)}
HARDWARE_KEYS = ("cpu", "gpu", "num_cpus", "memory_bytes", "device")


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
    max_accuracy_drop: float = Field(default=0.02, ge=0, le=1, description="absolute LAMBADA accuracy points")
    max_perplexity_ratio: float | None = Field(default=None, gt=0)
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
    """The repeats of one config on one workload."""

    name: str
    run_ids: tuple[str, ...]
    config: dict[str, Any]
    workload_fingerprint: str
    hardware: dict[str, Any]
    summaries: tuple[dict[str, Any], ...]  # RunSummary.as_dict() per repeat
    samples: tuple[RequestSample, ...]  # pooled over repeats
    quality: QualityOutcome | None = None
    texts: dict[int, str] = field(default_factory=dict)  # workload item -> greedy text (first repeat)


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
    passed: bool
    note: str = ""


@dataclass(frozen=True)
class Verdict:
    baseline: str
    candidate: str
    figures: tuple[Figure, ...]
    criteria: tuple[Criterion, ...]
    warnings: tuple[str, ...]
    accepted: bool
    reason: str
    repeat_checks: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(baseline: RunSet, candidate: RunSet, limits: Limits) -> Verdict:
    if baseline.workload_fingerprint != candidate.workload_fingerprint:
        raise ComparisonRefused(
            f"{candidate.name} ran workload {candidate.workload_fingerprint}, the baseline {baseline.name} ran "
            f"{baseline.workload_fingerprint}: different prompts, lengths or arrivals cannot be compared; "
            "run both on the same workload file"
        )
    criteria = [*quality_criteria(baseline, candidate, limits), *latency_criteria(baseline, candidate, limits),
                *gain_criteria(baseline, candidate, limits)]
    accepted, reason = overall(criteria, limits)
    checks = tuple(f"{s.name}: {repeat_agreement(s.summaries)}" for s in (baseline, candidate))
    return Verdict(baseline.name, candidate.name, tuple(figures(baseline, candidate)), tuple(criteria),
                   tuple(warnings(baseline, candidate)), accepted, reason, checks)


def overall(criteria: list[Criterion], limits: Limits) -> tuple[bool, str]:
    failed_limits = [c for c in criteria if c.kind in ("quality", "latency") and not c.passed]
    gains = [c for c in criteria if c.kind == "gain"]
    gain_met = any(c.passed for c in gains) if limits.gain_rule == "any" else all(c.passed for c in gains)
    if failed_limits:
        return False, "rejected: " + "; ".join(f"{c.name} is {_fmt_value(c)} (limit {c.limit})" for c in failed_limits)
    if not gain_met:
        return False, "rejected: within limits but short of the gain goal (" + \
            "; ".join(f"{c.name} {_fmt(c.measured.value)} vs {c.limit}" for c in gains) + ")"
    return True, "accepted: quality and latency within limits, and the gain goal met"


def quality_criteria(baseline: RunSet, candidate: RunSet, limits: Limits) -> list[Criterion]:
    if baseline.quality is None or candidate.quality is None:
        return [Criterion("quality", "LAMBADA accuracy drop", Estimate(float("nan")), f"<= {limits.max_accuracy_drop}",
                          False, "not measured: set quality.lambada_samples above 0")]
    b, c = baseline.quality, candidate.quality
    assert b.passage_ids == c.passage_ids, "quality must be measured on the same passages"
    diff = paired_difference(c.correct, b.correct)  # candidate - baseline
    drop = Estimate(-diff.value, -diff.high if diff.has_interval else None, -diff.low if diff.has_interval else None)
    criteria = [Criterion("quality", "LAMBADA accuracy drop", drop, f"<= {limits.max_accuracy_drop}",
                          drop.value <= limits.max_accuracy_drop + 1e-12,
                          _note(drop, limits.max_accuracy_drop, upper_is_bad=True))]
    if limits.max_perplexity_ratio is not None:
        ratio = Estimate(c.perplexity / b.perplexity)
        criteria.append(Criterion("quality", "LAMBADA perplexity ratio", ratio, f"<= {limits.max_perplexity_ratio}",
                                  ratio.value <= limits.max_perplexity_ratio))
    return criteria


def latency_criteria(baseline: RunSet, candidate: RunSet, limits: Limits) -> list[Criterion]:
    criteria = []
    for limit in limits.latency:
        name = f"p{limit.percentile} {limit.metric}"
        base = latency_values([s for s in baseline.samples if s.is_success], limit.metric)
        cand = latency_values([s for s in candidate.samples if s.is_success], limit.metric)
        if not base or not cand:
            criteria.append(Criterion("latency", name, Estimate(float("nan")), "-", False, "no successful requests"))
            continue
        stat = percentile_of(limit.percentile)
        if limit.max_ratio is not None:
            ratio = bootstrap_ratio(cand, base, stat, num_resamples=500)
            criteria.append(Criterion("latency", name + " ratio", ratio, f"<= x{limit.max_ratio}",
                                      ratio.value <= limit.max_ratio, _note(ratio, limit.max_ratio, upper_is_bad=True)))
        else:
            value = Estimate(float(stat(np.asarray(cand))))
            criteria.append(Criterion("latency", name, value, f"<= {limit.max_ms} ms", value.value <= limit.max_ms))
    return criteria


def gain_criteria(baseline: RunSet, candidate: RunSet, limits: Limits) -> list[Criterion]:
    criteria = []
    for goal in limits.gains:
        ratio = summary_ratio(baseline, candidate, goal.metric)
        if goal.min_ratio is not None:
            passed, limit = ratio.value >= goal.min_ratio, f">= x{goal.min_ratio}"
            note = _note(ratio, goal.min_ratio, upper_is_bad=False)
        else:
            passed, limit = ratio.value <= goal.max_ratio, f"<= x{goal.max_ratio}"
            note = _note(ratio, goal.max_ratio, upper_is_bad=True)
        criteria.append(Criterion("gain", goal.metric, ratio, limit, passed, note))
    return criteria


def summary_ratio(baseline: RunSet, candidate: RunSet, metric: str) -> Estimate:
    """candidate / baseline of a per-run figure; the interval comes from the repeats (two or more each)."""
    base = [s[metric] for s in baseline.summaries if s.get(metric) is not None]
    cand = [s[metric] for s in candidate.summaries if s.get(metric) is not None]
    if not base or not cand or np.mean(base) == 0:
        return Estimate(float("nan"))
    return bootstrap_ratio(cand, base, mean_of, num_resamples=500)


def figures(baseline: RunSet, candidate: RunSet) -> list[Figure]:
    rows = []
    for metric in GAIN_METRICS:
        b, c = _mean_of(baseline, metric), _mean_of(candidate, metric)
        rows.append(Figure(metric, b, c, summary_ratio(baseline, candidate, metric) if b and c is not None else None))
    for metric in LATENCY_METRICS:
        base = latency_values([s for s in baseline.samples if s.is_success], metric)
        cand = latency_values([s for s in candidate.samples if s.is_success], metric)
        # NOTE: ITL pools every token gap (10^5 and more): its ratio is shown without a bootstrap interval.
        resamples = 0 if metric == "itl_ms" else 200
        for q in (50, 95, 99):
            if base and cand:
                ratio = bootstrap_ratio(cand, base, percentile_of(q), num_resamples=resamples)
                rows.append(Figure(f"p{q} {metric}", percentile(base, q), percentile(cand, q), ratio))
    if baseline.quality and candidate.quality:
        b, c = baseline.quality, candidate.quality
        rows.append(Figure("LAMBADA accuracy", b.accuracy.value, c.accuracy.value, None))
        rows.append(Figure("LAMBADA perplexity", b.perplexity, c.perplexity, Estimate(c.perplexity / b.perplexity)))
    agreement = greedy_agreement(baseline.texts, candidate.texts)
    if agreement is not None:
        rows.append(Figure("greedy outputs equal to the baseline's", 1.0, agreement.value, agreement))
    return rows


def greedy_agreement(baseline: dict[int, str], candidate: dict[int, str]) -> Estimate | None:
    common = sorted(set(baseline) & set(candidate))
    if not common:
        return None
    return wilson_interval(sum(baseline[i] == candidate[i] for i in common), len(common))


def warnings(baseline: RunSet, candidate: RunSet) -> list[str]:
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
        found.append("one run per config: throughput and memory ratios have no interval; set repeats: 2 or more")
    return found


def repeat_agreement(summaries: tuple[dict[str, Any], ...], metrics: tuple[str, ...] = ("ttft_ms", "tpot_ms",
                                                                                       "e2el_ms")) -> str:
    """Do the repeats of one config agree? Their p95 latencies' 95 % intervals must overlap pairwise."""
    if len(summaries) < 2:
        return "one run: nothing to check repeats against"
    disagree = []
    for metric in metrics:
        intervals = [s["latency"][metric] for s in summaries if metric in s.get("latency", {})]
        estimates = [Estimate(i["p95"], i.get("p95_low"), i.get("p95_high")) for i in intervals]
        if any(not a.overlaps(b) for k, a in enumerate(estimates) for b in estimates[k + 1:]):
            disagree.append(f"p95 {metric} " + ", ".join(f"{e.value:.0f}" for e in estimates))
    if disagree:
        return f"{len(summaries)} repeats DISAGREE beyond their 95 % intervals: " + "; ".join(disagree)
    return f"{len(summaries)} repeats agree within their 95 % intervals (p95 {', '.join(metrics)})"


def changed_factors(baseline_config: dict[str, Any], candidate_config: dict[str, Any]) -> list[str]:
    return [factor for factor, keys in FACTORS.items()
            if any(baseline_config.get(k) != candidate_config.get(k) for k in keys)]


def _mean_of(run_set: RunSet, metric: str) -> float | None:
    values = [s[metric] for s in run_set.summaries if s.get(metric) is not None]
    return mean_interval(values).value if values else None


def _note(measured: Estimate, limit: float, *, upper_is_bad: bool) -> str:
    if not measured.has_interval or not (measured.low <= limit <= measured.high):
        return ""
    return "(the 95 % interval crosses the limit: more repeats or samples would settle it)"


def _fmt(value: float) -> str:
    return f"x{value:.2f}" if math.isfinite(value) else "n/a"


def _fmt_value(c: Criterion) -> str:
    if not math.isfinite(c.measured.value):
        return "not measured"
    return _fmt(c.measured.value) if "ratio" in c.name or c.kind == "gain" else f"{c.measured.value:.3g}"
