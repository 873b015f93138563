"""The verdict on hand-made run sets: every reason to reject, the one-factor warning, and refusals."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pytest

from servelab.lab.metrics import RequestSample
from servelab.lab.verdict import (
    ComparisonRefused,
    GainGoal,
    LatencyLimit,
    Limits,
    QualityOutcome,
    RunSet,
    changed_factors,
    compare,
)

CONFIG = {"name": "base", "model": "bundled:smollm2-135m-instruct", "weights": "fp32", "kv_cache_dtype": "auto",
          "device": "cpu", "num_threads": 1, "batching": {"max_batch_size": 16}, "decoding": {}, "awq": None}
HARDWARE = {"cpu": "AMD EPYC", "gpu": None, "num_cpus": 2, "memory_bytes": 1, "device": "cpu"}
LIMITS = Limits(max_accuracy_drop=0.02, latency=(LatencyLimit(metric="tpot_ms", percentile=95, max_ratio=1.1),),
                gains=(GainGoal(metric="output_tokens_per_s", min_ratio=1.2),))


def samples(tpot_ms: float, n: int = 40, seed: int = 0) -> tuple[RequestSample, ...]:
    rng = np.random.default_rng(seed)
    now = datetime.now(UTC)
    return tuple(RequestSample(f"r{i}", True, now, now, 16, 1.0, 100.0, float(tpot_ms * rng.uniform(0.95, 1.05)),
                               1000.0, (tpot_ms,) * 15) for i in range(n))


def quality(num_correct: int, n: int = 100) -> QualityOutcome:
    return QualityOutcome(tuple(range(n)), tuple([1] * num_correct + [0] * (n - num_correct)), tuple([2.0] * n),
                          tuple([1] * n))


def run_set(name: str, *, tokens_per_s: tuple[float, ...], tpot_ms: float, correct: int, config=None,
            hardware=None, fingerprint: str = "w1", weight_bytes: int = 100) -> RunSet:
    summaries = tuple({"output_tokens_per_s": t, "weight_bytes": weight_bytes} for t in tokens_per_s)
    return RunSet(name, tuple(f"{name}-{i}" for i in range(len(tokens_per_s))), {**CONFIG, **(config or {}), "name": name},
                  fingerprint, hardware or HARDWARE, summaries, samples(tpot_ms), quality(correct), {0: "Paris."})


BASE = run_set("base", tokens_per_s=(100.0, 102.0), tpot_ms=50.0, correct=34)


def test_a_candidate_within_limits_that_meets_the_gain_is_accepted() -> None:
    cand = run_set("bf16", tokens_per_s=(150.0, 149.0), tpot_ms=50.0, correct=34, config={"weights": "bf16"})
    verdict = compare(BASE, cand, LIMITS)
    assert verdict.accepted, verdict.reason
    assert verdict.warnings == ()
    gain = next(c for c in verdict.criteria if c.kind == "gain")
    assert gain.passed and gain.measured.value == pytest.approx(149.5 / 101.0)
    assert gain.measured.has_interval  # two repeats each


def test_a_faster_candidate_that_breaks_the_quality_limit_is_rejected_for_quality() -> None:
    cand = run_set("int4", tokens_per_s=(300.0, 310.0), tpot_ms=40.0, correct=20, config={"weights": "awq-int4"})
    verdict = compare(BASE, cand, LIMITS)
    assert not verdict.accepted
    assert "LAMBADA accuracy drop" in verdict.reason and "limit <= 0.02" in verdict.reason
    assert next(c for c in verdict.criteria if c.kind == "gain").passed  # it was faster


def test_a_candidate_within_limits_but_short_of_the_gain_goal_is_rejected_for_the_gain() -> None:
    cand = run_set("bf16", tokens_per_s=(105.0, 106.0), tpot_ms=49.0, correct=35, config={"weights": "bf16"})
    verdict = compare(BASE, cand, LIMITS)
    assert not verdict.accepted
    assert "short of the gain goal" in verdict.reason
    assert all(c.passed for c in verdict.criteria if c.kind in ("quality", "latency"))


def test_a_candidate_over_the_latency_limit_is_rejected_for_latency() -> None:
    cand = run_set("b", tokens_per_s=(200.0, 201.0), tpot_ms=80.0, correct=34, config={"weights": "bf16"})
    verdict = compare(BASE, cand, LIMITS)
    assert not verdict.accepted and "p95 tpot_ms ratio" in verdict.reason


def test_runs_on_another_workload_are_refused_with_the_reason() -> None:
    other = run_set("bf16", tokens_per_s=(150.0,), tpot_ms=50.0, correct=34, fingerprint="w2")
    with pytest.raises(ComparisonRefused, match="different prompts, lengths or arrivals cannot be compared"):
        compare(BASE, other, LIMITS)


def test_changing_two_factors_warns_and_one_factor_does_not() -> None:
    both = run_set("both", tokens_per_s=(150.0, 150.0), tpot_ms=50.0, correct=34,
                   config={"weights": "bf16", "batching": {"max_batch_size": 4}})
    verdict = compare(BASE, both, LIMITS)
    assert any("changes 2 factors (weight precision, batching)" in w for w in verdict.warnings)
    assert changed_factors(CONFIG, {**CONFIG, "batching": {"max_batch_size": 1}}) == ["batching"]
    assert changed_factors(CONFIG, {**CONFIG, "weights": "awq-int4", "awq": {"group_size": 64}}) == ["weight precision"]


def test_other_hardware_and_single_runs_are_warned_about() -> None:
    cand = run_set("bf16", tokens_per_s=(150.0,), tpot_ms=50.0, correct=34, config={"weights": "bf16"},
                   hardware={**HARDWARE, "cpu": "Intel Xeon"})
    warnings = compare(BASE, cand, LIMITS).warnings
    assert any("other hardware" in w and "cpu" in w for w in warnings)
    assert any("one run per config" in w for w in warnings)


def test_memory_goal_counts_as_a_gain_when_the_rule_is_any() -> None:
    limits = Limits(max_accuracy_drop=0.05, gains=(GainGoal(metric="output_tokens_per_s", min_ratio=1.5),
                                                  GainGoal(metric="weight_bytes", max_ratio=0.5)))
    cand = run_set("int4", tokens_per_s=(101.0, 100.0), tpot_ms=50.0, correct=33, weight_bytes=30,
                   config={"weights": "awq-int4"})
    verdict = compare(BASE, cand, limits)
    assert verdict.accepted, verdict.reason
    assert not compare(BASE, cand, limits.model_copy(update={"gain_rule": "all"})).accepted


def test_greedy_agreement_is_a_figure() -> None:
    cand = run_set("bf16", tokens_per_s=(150.0, 150.0), tpot_ms=50.0, correct=34)
    figure = next(f for f in compare(BASE, cand, LIMITS).figures if f.name.startswith("greedy outputs"))
    assert figure.candidate == 1.0


@pytest.mark.parametrize("bad", [{"metric": "tpot_ms"}, {"metric": "tpot_ms", "max_ratio": 1.1, "max_ms": 5}])
def test_a_latency_limit_needs_exactly_one_bound(bad) -> None:
    with pytest.raises(ValueError, match="exactly one of max_ratio"):
        LatencyLimit(**bad)


def test_repeats_that_agree_within_their_intervals_are_reported_so() -> None:
    from servelab.lab.verdict import repeat_agreement

    def summary(p95: float, low: float, high: float) -> dict:
        return {"latency": {"tpot_ms": {"p95": p95, "p95_low": low, "p95_high": high}}}

    assert "agree within their 95 % intervals" in repeat_agreement(
        (summary(50, 45, 55), summary(52, 48, 58)), metrics=("tpot_ms",))
    assert "DISAGREE" in repeat_agreement((summary(50, 45, 55), summary(80, 70, 90)), metrics=("tpot_ms",))
    assert "one run" in repeat_agreement((summary(50, 45, 55),))


def test_interleaved_rounds_measure_every_cell_once_per_round_and_keep_medians() -> None:
    from servelab.lab.stats import interleaved_medians

    order, figures = [], {"a": iter([(1.0, 10.0), (3.0, 30.0), (2.0, 20.0)]), "b": iter([(5.0,), (4.0,), (6.0,)])}
    messages = []
    medians = interleaved_medians(["a", "b"], lambda cell: order.append(cell) or next(figures[cell]), num_rounds=3,
                                  label=str.upper, progress=messages.append)
    assert order == ["a", "b", "a", "b", "a", "b"]  # never two rounds of one cell back to back
    assert medians == {"a": (2.0, 20.0), "b": (5.0,)}
    assert messages[:2] == ["round 1/3: A", "round 1/3: B"]
