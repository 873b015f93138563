"""Altair charts of the dashboard: each takes a tidy DataFrame and returns a chart; no queries, no Streamlit.

Knows the encodings (config as colour, intervals as error bars, percentiles as rules). Does not know
where the numbers come from.
"""

from __future__ import annotations

import altair as alt
import pandas as pd

PERCENTILE_DASH = {"p50": [2, 2], "p95": [6, 3], "p99": [1, 0]}


def band_height(num_rows: int) -> int:
    """Pixels for a chart with one band per config.

    NOTE: given to st.altair_chart, not set in the spec: Streamlit sizes charts by content and would squash a
    discrete axis to nothing (seen in Chromium).
    """
    return 70 + 42 * num_rows


def bars_with_interval(frame: pd.DataFrame, *, value: str, title: str, fmt: str = ",.3g") -> alt.Chart:
    """frame: config, value, low, high (low/high may be empty: one run, no interval)."""
    base = alt.Chart(frame).encode(y=alt.Y("config:N", title=None, sort=None))
    bars = base.mark_bar().encode(x=alt.X(f"{value}:Q", title=title), color=alt.Color("config:N", legend=None),
                                  tooltip=["config", alt.Tooltip(f"{value}:Q", format=fmt), "low", "high"])
    whiskers = base.mark_rule(color="black").encode(x="low:Q", x2="high:Q")
    labels = base.mark_text(align="left", dx=4, color="black").encode(
        x=f"{value}:Q", text=alt.Text(f"{value}:Q", format=fmt))
    return bars + whiskers + labels


def latency_cdf(frame: pd.DataFrame, *, metric: str, percentiles: pd.DataFrame) -> alt.LayerChart:
    """frame: config, ms, fraction (the empirical CDF); percentiles: config, percentile, ms."""
    lines = alt.Chart(frame).mark_line(interpolate="step-after").encode(
        x=alt.X("ms:Q", title=f"{metric} (ms)"), y=alt.Y("fraction:Q", title="share of requests ≤ x"),
        color=alt.Color("config:N", title="config"), tooltip=["config", alt.Tooltip("ms:Q", format=".1f"), "fraction"])
    rules = alt.Chart(percentiles).mark_rule(opacity=0.7).encode(
        x="ms:Q", color="config:N", strokeDash=alt.StrokeDash("percentile:N", title="percentile",
                                                             sort=list(PERCENTILE_DASH)),
        tooltip=["config", "percentile", alt.Tooltip("ms:Q", format=".1f")])
    return (lines + rules).properties(title=metric, height=220)


def memory_stack(frame: pd.DataFrame) -> alt.Chart:
    """frame: config, part (weights / KV cache / working), bytes."""
    order = {"weights": 0, "KV cache": 1, "working": 2}
    frame = frame.assign(order=frame["part"].map(order), megabytes=frame["bytes"] / 1e6)
    return alt.Chart(frame).mark_bar().encode(
        y=alt.Y("config:N", title=None, sort=None), x=alt.X("megabytes:Q", title="peak memory (MB)", stack="zero"),
        color=alt.Color("part:N", sort=list(order), title="part"), order=alt.Order("order:Q"),
        tooltip=["config", "part", alt.Tooltip("megabytes:Q", format=",.2f")],
    )


def points_with_interval(frame: pd.DataFrame, *, value: str, title: str) -> alt.LayerChart:
    """frame: config, value, low, high; for proportions (accuracy) drawn as a point with its interval."""
    base = alt.Chart(frame).encode(y=alt.Y("config:N", title=None, sort=None))
    return (base.mark_rule(strokeWidth=2).encode(x=alt.X("low:Q", title=title), x2="high:Q", color="config:N")
            + base.mark_point(filled=True, size=80).encode(x=f"{value}:Q", color=alt.Color("config:N", legend=None),
                                                           tooltip=["config", value, "low", "high"])
            )


