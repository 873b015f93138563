"""The report's reader-facing pieces: a plan's limits as a table, and a cost measured without a price."""

from __future__ import annotations

from servelab.analysis.report import NO_PRICE, format_verdicts, is_priced, limit_rows
from servelab.analysis.stats import Estimate
from servelab.analysis.verdict import Figure, GainGoal, LatencyLimit, Limits, Verdict


def test_limits_read_as_criterion_limit_and_direction() -> None:
    limits = Limits(max_accuracy_drop=0.05, max_perplexity_ratio=1.1,
                    latency=(LatencyLimit(metric="tpot_ms", percentile=95, max_ratio=1.2),
                             LatencyLimit(metric="ttft_ms", percentile=99, max_ms=500)),
                    gains=(GainGoal(metric="output_tokens_per_s", min_ratio=1.1),
                           GainGoal(metric="weight_bytes", max_ratio=0.5)), gain_rule="all")
    assert [tuple(r.values()) for r in limit_rows(limits)] == [
        ("quality: LAMBADA accuracy drop", "0.05 points", "at most"),
        ("quality: LAMBADA perplexity", "x1.1 the baseline's", "at most"),
        ("latency: p95 tpot_ms", "x1.2 the baseline's", "at most"),
        ("latency: p99 ttft_ms", "500.0 ms", "at most"),
        ("gain: output_tokens_per_s", "x1.1 the baseline's", "at least"),
        ("gain: weight_bytes", "x0.5 the baseline's", "at most"),
        ("gains that must hold", "every one", "-"),
    ]
    assert [r["criterion"] for r in limit_rows(Limits(max_accuracy_drop=None, gains=limits.gains[:1]))] == [
        "gain: output_tokens_per_s"]


def test_a_cost_without_a_price_says_how_to_set_one() -> None:
    assert not is_priced(0.0) and not is_priced(None) and is_priced(1e-6)
    assert "SERVELAB_PRICE_PER_HOUR" in NO_PRICE

    figures = (Figure("cost_per_request", 0.0, 0.0, None), Figure("output_tokens_per_s", 100.0, 150.0, Estimate(1.5)))
    report = format_verdicts([Verdict("a", "b", figures, (), (), "accept", "fine")])
    cost = next(line for line in report.split("\n") if "cost_per_request" in line)
    assert NO_PRICE in cost and " 0 " not in cost and "x1.500" in report
