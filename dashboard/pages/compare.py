"""Compare (the front page): a baseline's runs against candidates' runs on one workload, verdict first.

The selection lives in the URL (?baseline=<run ids>&candidates=<run ids>), so a review is a link. Limits come
from the stored comparison that holds these runs, else from defaults shown (and editable) in the sidebar,
never written back. The judging is servelab.analysis.verdict's; this page selects, reads and draws.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Any

import numpy as np
import pandas as pd
import streamlit as st

from dashboard import charts, hints, reads
from servelab.analysis.metrics import latency_values
from servelab.analysis.ranking import rank
from servelab.analysis.stats import LEVEL, Estimate, mean_interval
from servelab.analysis.report import NO_PRICE, is_priced, limit_rows
from servelab.analysis.verdict import (COST_METRICS, GAIN_METRICS, THROUGHPUT_METRICS, GainGoal, LatencyLimit, Levels,
                                      Limits, RunSet, Verdict)
from servelab.store.queries import RunListing

GroupKey = tuple[str, str, str]  # (workload fingerprint, config name, config hash): the repeats of one config
SHOWN_LATENCY = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2el_ms", "E2E latency"))


def group_runs(listing: list[RunListing]) -> dict[GroupKey, list[RunListing]]:
    groups: dict[GroupKey, list[RunListing]] = defaultdict(list)
    for run in listing:  # newest first, so the dict's order puts the newest config first
        groups[(run.workload_fingerprint, run.serving_config_name, run.config_hash)].append(run)
    return {k: sorted(v, key=lambda r: (r.repeat_index, r.started_at)) for k, v in groups.items()}


def label(groups: dict[GroupKey, list[RunListing]], key: GroupKey) -> str:
    runs = groups[key]
    plan = f", plan {runs[0].plan_name}" if runs[0].plan_name else ""
    return f"{key[1]} · {runs[0].settings['weight precision']} · {runs[0].workload_name} ({key[0][:8]}) · " \
           f"{len(runs)} run{'s' if len(runs) != 1 else ''}{plan}"


def initial_selection(groups: dict[GroupKey, list[RunListing]]) -> tuple[list[str], list[str]]:
    """The URL's runs; else the newest stored comparison's; else the newest config that has company."""
    baseline, candidates = reads.query_ids("baseline"), reads.query_ids("candidates")
    if baseline:
        return baseline, candidates
    latest = reads.latest_comparison_runs()
    if latest:
        return latest
    keys = list(groups)
    key = next((k for k in keys if any(o[0] == k[0] and o != k for o in keys)), keys[0])
    return [r.id for r in groups[key]], [r.id for k in keys if k[0] == key[0] and k != key for r in groups[k]]


def pick(groups: dict[GroupKey, list[RunListing]]) -> tuple[tuple[GroupKey, list[str]], list[tuple[GroupKey, list[str]]]]:
    """Baseline and candidates as (group, run ids); the URL follows every change."""
    url_baseline, url_candidates = initial_selection(groups)
    group_of = {r.id: k for k, runs in groups.items() for r in runs}
    unknown = [i for i in url_baseline + url_candidates if i not in group_of]
    if unknown:
        st.error(f"No such run: {', '.join(unknown)}. Pick runs below, or open the Runs page.")
    keys = list(groups)
    base_default = next((group_of[i] for i in url_baseline if i in group_of), keys[0])
    left, right = st.columns([2, 3])
    base_key = left.selectbox("Baseline (its repeats)", keys, index=keys.index(base_default),
                              format_func=lambda k: label(groups, k))
    named = [group_of[i] for i in url_candidates if i in group_of and group_of[i] != base_key]
    options = list(dict.fromkeys([k for k in keys if k[0] == base_key[0] and k != base_key] + named))
    cand_keys = right.multiselect("Candidates", options, default=list(dict.fromkeys(named)),
                                  format_func=lambda k: label(groups, k),
                                  placeholder="pick configs served on the same workload")

    def ids_of(key: GroupKey, named_ids: list[str]) -> list[str]:
        chosen = [i for i in named_ids if group_of.get(i) == key]  # a link may name only some repeats
        return chosen or [r.id for r in groups[key]]

    baseline = (base_key, ids_of(base_key, url_baseline))
    candidates = [(k, ids_of(k, url_candidates)) for k in cand_keys]
    wanted = {"baseline": ",".join(baseline[1]), "candidates": ",".join(i for _, ids in candidates for i in ids)}
    if {k: st.query_params.get(k, "") for k in wanted} != wanted:
        st.query_params.update(wanted)
    return baseline, candidates


def sidebar_limits(baseline_ids: list[str], candidate_ids: list[str]) -> Limits:
    stored = reads.stored_limits(tuple(baseline_ids), tuple(candidate_ids))
    with st.sidebar:
        st.subheader("Limits")
        if stored.source != "defaults":
            st.caption(f"From {stored.source}.")
            st.table(pd.DataFrame(limit_rows(stored.limits)).set_index("criterion"))
            return stored.limits
        st.caption("These runs belong to no stored comparison: judged by these defaults, editable here, "
                   "saved nowhere.")
        drop = st.number_input("max LAMBADA accuracy drop (points)", 0.0, 1.0, 0.05, 0.01)
        tpot = st.number_input("max p95 TPOT ratio (candidate / baseline)", 0.1, 100.0, 1.2, 0.05)
        metric = st.selectbox("gain goal", GAIN_METRICS, index=0)
        higher = metric in THROUGHPUT_METRICS
        ratio = st.number_input(f"{'min' if higher else 'max'} {metric} ratio", 0.01, 100.0, 1.1 if higher else 0.8,
                                0.05)
    goal = GainGoal(metric=metric, **({"min_ratio": ratio} if higher else {"max_ratio": ratio}))
    return Limits(max_accuracy_drop=drop, gains=(goal,),
                  latency=(LatencyLimit(metric="tpot_ms", percentile=95, max_ratio=tpot),))


DECISIONS = {"accept": (":material/check_circle:", st.success), "reject": (":material/cancel:", st.error),
             "inconclusive": (":material/help:", st.warning)}
OUTCOMES = {"pass": "pass", "fail": "FAIL", "unsure": "unsure"}


def show_verdict(v: Verdict, levels: Levels = Levels()) -> None:
    icon, box = DECISIONS[v.decision]
    st.subheader(f"{icon} {v.decision.upper()}: {v.candidate} against {v.baseline}")
    box(v.reason)
    if v.to_settle:
        st.info("To settle it: " + "; ".join(v.to_settle), icon=":material/lightbulb:")
    for warning in v.warnings:
        st.warning(warning, icon=":material/warning:")
    st.dataframe(pd.DataFrame([{
        "result": OUTCOMES[c.outcome], "criterion": f"{c.kind}: {c.name}",
        "measured": _fmt_measured(c.name, c.kind, c.measured.value), "interval": _interval(c.measured),
        "limit": c.limit, "note": c.note} for c in v.criteria]), hide_index=True, width="stretch")
    st.caption("A criterion passes when its limit holds at the unfavourable end of its interval, fails when "
               "the limit fails even at the favourable end, and is unsure otherwise. Serving figures are per run, "
               "paired by round, with a t interval over the runs. "
               + ("Intervals are 95 %." if levels.is_fixed else
                  "The runs were compared until settled: each interval is read at the level its looks spend 5 % "
                  f"over (the runs' {100 * levels.runs:.2f} %, the passages' {100 * levels.passages:.2f} %), "
                  "as the comparison read them, never at a fixed 95 % after looking several times."))
    st.caption(" · ".join(f"runs of {check}" for check in v.repeat_checks))
    with st.expander("every figure: baseline, candidate, ratio and its 95 % interval"):
        st.dataframe(pd.DataFrame([_figure_row(f) for f in v.figures]), hide_index=True, width="stretch")
        if any(f.name in COST_METRICS and not (f.baseline or f.candidate) for f in v.figures):
            st.caption(f"Cost: {NO_PRICE}.")


def show_ranking(sets: list[RunSet], verdicts: list[Verdict], limits: Limits, rank_by: str | None,
                 level: float = LEVEL) -> None:
    """Several candidates: those that meet every limit, best first by the plan's figure, each pair's interval;
    `level`: the serving criteria's (95 %, or a comparison's run until settled)."""
    ranking = rank(sets, verdicts, limits, rank_by=rank_by, level=level)
    st.header("Ranking")
    (st.success if ranking.ranked else st.warning)(ranking.summary)
    rows = [{"place": i, "candidate": r.name, f"{ranking.metric} against the baseline":
             _ratio_text(r.versus_baseline)} for i, r in enumerate(ranking.ranked, 1)]
    if rows:
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
    if ranking.pairs:
        st.dataframe(pd.DataFrame([{"pair": f"{p.better} / {p.worse}", "ratio": _ratio_text(p.ratio),
                                    "told apart": "yes" if p.told_apart else "no: the interval holds x1"}
                                   for p in ranking.pairs]), hide_index=True, width="stretch")
        first = "higher" if ranking.higher_is_better else "lower"
        st.caption(f"Each pair compared directly, paired by round, at {100 * ranking.level:.2f} % "
                   f"({100 * level:.2f} % shared over the {len(ranking.pairs)} pairs); {first} {ranking.metric} "
                   "ranks first.")
    for name, why in ranking.not_ranked:
        st.caption(f"Not ranked: {name} ({why})")


def _ratio_text(e: Estimate) -> str:
    return "-" if not math.isfinite(e.value) else f"x{e.value:.3f} {_interval(e)}"


def narrowing_frame(sequential: dict[str, Any], candidate: str) -> pd.DataFrame:
    """A stored sequential record's looks for one candidate: each criterion's estimate and interval per look."""
    rows = []
    for look, criteria in zip(sequential.get("looks", []), sequential.get("history", [])):
        for c in criteria.get(candidate, []):
            rows.append({"criterion": c["name"], "look": look["index"], "value": c["value"], "low": c["low"],
                         "high": c["high"], "outcome": c["outcome"], "limit": limit_value(c["limit"]),
                         "where": f"{look['num_rounds']} rounds, {look['num_passages']} passages"})
    return pd.DataFrame(rows)


def limit_value(label: str) -> float | None:
    """A criterion's limit as a number on its own scale: '<= x1.1' -> 1.1, '<= 0.05' -> 0.05, '<= 120 ms' -> 120."""
    found = re.search(r"[-+]?\d*\.?\d+(?:e[-+]?\d+)?", label)
    return float(found.group()) if found else None