def sweep_throughput(points: pd.DataFrame, rooflines: pd.DataFrame, crossovers: pd.DataFrame) -> alt.LayerChart:
    """points: config, batch_size, decode_tokens_per_s; rooflines: config, roof, batch_size, tokens_per_s;
    crossovers: label, batch_size."""
    x = alt.X("batch_size:Q", title="batch size", scale=alt.Scale(type="log", base=2))
    y = alt.Y("decode_tokens_per_s:Q", title="decode tokens/s", scale=alt.Scale(type="log"))
    measured = alt.Chart(points).mark_line(point=True).encode(x=x, y=y, color=alt.Color("config:N", title="config"),
                                                              tooltip=["config", "batch_size", "decode_tokens_per_s"])
    layers = [measured]
    if not rooflines.empty:
        layers.append(alt.Chart(rooflines).mark_line(strokeDash=[5, 4], opacity=0.8).encode(
            x=x, y=alt.Y("tokens_per_s:Q"), color="config:N", detail="roof:N",
            strokeDash=alt.StrokeDash("roof:N", title="roofline"), tooltip=["config", "roof", "batch_size",
                                                                            "tokens_per_s"]))
    layers += _crossover_rules(crossovers)
    return alt.layer(*layers).properties(height=320, title="throughput against batch size, with rooflines")


def sweep_latency(points: pd.DataFrame, crossovers: pd.DataFrame) -> alt.LayerChart:
    x = alt.X("batch_size:Q", title="batch size", scale=alt.Scale(type="log", base=2))
    line = alt.Chart(points).mark_line(point=True).encode(
        x=x, y=alt.Y("tpot_ms:Q", title="TPOT (ms per output token)"), color="config:N",
        tooltip=["config", "batch_size", "tpot_ms"])
    return alt.layer(line, *_crossover_rules(crossovers)).properties(height=260, title="latency against batch size")


def _crossover_rules(crossovers: pd.DataFrame) -> list[alt.Chart]:
    if crossovers.empty:
        return []
    base = alt.Chart(crossovers).encode(x="batch_size:Q")
    return [base.mark_rule(color="firebrick", strokeWidth=2).encode(tooltip=["label", "batch_size"]),
            base.mark_text(angle=270, align="left", dx=4, dy=-6, color="firebrick").encode(
                text="label:N", y=alt.value(4))]


def kv_cache_lines(lines: pd.DataFrame, batches: pd.DataFrame, requests: pd.DataFrame) -> alt.LayerChart:
    """lines: config, tokens, kib (two points per config); batches / requests: config, tokens, kib."""
    x = alt.X("tokens:Q", title="retained tokens")
    y = alt.Y("kib:Q", title="stored KV cache (KiB)")
    layers = [alt.Chart(lines).mark_line(opacity=0.6).encode(x=x, y=y, color=alt.Color("config:N", title="config"))]
    if not batches.empty:
        layers.append(alt.Chart(batches).mark_point(size=70, filled=True).encode(
            x=x, y=y, color="config:N", shape=alt.value("circle"),
            tooltip=["config", "tokens", alt.Tooltip("kib:Q", format=",.1f"), "num_requests"]))
    if not requests.empty:
        layers.append(alt.Chart(requests).mark_point(size=60, shape="diamond", filled=False, strokeWidth=2).encode(
            x=x, y=y, color="config:N", tooltip=["config", "run", "tokens", alt.Tooltip("kib:Q", format=",.1f")]))
    return alt.layer(*layers).properties(height=360)


def interval_narrowing(frame: pd.DataFrame) -> alt.FacetChart:
    """frame: criterion, look, where (rounds and passages at that look), value, low, high, limit (may be empty), one
    row per look and criterion; a panel per criterion, its interval as a band narrowing look by look, the limit as a
    red rule."""
    base = alt.Chart().encode(x=alt.X("look:O", title="look", axis=alt.Axis(labelAngle=0)))
    tooltip = ["look", "where", alt.Tooltip("value:Q", format=".3g"), alt.Tooltip("low:Q", format=".3g"),
               alt.Tooltip("high:Q", format=".3g"), "outcome", "limit"]
    band = base.mark_area(opacity=0.25).encode(y=alt.Y("low:Q", title=None, scale=alt.Scale(zero=False)), y2="high:Q")
    whiskers = base.mark_rule(strokeWidth=2).encode(y="low:Q", y2="high:Q")
    points = base.mark_point(filled=True, size=70).encode(
        y="value:Q", color=alt.Color("outcome:N", scale=alt.Scale(domain=["pass", "unsure", "fail"],
                                                                  range=["seagreen", "darkorange", "firebrick"])),
        tooltip=tooltip)
    limit = alt.Chart().mark_rule(color="firebrick", strokeDash=[5, 4]).encode(y="limit:Q")
    return alt.layer(band, whiskers, points, limit, data=frame).properties(width=260, height=180).facet(
        facet=alt.Facet("criterion:N", title=None), columns=3).resolve_scale(y="independent")
