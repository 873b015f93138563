"""Sequential comparisons, pure: the level each look gets, wider intervals at it, criteria frozen once settled, and
the stopping rule (settled, a budget spent, which step comes next). The error rates are checked by simulation in
tests/lab/test_calibration.py."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np
import pytest

from servelab.analysis.plan import PlanSpec
from servelab.analysis.report import format_sequential
from servelab.analysis.sequential import ALPHA, Look, SequentialRecord, SequentialSpec, look_level, next_step, settle
from servelab.analysis.stats import Estimate, paired_perplexity_ratio, paired_proportion_difference, ratio_of_runs
from servelab.analysis.verdict import Criterion, Levels, Verdict, compare, overall
from tests.analysis.test_verdict import BASE, LIMITS, run_set


def test_each_look_spends_an_equal_share_and_all_looks_together_spend_alpha() -> None:
    spec = SequentialSpec(min_rounds=3, max_rounds=12, passage_step=80, max_passages=640)
    assert (spec.num_round_looks, spec.num_passage_looks) == (10, 8)
    levels = spec.levels(exact_passages=100)
    assert levels.runs == pytest.approx(1 - ALPHA / 10) and levels.passages == pytest.approx(1 - ALPHA / 8)
    assert sum(1 - look_level(10) for _ in range(10)) == pytest.approx(ALPHA)
    assert levels.exact_passages == 100 and spec.levels(exact_passages=5000).exact_passages == 640
    assert SequentialSpec(passage_step=100, max_passages=250).num_passage_looks == 3  # the last step is short


def test_a_look_reads_a_wider_interval_around_the_same_estimate() -> None:
    rng = np.random.default_rng(0)
    cand, base = 100 * np.exp(rng.normal(0.1, 0.05, 6)), 100 * np.exp(rng.normal(0, 0.05, 6))
    fixed, look = ratio_of_runs(cand, base, paired=True), ratio_of_runs(cand, base, paired=True, level=0.995)
    assert fixed.value == look.value and look.low < fixed.low and look.high > fixed.high
    correct_c, correct_b = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
    fixed, look = (paired_proportion_difference(correct_c, correct_b, level=lv) for lv in (0.95, 0.995))
    assert look.low < fixed.low <= fixed.value <= fixed.high < look.high
    nll_c, nll_b, tokens = rng.normal(2.2, 0.5, 200), rng.normal(2.0, 0.5, 200), np.ones(200)
    fixed, look = (paired_perplexity_ratio(nll_c, nll_b, tokens, tokens, level=lv) for lv in (0.95, 0.995))
    assert look.low < fixed.low and look.high > fixed.high


def test_without_levels_the_verdict_is_the_fixed_one_and_with_them_it_says_its_interval() -> None:
    cand = run_set("b4", tokens_per_s=(150.0, 149.0, 151.0, 150.5), tpot_ms=50.0, correct=34,
                   config={"batching": {"max_batch_size": 4}})
    assert compare(BASE, cand, LIMITS) == compare(BASE, cand, LIMITS, levels=Levels())
    fixed, wider = compare(BASE, cand, LIMITS), compare(BASE, cand, LIMITS, levels=Levels(0.995, 0.99))
    gain_fixed, gain_wider = (next(c for c in v.criteria if c.kind == "gain") for v in (fixed, wider))
    assert gain_wider.measured.low < gain_fixed.measured.low and gain_wider.measured.high > gain_fixed.measured.high
    assert "95 %" in fixed.reason and "sequential interval" in wider.reason
    assert "99.50 % sequential interval" in gain_wider.note and "sequential" not in gain_fixed.note


def test_a_zero_accuracy_limit_passes_only_once_the_planned_passages_are_scored_and_fails_at_once() -> None:
    limits = LIMITS.model_copy(update={"max_accuracy_drop": 0.0})
    same = run_set("b4", tokens_per_s=(150.0, 149.0, 151.0, 150.5), tpot_ms=50.0, correct=34,
                   config={"batching": {"max_batch_size": 4}})
    drop = next(c for c in compare(BASE, same, limits, levels=Levels(exact_passages=200)).criteria
                if c.kind == "quality")
    assert drop.outcome == "unsure" and drop.to_settle == "score 200 passages (now 100)"
    worse = replace(same, quality=replace(same.quality, correct=(1,) * 33 + (0,) * 67))
    assert next(c for c in compare(BASE, worse, limits, levels=Levels(exact_passages=200)).criteria
                if c.kind == "quality").outcome == "fail"


def criterion(kind: str, name: str, outcome: str, value: float = 1.0) -> Criterion:
    return Criterion(kind, name, Estimate(value, value - 0.1, value + 0.1), "x", outcome)


def verdict(*criteria: Criterion, candidate: str = "cand") -> Verdict:
    decision, reason = overall(list(criteria), LIMITS)
    return Verdict("base", candidate, (), tuple(criteria), (), decision, reason)


GAIN, LATENCY, DROP = "output_tokens_per_s", "p95 tpot_ms ratio", "LAMBADA accuracy drop"


def test_a_settled_criterion_is_kept_as_it_was_when_a_later_look_reads_otherwise() -> None:
    first = verdict(criterion("gain", GAIN, "pass", 1.5), criterion("latency", LATENCY, "unsure"))
    later = verdict(criterion("gain", GAIN, "unsure", 1.25), criterion("latency", LATENCY, "pass", 0.9))
    merged = settle(settle(None, first, LIMITS), later, LIMITS)
    assert [c.outcome for c in merged.criteria] == ["pass", "pass"]
    assert merged.criteria[0].measured.value == 1.5 and merged.criteria[1].measured.value == 0.9
    assert merged.decision == "accept" and "sequential interval" in merged.reason


def look(index: int, rounds: int, passages: int = 0, minutes: float = 1.0) -> Look:
    return Look(index, rounds, passages, minutes)


SPEC = SequentialSpec(min_rounds=3, max_rounds=5, passage_step=50, max_passages=100, max_minutes=30)


@pytest.mark.parametrize(("criteria", "where", "expected"), [
    # a serving criterion unsure: another round; a LAMBADA one unsure: more passages
    ((("gain", GAIN, "unsure"), ("quality", DROP, "pass")), look(1, 3, 50), (True, False)),
    ((("gain", GAIN, "pass"), ("quality", DROP, "unsure")), look(1, 3, 50), (False, True)),
    ((("gain", GAIN, "unsure"), ("quality", DROP, "unsure")), look(1, 3, 50), (True, True)),
    # the rounds are spent: passages only
    ((("gain", GAIN, "unsure"), ("quality", DROP, "unsure")), look(3, 5, 50), (False, True)),
])
def test_the_next_step_adds_what_the_unsure_criteria_need_while_budget_is_left(criteria, where, expected) -> None:
    step = next_step([verdict(*(criterion(*c) for c in criteria))], SPEC, where, has_passages=True)
    assert (step.take_round, step.take_passages, step.stop) == (*expected, "")


def test_it_stops_when_every_candidate_is_settled_even_with_criteria_left_unsure() -> None:
    rejected = verdict(criterion("latency", LATENCY, "fail"), criterion("gain", GAIN, "unsure"))
    accepted = verdict(criterion("latency", LATENCY, "pass"), criterion("gain", GAIN, "pass"), candidate="other")
    step = next_step([rejected, accepted], SPEC, look(1, 3, 50), has_passages=True)
    assert step.stop.startswith("settled: every candidate accepted or rejected after 3 rounds, 50 passages")
    assert not next_step([rejected, verdict(criterion("gain", GAIN, "unsure"), candidate="other")], SPEC,
                         look(1, 3, 50), has_passages=True).stop


def test_it_stops_when_a_budget_is_spent_and_names_what_is_still_unsure() -> None:
    open_ = verdict(criterion("gain", GAIN, "unsure"), criterion("quality", DROP, "unsure"),
                    criterion("quality", "long-context perplexity ratio", "unsure"))
    late = next_step([open_], SPEC, look(2, 4, 50, minutes=30.5), has_passages=True)
    assert late.stop.startswith("the time budget is spent (30.5 of 30 minutes) after 4 rounds")
    spent = next_step([open_], SPEC, look(3, 5, 100), has_passages=True)
    assert spent.stop.startswith("the budget is spent after 5 rounds, 100 passages") and \
        "still unsure: LAMBADA accuracy drop, long-context perplexity ratio, output_tokens_per_s" in spent.stop
    # what no round and no passage can settle (a long-context ratio, or LAMBADA not scored) does not keep it going
    assert next_step([verdict(criterion("gain", GAIN, "pass"), criterion("quality", DROP, "unsure"))], SPEC,
                     look(1, 3), has_passages=False).stop.startswith("the budget is spent")


def test_the_record_says_when_each_criterion_and_the_decision_settled() -> None:
    record = SequentialRecord(SPEC, SPEC.levels())
    step = record.add(look(1, 3, 50), [verdict(criterion("gain", GAIN, "pass"), criterion("latency", LATENCY,
                                                                                          "unsure"))],
                      LIMITS, has_passages=True)
    assert step.take_round and not step.take_passages
    step = record.add(look(2, 4, 50, minutes=7.5), [verdict(criterion("gain", GAIN, "unsure"),
                                                            criterion("latency", LATENCY, "pass"))],
                      LIMITS, has_passages=True)
    assert step.stop and record.decided_at == {"cand": 2}
    assert record.settled_at == {"cand": {GAIN: 1, LATENCY: 2}}
    assert record.settled_by("cand") == f"cand: accept after 4 rounds, 50 passages, 7.5 minutes (look 2); " \
                                        f"settled then: {LATENCY}"
    stored = record.as_dict()
    printed = format_sequential(record)
    assert printed.startswith(f"until settled: {record.stop}") and "serving criteria at 98.33 % (3 looks" in printed
    assert "look 2: 4 rounds, 50 passages, 7.5 min" in printed
    assert stored["levels"]["runs"] == pytest.approx(1 - ALPHA / 3) and len(stored["looks"]) == 2
    with pytest.raises(AssertionError):
        record.add(look(3, 5, 50), [], LIMITS, has_passages=True)


def test_a_rejected_candidate_is_judged_no_more_and_each_look_keeps_every_criterion_for_the_chart() -> None:
    record = SequentialRecord(SPEC, SPEC.levels())
    failed = verdict(criterion("latency", LATENCY, "fail", 1.4), criterion("gain", GAIN, "unsure"), candidate="slow")
    open_ = verdict(criterion("latency", LATENCY, "unsure", 1.05), criterion("gain", GAIN, "unsure", 1.3))
    step = record.add(look(1, 3, 50), [failed, open_], LIMITS, has_passages=True)
    assert record.rejected == {"slow"} and step.take_round and not step.stop  # "cand" is still open
    later = verdict(criterion("latency", LATENCY, "pass", 1.02), criterion("gain", GAIN, "pass", 1.28))
    record.add(look(2, 4, 50), [later], LIMITS, has_passages=True)  # "slow" is no longer judged
    assert record.stop.startswith("settled") and record.decided_at == {"slow": 1, "cand": 2}
    assert [set(h) for h in record.history] == [{"slow", "cand"}, {"cand"}]
    first, second = record.history[0]["cand"], record.history[1]["cand"]
    assert [c["name"] for c in first] == [LATENCY, GAIN] and first[0]["outcome"] == "unsure"
    assert second[0] == {"kind": "latency", "name": LATENCY, "limit": "x", "outcome": "pass",
                         **Estimate(1.02, 1.02 - 0.1, 1.02 + 0.1).as_dict()}
    printed = format_sequential(record)
    assert "slow: rejected at look 1, measured no more after it" in printed
    assert record.as_dict()["history"] == record.history
    with pytest.raises(AssertionError, match="slow was rejected"):
        SequentialRecord(SPEC, SPEC.levels(), verdicts=dict(record.verdicts)).add(
            look(3, 5, 50), [failed], LIMITS, has_passages=True)


@pytest.mark.parametrize(("section", "message"), [
    ({"min_rounds": 6, "max_rounds": 4}, "min_rounds (6) must be at most max_rounds (4)"),
    ({"passage_step": 200, "max_passages": 100}, "passage_step (200) must be at most max_passages (100)"),
    ({"min_rounds": 1}, "greater than or equal to 2"),
    ({"max_minutes": 0}, "greater than 0"),
    ({"rounds": 4}, "Extra inputs are not permitted"),
])
def test_a_bad_sequential_section_is_refused_naming_the_field(section, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        PlanSpec.model_validate({"name": "p", "workload": "w.yaml", "baseline": "b.yaml", "candidates": ["c.yaml"],
                                 "limits": {"gains": [{"metric": "output_tokens_per_s", "min_ratio": 1.2}]},
                                 "sequential": section})


def test_more_planned_looks_read_wider_intervals_and_one_look_is_the_fixed_plan() -> None:
    assert all(look_level(k) < look_level(k + 1) for k in range(1, 20))
    assert look_level(1) == pytest.approx(0.95) and math.isclose(look_level(10), 0.995)