def show_narrowing(sequential: dict[str, Any] | None, candidates: list[str]) -> None:
    """A comparison run until settled: how each criterion's interval narrowed look by look, per candidate."""
    if not sequential or not sequential.get("history"):
        return
    st.header("How the intervals narrowed")
    st.caption(f"Run until settled: {sequential.get('stop', '')}. Each look reads its intervals at the level that "
               "spends 5 % over the planned looks; a settled criterion is kept as the look that settled it read it.")
    for name in candidates:
        frame = narrowing_frame(sequential, name)
        if frame.empty:
            continue
        st.subheader(name)
        st.caption(sequential.get("settled_by", {}).get(name, ""))
        st.altair_chart(charts.interval_narrowing(frame))


def _fmt_measured(name: str, kind: str, value: float) -> str:
    if not math.isfinite(value):
        return "not measured"
    return f"x{value:.3f}" if "ratio" in name or kind == "gain" else f"{value:.3g}"


def _interval(e: Estimate | None) -> str:
    return f"[{e.low:.3g}, {e.high:.3g}]" if e is not None and e.has_interval else "-"


def show_settings(sets: list[RunSet], listing: dict[str, RunListing]) -> None:
    st.subheader("Settings")
    columns = {s.name: {**listing[s.run_ids[0]].settings, "hardware": listing[s.run_ids[0]].hardware,
                        "workload": f"{listing[s.run_ids[0]].workload_name} ({s.workload_fingerprint[:12]})",
                        "runs": str(len(s.run_ids))} for s in sets}
    frame = pd.DataFrame(columns)
    frame.insert(0, "differs", ["✱" if len(set(row)) > 1 else "" for row in frame.itertuples(index=False)])
    only_diff = st.toggle("only the settings that differ", value=False)
    st.dataframe(frame[frame["differs"] == "✱"] if only_diff else frame, width="stretch")


