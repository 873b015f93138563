"""The verdict on hand-made run sets: every reason to reject, the one-factor warning, and refusals."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime

import numpy as np
import pytest

from servelab.analysis.metrics import RequestSample
from servelab.analysis.stats import Estimate, RunRatio
from servelab.analysis.verdict import (
    ComparisonRefused,
    Criterion,
    GainGoal,
    LatencyLimit,
    Limits,
    QualityOutcome,
    RunSet,
    changed_factors,
    compare,
    judge,
    overall,
)

CONFIG = {"name": "base", "model": "bundled:smollm2-135m-instruct", "weights": "fp32", "kv_cache_dtype": "auto",
          "device": "cpu", "num_threads": 1, "batching": {"max_batch_size": 16}, "decoding": {}, "awq": None}
HARDWARE = {"cpu": "AMD EPYC", "gpu": None, "num_cpus": 2, "memory_bytes": 1, "device": "cpu"}
LIMITS = Limits(max_accuracy_drop=0.05, latency=(LatencyLimit(metric="tpot_ms", percentile=95, max_ratio=1.1),),
                gains=(GainGoal(metric="output_tokens_per_s", min_ratio=1.2),))


def samples(tpot_ms: float, n: int = 40, seed: int = 0) -> tuple[RequestSample, ...]:
    rng = np.random.default_rng(seed)
    now = datetime.now(UTC)
    return tuple(RequestSample(f"r{i}", True, now, now, 16, 1.0, 100.0, float(tpot_ms * rng.uniform(0.95, 1.05)),
                               1000.0, (tpot_ms,) * 15) for i in range(n))


def quality(num_correct: int, n: int = 100) -> QualityOutcome:
    return QualityOutcome(tuple(range(n)), tuple([1] * num_correct + [0] * (n - num_correct)), tuple([2.0] * n),
                          tuple([1] * n))


def run_set(name: str, *, tokens_per_s: tuple[float, ...], tpot_ms: float | tuple[float, ...], correct: int | None,
            config=None, hardware=None, fingerprint: str = "w1", weight_bytes: int = 100,
            rounds: tuple[int, ...] | None = None) -> RunSet:
    """One run per tokens/s figure, measured in rounds 0, 1, ... unless told; TPOT per run or the same for all."""
    n = len(tokens_per_s)
    tpots = tpot_ms if isinstance(tpot_ms, tuple) else (tpot_ms,) * n
    summaries = tuple({"output_tokens_per_s": t, "weight_bytes": weight_bytes} for t in tokens_per_s)
    return RunSet(name, tuple(f"{name}-{i}" for i in range(n)), {**CONFIG, **(config or {}), "name": name},
                  fingerprint, hardware or HARDWARE, summaries,
                  tuple(samples(tpot, seed=i) for i, tpot in enumerate(tpots)),
                  tuple(range(n)) if rounds is None else rounds,
                  None if correct is None else quality(correct), {0: "Paris."})


BASE = run_set("base", tokens_per_s=(100.0, 102.0, 99.0, 101.0), tpot_ms=50.0, correct=34)


def test_a_candidate_within_limits_whose_gain_holds_at_its_lower_bound_is_accepted() -> None:
    cand = run_set("bf16", tokens_per_s=(150.0, 149.0, 151.0, 150.5), tpot_ms=50.0, correct=34,
                   config={"weights": "bf16"})
    verdict = compare(BASE, cand, LIMITS)
    assert verdict.decision == "accept", verdict.reason
    assert verdict.warnings == () and verdict.to_settle == ()
    gain = next(c for c in verdict.criteria if c.kind == "gain")
    assert gain.outcome == "pass" and gain.measured.low >= 1.2
    ratios = [c / b for c, b in zip((150.0, 149.0, 151.0, 150.5), (100.0, 102.0, 99.0, 101.0))]
    assert gain.measured.value == pytest.approx(math.exp(np.mean(np.log(ratios))))  # paired by round
    assert "paired by round" in gain.note


def test_a_faster_candidate_that_breaks_the_quality_limit_is_rejected_for_quality() -> None:
    cand = run_set("int4", tokens_per_s=(300.0, 310.0, 305.0, 300.0), tpot_ms=40.0, correct=20,
                   config={"weights": "awq-int4"})
    verdict = compare(BASE, cand, LIMITS)
    assert verdict.decision == "reject"
    assert "LAMBADA accuracy drop" in verdict.reason and "limit <= 0.05" in verdict.reason
    drop = next(c for c in verdict.criteria if c.kind == "quality")
    assert drop.outcome == "fail" and drop.measured.low > 0.05 and "McNemar" in drop.note
    assert next(c for c in verdict.criteria if c.kind == "gain").outcome == "pass"  # it was faster


def test_a_gain_out_of_reach_across_its_interval_is_rejected() -> None:
    cand = run_set("bf16", tokens_per_s=(105.0, 106.0, 104.0, 105.0), tpot_ms=49.0, correct=34,
                   config={"weights": "bf16"})
    verdict = compare(BASE, cand, LIMITS)
    assert verdict.decision == "reject" and "gain goal is out of reach" in verdict.reason
    assert next(c for c in verdict.criteria if c.kind == "gain").measured.high < 1.2
    assert all(c.outcome == "pass" for c in verdict.criteria if c.kind in ("quality", "latency"))


def test_a_candidate_over_the_latency_limit_at_its_lower_bound_is_rejected_for_latency() -> None:
    cand = run_set("b", tokens_per_s=(200.0, 201.0, 199.0, 200.0), tpot_ms=80.0, correct=34,
                   config={"weights": "bf16"})
    verdict = compare(BASE, cand, LIMITS)
    assert verdict.decision == "reject" and "p95 tpot_ms ratio" in verdict.reason
    latency = next(c for c in verdict.criteria if c.kind == "latency")
    assert latency.outcome == "fail" and latency.measured.low > 1.1


def test_a_gain_whose_interval_straddles_the_goal_is_inconclusive_and_says_how_many_repeats_would_settle_it() -> None:
    cand = run_set("bf16", tokens_per_s=(110.0, 160.0, 125.0, 150.0), tpot_ms=50.0, correct=34,
                   config={"weights": "bf16"})
    verdict = compare(BASE, cand, LIMITS)
    gain = next(c for c in verdict.criteria if c.kind == "gain")
    assert gain.measured.low < 1.2 < gain.measured.high and gain.outcome == "unsure"
    assert verdict.decision == "inconclusive" and "output_tokens_per_s" in verdict.reason
    needed = int(gain.to_settle.split("about ")[1].split(" ")[0])
    assert needed > 4 and verdict.to_settle == (f"output_tokens_per_s: {gain.to_settle}",)


def test_a_latency_limit_inside_the_interval_keeps_an_otherwise_good_candidate_inconclusive() -> None:
    cand = run_set("bf16", tokens_per_s=(150.0, 149.0, 151.0, 150.5), tpot_ms=(45.0, 60.0, 52.0, 58.0),
                   correct=34, config={"weights": "bf16"})
    verdict = compare(BASE, cand, LIMITS)
    latency = next(c for c in verdict.criteria if c.kind == "latency")
    assert latency.measured.low < 1.1 < latency.measured.high and latency.outcome == "unsure"
    assert verdict.decision == "inconclusive" and "p95 tpot_ms ratio" in verdict.reason


def test_an_accuracy_drop_whose_interval_straddles_the_limit_is_inconclusive_and_names_the_passages_needed() -> None:
    base = run_set("base", tokens_per_s=(100.0, 102.0, 99.0, 101.0), tpot_ms=50.0, correct=None)
    base = replace(base, quality=QualityOutcome(tuple(range(100)), tuple([1] * 40 + [0] * 60), (2.0,) * 100,
                                                (1,) * 100))
    # the candidate loses 3 passages and wins 1 of the baseline's: a drop of 0.02, limit 0.05
    cand = replace(base, name="int4", run_ids=("c0", "c1", "c2", "c3"), config={**CONFIG, "weights": "awq-int4"},
                   summaries=tuple({"output_tokens_per_s": t, "weight_bytes": 100} for t in (150, 150, 151, 149)),
                   quality=QualityOutcome(tuple(range(100)), tuple([1] * 37 + [0] * 3 + [1] + [0] * 59),
                                          (2.0,) * 100, (1,) * 100))
    limits = LIMITS.model_copy(update={"max_accuracy_drop": 0.05})
    verdict = compare(base, cand, limits)
    drop = next(c for c in verdict.criteria if c.kind == "quality")
    assert drop.measured.value == pytest.approx(0.02) and drop.measured.low < 0.05 < drop.measured.high
    assert drop.outcome == "unsure" and verdict.decision == "inconclusive"
    assert "LAMBADA passages" in drop.to_settle and int(drop.to_settle.split("about ")[1].split(" ")[0]) > 100


def test_a_zero_accuracy_limit_is_the_exact_check_that_no_passage_is_lost() -> None:
    limits = LIMITS.model_copy(update={"max_accuracy_drop": 0.0})
    same = run_set("b4", tokens_per_s=(150.0, 149.0, 151.0, 150.5), tpot_ms=50.0, correct=34,
                   config={"batching": {"max_batch_size": 4}})
    drop = next(c for c in compare(BASE, same, limits).criteria if c.kind == "quality")
    assert drop.outcome == "pass" and drop.note.startswith("exact: 0 of 100 passages lost")
    assert drop.measured.high > 0  # the interval still says what the passages can show about the population
    worse = replace(same, quality=QualityOutcome(tuple(range(100)), tuple([1] * 33 + [0] * 67), (2.0,) * 100,
                                                 (1,) * 100))
    verdict = compare(BASE, worse, limits)
    assert next(c for c in verdict.criteria if c.kind == "quality").outcome == "fail" and verdict.decision == "reject"


def test_identical_answers_on_few_passages_cannot_show_a_small_limit() -> None:
    cand = run_set("bf16", tokens_per_s=(150.0, 149.0, 151.0, 150.5), tpot_ms=50.0, correct=34,
                   config={"weights": "bf16"})
    verdict = compare(BASE, cand, LIMITS.model_copy(update={"max_accuracy_drop": 0.02}))
    drop = next(c for c in verdict.criteria if c.kind == "quality")
    # 100 passages, none differing: the drop is bounded by 3.7 points (0 discordant of 100), not by 2
    assert drop.outcome == "unsure" and drop.measured.high == pytest.approx(0.037, abs=1e-3)
    assert verdict.decision == "inconclusive" and "LAMBADA passages" in drop.to_settle


def test_one_run_per_config_gives_no_interval_so_nothing_is_decided() -> None:
    base = run_set("base", tokens_per_s=(100.0,), tpot_ms=50.0, correct=34)
    cand = run_set("bf16", tokens_per_s=(300.0,), tpot_ms=50.0, correct=34, config={"weights": "bf16"})
    verdict = compare(base, cand, LIMITS)
    assert verdict.decision == "inconclusive"
    assert all(c.outcome == "unsure" for c in verdict.criteria if c.kind != "quality")
    assert any("one run per config" in w for w in verdict.warnings)
    assert any("set repeats: 2 or more" in hint for hint in verdict.to_settle)


def test_runs_that_do_not_share_rounds_are_compared_unpaired_and_warned_about() -> None:
    cand = run_set("bf16", tokens_per_s=(150.0, 149.0, 151.0), tpot_ms=50.0, correct=34, config={"weights": "bf16"},
                   rounds=(0, 0, 0))
    verdict = compare(BASE, cand, LIMITS)
    gain = next(c for c in verdict.criteria if c.kind == "gain")
    assert isinstance(gain.measured, RunRatio) and not gain.measured.paired and "Welch" in gain.note
    assert any("not paired by round" in w for w in verdict.warnings)


def test_runs_pair_by_their_round_whatever_order_they_are_listed_in() -> None:
    base = run_set("base", tokens_per_s=(100.0, 200.0, 300.0, 400.0), tpot_ms=50.0, correct=34, rounds=(3, 2, 1, 0))
    cand = run_set("bf16", tokens_per_s=(800.0, 600.0, 400.0, 200.0), tpot_ms=50.0, correct=34,
                   config={"weights": "bf16"})  # rounds 0..3: each round's candidate is exactly x2 its baseline
    gain = next(c for c in compare(base, cand, LIMITS).criteria if c.kind == "gain")
    assert (gain.measured.value, gain.measured.low, gain.measured.high) == pytest.approx((2.0, 2.0, 2.0))
    unpaired = compare(base, cand, LIMITS, paired_rounds=False)  # e.g. runs of two plans picked on the dashboard
    assert not next(c for c in unpaired.criteria if c.kind == "gain").measured.paired
    assert any("not paired by round" in w for w in unpaired.warnings)


def test_a_candidate_that_completed_nothing_is_rejected_not_left_inconclusive() -> None:
    now = datetime.now(UTC)
    failed = tuple(RequestSample(f"f{i}", False, now, None, 0, None, None, None, None) for i in range(8))
    cand = replace(run_set("broken", tokens_per_s=(0.0, 0.0, 0.0, 0.0), tpot_ms=50.0, correct=34),
                   samples=(failed,) * 4)
    verdict = compare(BASE, cand, LIMITS)
    assert verdict.decision == "reject"
    assert next(c for c in verdict.criteria if c.kind == "latency").note == "the candidate completed no request"
    gain = next(c for c in verdict.criteria if c.kind == "gain")
    assert gain.outcome == "fail" and gain.measured.value == 0.0


def test_a_figure_without_a_value_is_inconclusive_and_says_what_is_missing() -> None:
    limits = LIMITS.model_copy(update={"gains": (GainGoal(metric="cost_per_request", max_ratio=0.9),)})
    verdict = compare(BASE, run_set("bf16", tokens_per_s=(150.0, 149.0, 151.0, 150.5), tpot_ms=50.0, correct=34),
                      limits)  # no cost in these summaries: nothing to judge
    gain = next(c for c in verdict.criteria if c.kind == "gain")
    assert gain.outcome == "unsure" and verdict.decision == "inconclusive"
    assert "has no interval" in verdict.reason and "a side has no value" in gain.to_settle


@pytest.mark.parametrize(("limit", "upper_is_bad", "outcome"), [
    (1.1, True, "pass"),  # the unfavourable bound equals the limit: it holds
    (1.05, True, "unsure"),
    (0.9, True, "unsure"),  # the favourable bound equals the limit: not yet a failure
    (0.85, True, "fail"),
    (0.9, False, "pass"),
    (1.0, False, "unsure"),
    (1.15, False, "fail"),
])
def test_each_criterion_is_judged_at_its_interval_bounds(limit, upper_is_bad, outcome) -> None:
    assert judge(Estimate(1.0, 0.9, 1.1), limit, upper_is_bad=upper_is_bad) == outcome


def test_no_interval_is_never_a_pass_or_a_fail() -> None:
    assert judge(Estimate(1.0), 5.0, upper_is_bad=True) == "unsure"
    assert judge(Estimate(float("nan"), 0.1, 0.2), 5.0, upper_is_bad=True) == "unsure"


def criterion(kind: str, outcome: str) -> Criterion:
    return Criterion(kind, f"{kind}-{outcome}", Estimate(1.0, 0.9, 1.1), "x", outcome)


@pytest.mark.parametrize(("outcomes", "rule", "decision"), [
    (("pass", "pass", "pass"), "any", "accept"),
    (("pass", "pass", "unsure"), "any", "inconclusive"),
    (("pass", "unsure", "pass"), "any", "inconclusive"),  # a limit not shown to hold blocks the accept
    (("fail", "pass", "pass"), "any", "reject"),  # a limit failed at its favourable bound
    (("pass", "pass", "fail"), "any", "reject"),  # the only gain out of reach
    (("unsure", "pass", "fail"), "any", "reject"),
])
def test_the_three_answers_from_the_criteria(outcomes, rule, decision) -> None:
    quality_outcome, latency_outcome, gain_outcome = outcomes
    criteria = [criterion("quality", quality_outcome), criterion("latency", latency_outcome),
                criterion("gain", gain_outcome)]
    assert overall(criteria, LIMITS.model_copy(update={"gain_rule": rule}))[0] == decision


def test_the_gain_rule_decides_between_several_goals() -> None:
    limits_any, limits_all = LIMITS, LIMITS.model_copy(update={"gain_rule": "all"})
    gains = [criterion("gain", "pass"), criterion("gain", "fail")]
    assert overall(gains, limits_any)[0] == "accept" and overall(gains, limits_all)[0] == "reject"
    gains = [criterion("gain", "unsure"), criterion("gain", "fail")]
    assert overall(gains, limits_any)[0] == "inconclusive" and overall(gains, limits_all)[0] == "reject"
    gains = [criterion("gain", "pass"), criterion("gain", "unsure")]
    assert overall(gains, limits_any)[0] == "accept" and overall(gains, limits_all)[0] == "inconclusive"


def test_runs_on_another_workload_are_refused_with_the_reason() -> None:
    other = run_set("bf16", tokens_per_s=(150.0,), tpot_ms=50.0, correct=34, fingerprint="w2")
    with pytest.raises(ComparisonRefused, match="different prompts, lengths or arrivals cannot be compared"):
        compare(BASE, other, LIMITS)


def test_changing_two_factors_warns_and_one_factor_does_not() -> None:
    both = run_set("both", tokens_per_s=(150.0, 150.0, 150.0, 150.0), tpot_ms=50.0, correct=34,
                   config={"weights": "bf16", "batching": {"max_batch_size": 4}})
    verdict = compare(BASE, both, LIMITS)
    assert any("changes 2 factors (weight precision, batching)" in w for w in verdict.warnings)
    assert changed_factors(CONFIG, {**CONFIG, "batching": {"max_batch_size": 1}}) == ["batching"]
    assert changed_factors(CONFIG, {**CONFIG, "weights": "awq-int4", "awq": {"group_size": 64}}) == ["weight precision"]
    assert changed_factors(CONFIG, {**CONFIG, "kv_cache": {"block_size": 16, "prefix_caching": False}}) == \
        ["prefix caching"]


def test_other_hardware_and_single_runs_are_warned_about() -> None:
    cand = run_set("bf16", tokens_per_s=(150.0,), tpot_ms=50.0, correct=34, config={"weights": "bf16"},
                   hardware={**HARDWARE, "cpu": "Intel Xeon"})
    warnings = compare(run_set("base", tokens_per_s=(100.0,), tpot_ms=50.0, correct=34), cand, LIMITS).warnings
    assert any("other hardware" in w and "cpu" in w for w in warnings)
    assert any("one run per config" in w for w in warnings)


def test_memory_goal_counts_as_a_gain_when_the_rule_is_any() -> None:
    limits = Limits(max_accuracy_drop=0.05, gains=(GainGoal(metric="output_tokens_per_s", min_ratio=1.5),
                                                  GainGoal(metric="weight_bytes", max_ratio=0.5)))
    cand = run_set("int4", tokens_per_s=(101.0, 100.0, 99.0, 100.0), tpot_ms=50.0, correct=33, weight_bytes=30,
                   config={"weights": "awq-int4"})
    verdict = compare(BASE, cand, limits)
    assert verdict.decision == "accept", verdict.reason
    weights = next(c for c in verdict.criteria if c.name == "weight_bytes")
    assert weights.measured.as_dict() == pytest.approx({"value": 0.3, "low": 0.3, "high": 0.3})  # no spread
    assert compare(BASE, cand, limits.model_copy(update={"gain_rule": "all"})).decision == "reject"


def test_greedy_agreement_is_a_figure() -> None:
    cand = run_set("bf16", tokens_per_s=(150.0, 150.0, 150.0, 150.0), tpot_ms=50.0, correct=34)
    figures = {f.name: f for f in compare(BASE, cand, LIMITS).figures}
    assert figures["greedy outputs equal to the baseline's"].candidate == 1.0
    assert figures["p95 itl_ms"].ratio.has_interval  # every latency figure has its interval over runs


@pytest.mark.parametrize("bad", [{"metric": "tpot_ms"}, {"metric": "tpot_ms", "max_ratio": 1.1, "max_ms": 5}])
def test_a_latency_limit_needs_exactly_one_bound(bad) -> None:
    with pytest.raises(ValueError, match="exactly one of max_ratio"):
        LatencyLimit(**bad)


def test_the_run_to_run_spread_of_each_side_is_reported() -> None:
    from servelab.analysis.verdict import run_spread

    spread = run_spread(BASE)
    assert spread.startswith("4 runs; run-to-run spread") and "output tokens/s 1.3 %" in spread
    assert "one run" in run_spread(run_set("one", tokens_per_s=(1.0,), tpot_ms=50.0, correct=None))
    # the thread count each side's worker started with (and whether it adapted), where its runs stored it
    pinned = replace(BASE, hardware={**HARDWARE, "num_threads": 1, "adaptive_threads": False})
    adaptive = replace(BASE, hardware={**HARDWARE, "num_threads": 2, "adaptive_threads": True})
    assert run_spread(pinned).startswith("4 runs at 1 thread(s); run-to-run spread")
    assert run_spread(adaptive).startswith("4 runs at 2 thread(s) (adaptive); run-to-run spread")


def test_interleaved_rounds_measure_every_cell_once_per_round_and_keep_medians() -> None:
    from servelab.analysis.stats import interleaved_medians

    order, figures = [], {"a": iter([(1.0, 10.0), (3.0, 30.0), (2.0, 20.0)]), "b": iter([(5.0,), (4.0,), (6.0,)])}
    messages = []
    medians = interleaved_medians(["a", "b"], lambda cell: order.append(cell) or next(figures[cell]), num_rounds=3,
                                  label=str.upper, progress=messages.append)
    assert order == ["a", "b", "a", "b", "a", "b"]  # never two rounds of one cell back to back
    assert medians == {"a": (2.0, 20.0), "b": (5.0,)}
    assert messages[:2] == ["round 1/3: A", "round 1/3: B"]


def _long_context(nll: list[float], fingerprint: str = "seg1") -> dict:
    return {"fingerprint": fingerprint, "nll": nll, "num_tokens": [1024] * len(nll), "length": 2048,
            "scored_from": 1024}


def test_a_long_context_perplexity_limit_is_judged_paired_by_segment() -> None:
    rng = np.random.default_rng(0)
    base_nll = list(2000 + 200 * rng.standard_normal(16))
    base = replace(BASE, long_context=_long_context(base_nll))
    cand = run_set("window", tokens_per_s=(150.0, 149.0, 151.0, 150.5), tpot_ms=50.0, correct=34,
                   config={"kv_cache": {"eviction": "window"}})
    limits = LIMITS.model_copy(update={"max_long_context_perplexity_ratio": 1.05})
    missing = next(c for c in compare(base, cand, limits).criteria if c.name == "long-context perplexity ratio")
    assert missing.outcome == "unsure" and "quality.long_context_segments" in missing.to_settle
    # every segment 1.2 % worse per token: far within x1.05 however different the segments are from each other
    close = replace(cand, long_context=_long_context([x + 1024 * 0.012 for x in base_nll]))
    criterion = next(c for c in compare(base, close, limits).criteria if c.name == "long-context perplexity ratio")
    assert criterion.outcome == "pass" and criterion.measured.value == pytest.approx(math.exp(0.012), rel=1e-3)
    worse = replace(cand, long_context=_long_context([x + 1024 * 0.2 for x in base_nll]))
    verdict = compare(base, worse, limits)
    assert verdict.decision == "reject" and "long-context perplexity ratio" in verdict.reason
    other = replace(cand, long_context=_long_context(base_nll, fingerprint="seg2"))
    criterion = next(c for c in compare(base, other, limits).criteria if c.name == "long-context perplexity ratio")
    assert criterion.outcome == "unsure" and "different segments" in criterion.note
    assert not [c for c in compare(base, close, LIMITS).criteria if c.name.startswith("long-context")]  # not asked
