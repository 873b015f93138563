"""KV cache: stored KV bytes against retained tokens, one straight line per config, with a run's requests on it.

At a fixed model and cache precision every retained token stores the same bytes (2 x layers x kv_heads x
head_dim x bytes per element), so the cache grows on a line through the origin. The runs shown live in the
URL (?runs=<ids>); the line is fitted to the batches' measured peaks, and the page says how.
"""

from __future__ import annotations

from collections import defaultdict

import pandas as pd
import streamlit as st

from dashboard import charts, hints, reads
from servelab.store.queries import BatchPoint, RunListing, kv_bytes_per_token

EXPLANATION = (
    "**How this is drawn.** Each dot is one engine batch: its stored peak KV-cache bytes (computed by the "
    "engine from the model shape and the cache precision) against the tokens retained at that peak. Retained "
    "tokens are not stored, so they are rebuilt from the batch's shape: after step *s* (0 = the prefill) the "
    "cache holds rows × (padded prompt length + *s*) tokens, and the peak over the steps is taken. The line is "
    "the least-squares fit through the origin; its slope is the bytes one retained token costs. The diamonds "
    "are the chosen run's requests, each at the tokens it kept when it finished (prompt + generated − 1: the "
    "last token is never fed back), placed on its config's line."
)


def pick(listing: list[RunListing]) -> tuple[list[str], str | None]:
    ids = [r.id for r in listing]
    by_id = {r.id: r for r in listing}
    wanted = [i for i in reads.query_ids("runs") if i in by_id]
    if not wanted:  # the newest run of each config on the newest workload
        newest = {}
        for r in listing:
            if r.workload_fingerprint == listing[0].workload_fingerprint:
                newest.setdefault(r.serving_config_name, r.id)
        wanted = list(newest.values())
    chosen = st.multiselect("runs", ids, default=wanted, format_func=lambda i: _label(by_id[i]))
    if ",".join(chosen) != st.query_params.get("runs", ""):
        st.query_params["runs"] = ",".join(chosen)
    shown = st.selectbox("requests of the run", chosen, format_func=lambda i: _label(by_id[i])) if chosen else None
    return chosen, shown


def _label(r: RunListing) -> str:
    return (f"{r.serving_config_name} · {r.settings['weight precision']} / cache {r.settings['cache precision']} · "
            f"{r.workload_name} · repeat {r.repeat_index} · {r.id[:8]}")


def fitted(points: list[BatchPoint]) -> dict[str, tuple[float, list[BatchPoint]]]:
    by_config: dict[str, list[BatchPoint]] = defaultdict(list)
    for p in points:
        if p.retained_tokens > 0:
            by_config[p.serving_config_name].append(p)
    return {name: (slope, ps) for name, ps in by_config.items() if (slope := kv_bytes_per_token(ps))}


def main() -> None:
    st.title("KV cache")
    listing = hints.runs_or_explain(reads.runs)
    if listing is None:
        return
    run_ids, shown = pick(listing)
    if not run_ids:
        st.info("Pick one or more runs.")
        return
    lines = fitted(reads.batch_points(tuple(run_ids)))
    if not lines:
        st.warning("These runs' batches store no KV-cache figures.")
        return
    max_tokens = max(p.retained_tokens for _, ps in lines.values() for p in ps)
    requests = [r for r in reads.request_tokens((shown,)) if r.serving_config_name in lines] if shown else []
    max_tokens = max([max_tokens, *(r.retained_tokens for r in requests)])
    line_frame = pd.DataFrame([{"config": name, "tokens": t, "kib": slope * t / 1024}
                               for name, (slope, _) in lines.items() for t in (0, max_tokens)])
    batch_frame = pd.DataFrame([{"config": name, "tokens": p.retained_tokens, "kib": p.kv_cache_bytes / 1024,
                                 "num_requests": p.num_requests} for name, (_, ps) in lines.items() for p in ps])
    request_frame = pd.DataFrame([{"config": r.serving_config_name, "run": r.run_id[:8], "tokens": r.retained_tokens,
                                   "kib": lines[r.serving_config_name][0] * r.retained_tokens / 1024}
                                  for r in requests], columns=["config", "run", "tokens", "kib"])
    st.altair_chart(charts.kv_cache_lines(line_frame, batch_frame, request_frame), width="stretch")
    st.dataframe(pd.DataFrame([{
        "config": name, "weights": ps[0].weights, "cache precision": ps[0].kv_cache_dtype, "batches": len(ps),
        "bytes per retained token": round(slope, 1),
        "largest gap to the line": f"{max(abs(p.kv_cache_bytes - slope * p.retained_tokens) / p.kv_cache_bytes for p in ps):.1%}",
    } for name, (slope, ps) in lines.items()]), hide_index=True, width="stretch")
    st.markdown(EXPLANATION)


main()