def summary_frame(sets: list[RunSet], metric: str) -> pd.DataFrame:
    rows = []
    for s in sets:
        values = [x[metric] for x in s.summaries if x.get(metric) is not None]
        e = mean_interval(values) if values else Estimate(float("nan"))
        rows.append({"config": s.name, metric: e.value, "low": e.low, "high": e.high})
    return pd.DataFrame(rows)


def show_throughput_and_cost(sets: list[RunSet]) -> None:
    st.subheader("Throughput and cost")
    st.caption("Mean over repeats; the whisker is the 95 % interval of the mean (none with one run).")
    a, b, c = st.columns(3)
    a.altair_chart(charts.bars_with_interval(summary_frame(sets, "output_tokens_per_s"),
                                             value="output_tokens_per_s", title="output tokens/s"), width="stretch",
                   height=charts.band_height(len(sets)))
    b.altair_chart(charts.bars_with_interval(summary_frame(sets, "requests_per_s"), value="requests_per_s",
                                             title="requests/s"), width="stretch",
                   height=charts.band_height(len(sets)))
    cost = summary_frame(sets, "cost_per_request")
    if not any(is_priced(v) for v in cost["cost_per_request"].fillna(0)):
        c.info(f"Cost per request: {NO_PRICE}.", icon=":material/sell:")
        return
    c.altair_chart(charts.bars_with_interval(cost, value="cost_per_request", title="cost per request ($)",
                                             fmt=",.3g"), width="stretch",
                   height=charts.band_height(len(sets)))


