"""KV cache: stored KV bytes against retained tokens, one straight line per config, with a run's requests on it;
then each run's prefix cache (its hit rate, n/a where nothing was looked up), its blocks at the KV peak against
the pool's size, and the rows preempted.

At a fixed model and cache precision every retained token stores the same bytes (2 x layers x kv_heads x
head_dim x bytes per element), so the cache grows on a line through the origin. The runs shown live in the
URL (?runs=<ids>); the line is fitted to the batches' measured peaks, and the page says how.
"""

from __future__ import annotations

from collections import defaultdict

import pandas as pd
import streamlit as st

from dashboard import charts, hints, reads
from servelab.analysis.metrics import pool_peak_use, prefix_cache
from servelab.store.queries import BatchPoint, RunListing, kv_bytes_per_token

EXPLANATION = (
    "**How this is drawn.** Each dot is one engine batch: its stored peak KV-cache bytes (computed by the "
    "engine from the model shape and the cache precision) against the tokens retained at that peak, as the "
    "engine stored them: with the paged cache, the columns of every block the rows held (whole blocks, a block "
    "shared by a prefix counted once); with transformers' cache, rows × its left-padded width. (Batches stored "
    "before retained tokens were kept are rebuilt from their shape: rows × (padded prompt length + steps).) The "
    "line is "
    "the least-squares fit through the origin; its slope is the bytes one retained token costs. The diamonds "
    "are the chosen run's requests, each at the tokens it kept when it finished (prompt + generated − 1: the "
    "last token is never fed back), placed on its config's line."
)
PREFIX_EXPLANATION = (
    "**Prefix cache.** Of the prompt tokens the engine looked up in its prefix cache over a run's batches, the "
    "share it found there and did not prefill (vLLM's prefix_cache_hits / prefix_cache_queries). *n/a* where "
    "nothing was looked up: prefix caching off, transformers' decoder, or batches stored before it was counted; "
    "that is no 0 %. Blocks are those of the run's batch with the most KV bytes: shared ones (read by two or "
    "more rows) are counted once in its bytes; *not paged* where the cache has no blocks. The pool is the paged "
    "cache's size as the run's worker built it (`batching.max_kv_cache_mib`, else `max_batch_tokens`); its peak use "
    "is the share of it those blocks held. Rows preempted are those taken out unfinished over the run's batches "
    "(the pool ran out mid-decode, or an interactive call needed the room): a pool that is too small shows here first."
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
    st.subheader("Prefix cache and blocks")
    st.dataframe(prefix_frame(reads.batch_points(tuple(run_ids)), listing), hide_index=True, width="stretch")
    st.markdown(PREFIX_EXPLANATION)


def prefix_frame(points: list[BatchPoint], listing: list[RunListing]) -> pd.DataFrame:
    """One row per run: its prefix-cache hit rate over its batches, its blocks at its KV peak against its pool, and
    the rows preempted."""
    by_run: dict[str, list[BatchPoint]] = defaultdict(list)
    for p in points:
        by_run[p.run_id].append(p)
    names = {r.id: _label(r) for r in listing}
    pools = {r.id: r.kv_pool_blocks for r in listing}
    rows = []
    for run_id, ps in by_run.items():
        c = prefix_cache(ps)
        paged = c.kv_block_size > 0
        pool = pools.get(run_id)
        rows.append({"run": names.get(run_id, run_id[:8]),
                     "prefix-cache hit rate": "n/a" if c.hit_rate is None else f"{c.hit_rate:.1%}",
                     "prompt tokens looked up": c.num_query_tokens, "found in the cache": c.num_hit_tokens,
                     # NOTE: text columns: a number or a word, one type per column
                     "block size (tokens)": str(c.kv_block_size) if paged else "not paged",
                     "blocks shared at the KV peak": str(c.kv_blocks_shared) if paged else "-",
                     "blocks private at the KV peak": str(c.kv_blocks_private) if paged else "-",
                     "pool (blocks)": str(pool) if paged and pool else "-",
                     "pool peak use": "-" if (use := pool_peak_use(c, pool)) is None else f"{use:.0%}",
                     "rows preempted": sum(p.num_preempted for p in ps)})
    return pd.DataFrame(rows)


main()
