"""Batch sweep: decode throughput and latency against batch size per precision, beside the machine's rooflines.

Reads the stored sweeps (their report as servelab's sweep wrote it, read leniently by servelab.store.queries);
the chosen sweep lives in the URL (?sweep=<id>). Marks where decoding turns compute bound and where a
precision stops paying (the report's crossovers).
"""

from __future__ import annotations

import pandas as pd
import streamlit as st
from sqlalchemy.exc import SQLAlchemyError

from dashboard import charts, hints, reads
from servelab.store.queries import Crossover, SweepListing, StoredSweepPoint, sweep_crossovers, sweep_points


def pick(listing: list[SweepListing]) -> SweepListing:
    ids = [s.id for s in listing]
    wanted = st.query_params.get("sweep")
    chosen = st.selectbox("sweep", ids, index=ids.index(wanted) if wanted in ids else 0,
                          format_func=lambda i: _label(next(s for s in listing if s.id == i)))
    if chosen != wanted:
        st.query_params["sweep"] = chosen
    return next(s for s in listing if s.id == chosen)


def _label(s: SweepListing) -> str:
    configs = sorted({p.config for p in sweep_points(s.report)})
    return f"{s.created_at:%Y-%m-%d %H:%M} · {', '.join(configs) or 'no points'} · {s.id[:8]}"


def frames(points: list[StoredSweepPoint], crossovers: list[Crossover]) -> tuple[pd.DataFrame, ...]:
    measured = pd.DataFrame([{"config": f"{p.config} ({p.weights})" if p.weights not in p.config else p.config,
                              "batch_size": p.batch_size, "decode_tokens_per_s": p.decode_tokens_per_s,
                              "tpot_ms": p.tpot_ms} for p in points])
    roofs = pd.DataFrame([{"config": f"{p.config} ({p.weights})" if p.weights not in p.config else p.config,
                           "roof": roof, "batch_size": p.batch_size, "tokens_per_s": value}
                          for p in points for roof, value in (("bandwidth", p.bandwidth_roofline_tokens_per_s),
                                                              ("compute", p.compute_roofline_tokens_per_s))
                          if value is not None],
                         columns=["config", "roof", "batch_size", "tokens_per_s"])
    marks = pd.DataFrame([{"label": c.label, "batch_size": c.batch_size} for c in crossovers],
                         columns=["label", "batch_size"])
    return measured, roofs, marks


def main() -> None:
    st.title("Batch sweep")
    st.caption("Decoding reads every weight once per step whatever the batch: at small batches it is bound by "
               "memory bandwidth (throughput grows with the batch), at large ones by compute (it flattens). A "
               "smaller precision pays while decoding is bandwidth bound.")
    try:
        listing = reads.sweeps()
    except SQLAlchemyError as exc:
        hints.database_unreadable(exc)
        return
    if not listing:
        st.info("No sweeps yet. A batch sweep serves each precision at growing batch sizes and stores throughput, "
                "latency and the machine's rooflines:")
        st.code(hints.SWEEP, language="bash")
        return
    sweep = pick(listing)
    points, crossovers = sweep_points(sweep.report), sweep_crossovers(sweep.report)
    if not points:
        st.warning("This sweep's report has no points this page can read (expected report.points with "
                   "config, weights, batch_size, decode_tokens_per_s, tpot_ms).")
        st.json(sweep.report, expanded=False)
        return
    measured, roofs, marks = frames(points, crossovers)
    st.altair_chart(charts.sweep_throughput(measured.dropna(subset=["decode_tokens_per_s"]), roofs, marks),
                    width="stretch")
    if measured["tpot_ms"].notna().any():
        st.altair_chart(charts.sweep_latency(measured.dropna(subset=["tpot_ms"]), marks), width="stretch")
    if crossovers:
        st.markdown("**Crossovers**: " + "; ".join(f"{c.label} at batch size {c.batch_size:g}" for c in crossovers))
    else:
        st.caption("The report marks no crossover in the batch sizes swept.")
    hardware = sweep.hardware or {}
    st.caption("Machine: " + ", ".join(f"{k} {v}" for k, v in hardware.items() if not isinstance(v, dict | list)))
    with st.expander("points"):
        st.dataframe(pd.DataFrame([p.__dict__ for p in points]), hide_index=True, width="stretch")


main()