def show_latency(sets: list[RunSet]) -> None:
    st.subheader("Latency")
    st.caption("Empirical CDFs over every successful request of every repeat; the rules mark p50, p95 and p99.")
    table = []
    for column, (metric, title) in zip(st.columns(len(SHOWN_LATENCY)), SHOWN_LATENCY):
        curves, marks = [], []
        for s in sets:
            values = np.sort(np.asarray(latency_values([x for x in s.pooled() if x.is_success], metric), dtype=float))
            if not len(values):
                continue
            curves.append(pd.DataFrame({"config": s.name, "ms": values,
                                        "fraction": np.arange(1, len(values) + 1) / len(values)}))
            for q in (50, 95, 99):
                ms = float(np.percentile(values, q))
                marks.append({"config": s.name, "percentile": f"p{q}", "ms": ms})
                table.append({"metric": title, "config": s.name, "percentile": f"p{q}", "ms": round(ms, 2)})
        if curves:
            column.altair_chart(charts.latency_cdf(pd.concat(curves), metric=title, percentiles=pd.DataFrame(marks)),
                                width="stretch")
        else:
            column.info(f"No {title} measured.")
    if table:
        wide = pd.DataFrame(table).pivot_table(index=["metric", "percentile"], columns="config", values="ms",
                                               sort=False)
        st.dataframe(wide, width="stretch")


def show_memory(sets: list[RunSet]) -> None:
    st.subheader("Memory")
    st.caption("Peak per part, mean over repeats: weights by tensor storage, the KV cache from the model shape and "
               "retained tokens, working memory above what was resident when the batch started.")
    parts = (("weights", "weight_bytes"), ("KV cache", "kv_cache_peak_bytes"), ("working", "working_peak_bytes"))
    frame = pd.DataFrame([{"config": s.name, "part": part,
                           "bytes": float(np.mean([x.get(key) or 0 for x in s.summaries]))}
                          for s in sets for part, key in parts])
    st.altair_chart(charts.memory_stack(frame), width="stretch", height=charts.band_height(len(sets)))


def show_quality(sets: list[RunSet], verdicts: list[Verdict]) -> None:
    st.subheader("Task quality")
    measured = [s for s in sets if s.quality is not None]
    if not measured:
        st.info("Quality was not measured for these runs: set `quality: {lambada_samples: 100}` in the plan.")
        return
    rows = [{"config": s.name, "accuracy": s.quality.accuracy.value, "low": s.quality.accuracy.low,
             "high": s.quality.accuracy.high, "perplexity": s.quality.perplexity,
             "passages": len(s.quality.correct)} for s in measured]
    left, right = st.columns([3, 2])
    left.altair_chart(charts.points_with_interval(pd.DataFrame(rows), value="accuracy",
                                                  title="LAMBADA last-word accuracy (Wilson 95 % interval)"),
                      width="stretch", height=charts.band_height(len(rows)))
    agreement = {v.candidate: f for v in verdicts for f in v.figures if f.name.startswith("greedy outputs")}
    right.dataframe(pd.DataFrame([{**r, "greedy outputs = baseline's": _share(agreement.get(r["config"]))}
                                  for r in rows]), hide_index=True, width="stretch")


def _figure_row(f) -> dict[str, str]:
    """A figure as text: a cost measured without a price says so instead of 0."""
    if f.name in COST_METRICS and not (f.baseline or f.candidate):
        return {"figure": f.name, "baseline": "no price set", "candidate": "no price set", "ratio": "-",
                "95 % interval": "-"}
    number = lambda x: "-" if x is None else f"{x:.4g}"  # noqa: E731
    return {"figure": f.name, "baseline": number(f.baseline), "candidate": number(f.candidate),
            "ratio": number(None if f.ratio is None else f.ratio.value), "95 % interval": _interval(f.ratio)}


def _share(figure) -> str:
    if figure is None or figure.ratio is None:
        return "-"
    return f"{figure.candidate:.0%} {_interval(figure.ratio)}"


def main() -> None:
    st.title("Compare serving configs")
    listing = hints.runs_or_explain(reads.runs)
    if listing is None:
        return
    if len(listing) == 1:
        hints.one_run(listing[0].serving_config_name, listing[0].workload_name)
        return
    groups = group_runs(listing)
    (base_key, base_ids), candidates = pick(groups)
    if not candidates:
        others = [k for k in groups if k[0] == base_key[0] and k != base_key]
        if others:
            st.info("Pick one or more candidates above.")
        else:
            hints.one_run(base_key[1], groups[base_key][0].workload_name)
        return
    limits = sidebar_limits(base_ids, [i for _, ids in candidates for i in ids])
    stored = reads.stored_limits(tuple(base_ids), tuple(i for _, ids in candidates for i in ids))
    levels = reads.stored_levels(stored)
    st.header("Verdict")
    verdicts: list[Verdict] = []
    for _, ids in candidates:
        v = reads.verdict(tuple(base_ids), tuple(ids), reads.limits_json(limits))
        if isinstance(v, str):
            st.error(f"Not compared: {v}", icon=":material/block:")
        else:
            show_verdict(v, levels)
            verdicts.append(v)
    judged = {v.candidate for v in verdicts}
    sets = [reads.run_set(tuple(base_ids))] + [s for s in (reads.run_set(tuple(ids)) for _, ids in candidates)
                                                if s.name in judged]
    if len(sets) < 2:
        return
    if len(verdicts) > 1:
        show_ranking(sets[1:], verdicts, limits, stored.rank_by, levels.runs)
    show_narrowing(stored.sequential, [v.candidate for v in verdicts])
    st.header("Side by side")
    show_settings(sets, {r.id: r for r in listing})
    show_throughput_and_cost(sets)
    show_latency(sets)
    show_memory(sets)
    show_quality(sets, verdicts)


if __name__ == "__main__":  # NOTE: Streamlit runs a page as __main__; the tests import its sections
    main()
