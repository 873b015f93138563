"""Every page rendered by Streamlit's AppTest against real PostgreSQL and Redis: seeded, one run, empty."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator

import pytest
import streamlit as st
from sqlalchemy import delete
from sqlalchemy.orm import Session
from streamlit.testing.v1 import AppTest

from servelab.store.db import make_engine
from servelab.store.models import RunRow
from tests.conftest import REDIS_URL
from tests.dashboard.conftest import APP

PAGES = ("pages/compare.py", "pages/runs.py", "pages/sweep.py", "pages/kv_cache.py", "pages/jobs.py")


@pytest.fixture
def open_app(monkeypatch) -> Iterator[Callable[..., AppTest]]:
    def make(database_url: str, *, key_prefix: str = "servelab-test-dashboard", page: str | None = None,
             **params: str) -> AppTest:
        monkeypatch.setenv("SERVELAB_DATABASE_URL", database_url)
        monkeypatch.setenv("SERVELAB_REDIS_URL", REDIS_URL)
        monkeypatch.setenv("SERVELAB_KEY_PREFIX", key_prefix)
        st.cache_data.clear()
        st.cache_resource.clear()  # NOTE: each test reads its own database: connections are per test here
        at = AppTest.from_file(str(APP), default_timeout=120)
        at.query_params.update(params)
        at.run()
        if page:
            at.switch_page(page)
            at.run()
        assert not at.exception, [e.value for e in at.exception]
        return at

    yield make
    st.cache_data.clear()
    st.cache_resource.clear()


def texts(at: AppTest) -> str:
    parts = [e.value for kind in ("title", "header", "subheader", "markdown", "caption", "info", "warning",
                                  "error", "success", "code") for e in getattr(at, kind)]
    return "\n".join(str(p) for p in parts)


def charts(at: AppTest) -> list:
    return at.get("vega_lite_chart")


def test_compare_link_shows_the_verdict_then_every_figure(open_app, seeded) -> None:
    at = open_app(seeded.database_url, key_prefix=seeded.key_prefix,
                  baseline=",".join(seeded.baseline_ids), candidates=",".join(seeded.candidate_ids))
    headings = [h.value for h in at.subheader]
    assert any(seeded.candidate_name in h and seeded.baseline_name in h and "ACCEPT" in h for h in headings), \
        (headings, [w.value for w in at.warning])  # an inconclusive verdict says why in a warning box
    assert "plan dash-precision" in texts(at)  # the stored plan's limits, said where they came from
    criteria = at.dataframe[0].value
    assert set(criteria["result"]) <= {"pass", "FAIL", "unsure"} and {"quality", "latency", "gain"} == {
        c.split(":")[0] for c in criteria["criterion"]}
    assert all(criteria["interval"].str.startswith("["))  # two repeats each: every criterion has one
    for part in ("Settings", "Throughput and cost", "Latency", "Memory", "Task quality"):
        assert part in headings
    assert len(charts(at)) >= 7  # throughput x2, three CDFs, memory, quality
    assert "no price set: set SERVELAB_PRICE_PER_HOUR" in texts(at)  # in the cost chart's place: the runs had no price
    settings = at.dataframe[2].value
    assert settings.loc["weight precision", "differs"] == "✱" and settings.loc["model", "differs"] == ""
    for cache_setting in ("cache precision", "cache eviction", "prefix caching", "cache block size", "cache capacity"):
        assert cache_setting in settings.index, list(settings.index)
    assert at.query_params["baseline"] == ",".join(seeded.baseline_ids)


def test_compare_without_a_link_opens_the_newest_comparison(open_app, seeded) -> None:
    at = open_app(seeded.database_url)
    assert at.query_params["baseline"] == ",".join(seeded.baseline_ids)
    assert at.query_params["candidates"] == ",".join(seeded.candidate_ids)
    assert any(word in h.value for word in ("ACCEPT", "REJECT", "INCONCLUSIVE") for h in at.subheader)


def test_compare_refuses_runs_of_another_workload(open_app, seeded) -> None:
    at = open_app(seeded.database_url, baseline=",".join(seeded.baseline_ids),
                  candidates=seeded.other_workload_run_id)
    assert any("Not compared" in e.value and "same workload file" in e.value for e in at.error)
    assert "defaults" in texts(at)  # no stored comparison holds these runs: the defaults are shown
    assert not charts(at)


def test_compare_with_default_limits_can_be_edited_in_the_sidebar(open_app, seeded) -> None:
    at = open_app(seeded.database_url, baseline=seeded.baseline_ids[0], candidates=seeded.candidate_ids[0])
    assert "plan dash-precision" in texts(at)
    at = open_app(seeded.database_url, baseline=seeded.candidate_ids[0], candidates=seeded.baseline_ids[0])
    assert "saved nowhere" in texts(at)  # reversed sides: no stored comparison, defaults
    at.sidebar.number_input[0].set_value(0.5).run()
    assert not at.exception
    assert any("warning" in w.value or "one run per config" in w.value for w in at.warning)


@pytest.mark.parametrize("page", PAGES[1:])
def test_every_page_renders_the_seeded_runs(open_app, seeded, page) -> None:
    at = open_app(seeded.database_url, key_prefix=seeded.key_prefix, page=page)
    shown = texts(at)
    if page == "pages/runs.py":
        frame = at.dataframe[0].value
        assert len(frame) == 5 and frame["compare"].str.startswith("/?baseline=").all()
    elif page == "pages/sweep.py":
        assert "No sweeps yet" in shown and "servelab sweep" in shown
    elif page == "pages/kv_cache.py":
        assert charts(at) and "bytes per retained token" in at.dataframe[0].value.columns
        assert (at.dataframe[0].value["largest gap to the line"] == "0.0%").all()
        shown_cache = at.dataframe[1].value
        assert len(shown_cache) == len(at.multiselect[0].value) and "Prefix cache" in shown
        assert list(shown_cache["prefix-cache hit rate"]) == expected_hit_rates(seeded, at.multiselect[0].value)
    elif page == "pages/jobs.py":
        frames = [d.value for d in at.dataframe]
        assert any(seeded.failure_reason in set(f.get("reason", [])) for f in frames)
        assert any("progress" in f.columns for f in frames) and any("interactive stream" in f.columns for f in frames)


def expected_hit_rates(seeded, run_ids: list[str]) -> list[str]:
    """Each run's hit rate as its stored summary says it: n/a where nothing was looked up."""
    engine = make_engine(seeded.database_url)
    try:
        with Session(engine) as session:
            rates = [session.get(RunRow, uuid.UUID(i)).summary["prefix_cache_hit_rate"] for i in run_ids]
    finally:
        engine.dispose()
    return ["n/a" if rate is None else f"{rate:.1%}" for rate in rates]


def test_runs_page_filters_live_in_the_url(open_app, seeded) -> None:
    at = open_app(seeded.database_url, page="pages/runs.py")
    at.multiselect[1].set_value(["bf16"]).run()
    assert at.query_params["weights"] in ("bf16", ["bf16"])
    assert set(at.dataframe[0].value["weight precision"]) == {"bf16"} and len(at.dataframe[0].value) == 3


def test_sweep_page_draws_a_stored_sweep_with_rooflines_and_crossovers(open_app, fresh_database_url) -> None:
    """A report of the shape servelab/analysis/roofline.py's SweepReport.as_dict() writes, hand-made for speed."""
    from servelab.store.db import make_engine, session_factory, session_scope
    from servelab.store.migrate import upgrade
    from servelab.store.runs import save_sweep

    upgrade(fresh_database_url)
    engine = make_engine(fresh_database_url)
    points = [{"config": c, "weights": c, "batch_size": b, "decode_tokens_per_s": tps * b / (1 + b / 8),
               "tpot_ms": 1000 / tps * (1 + b / 8), "bandwidth_roofline_tokens_per_s": tps * 1.5 * b,
               "compute_roofline_tokens_per_s": 4000.0} for c, tps in (("fp32", 30.0), ("bf16", 55.0))
              for b in (1, 2, 4, 8, 16)]
    with session_scope(session_factory(engine)) as session:
        sweep_id = save_sweep(session, report={"points": points, "crossovers": {"bf16": 8}, "baseline": "fp32"},
                              hardware={"cpu": "test", "bandwidth_gbs": 38})
    engine.dispose()
    at = open_app(fresh_database_url.render_as_string(hide_password=False), page="pages/sweep.py")
    assert len(charts(at)) == 2 and "bf16 stops paying against fp32 at batch size 8" in texts(at)
    assert at.query_params["sweep"] == sweep_id


@pytest.mark.parametrize("page", PAGES)
def test_empty_database_says_what_to_run(open_app, empty_url, page) -> None:
    at = open_app(empty_url, page=None if page == PAGES[0] else page)
    shown = texts(at)
    assert "servelab" in shown, shown  # every empty state names the command to run next
    assert not charts(at)


def test_one_run_says_how_to_get_a_comparison(open_app, seeded) -> None:
    at = open_app(seeded.one_run_url)
    shown = texts(at)
    assert "Only one run so far" in shown and "servelab run" in shown
    assert not at.subheader


def test_unmigrated_database_says_how_to_migrate(open_app) -> None:
    from tests.conftest import create_test_database, drop_test_database

    url = create_test_database()
    try:
        at = open_app(url.render_as_string(hide_password=False))
        assert "alembic upgrade head" in texts(at)
    finally:
        st.cache_resource.clear()
        drop_test_database(url)


def test_a_comparison_run_until_settled_shows_how_each_interval_narrowed(open_app, seeded) -> None:
    """A sequential record built by the lab's own code from the seeded runs' real verdicts (two looks: 4 passages,
    then all 8; a zero accuracy-drop limit is final only at the planned 8), stored as the newest comparison of these
    runs; removed after."""
    from dataclasses import replace

    from dashboard.pages.compare import narrowing_frame
    from servelab.analysis.sequential import Look, SequentialRecord, SequentialSpec
    from servelab.analysis.verdict import compare
    from servelab.lab import runsets
    from servelab.store.db import session_factory, session_scope
    from servelab.store.models import ComparisonRow
    from servelab.store.runs import save_comparison

    engine, comparison_id = make_engine(seeded.database_url), None
    try:
        with session_scope(session_factory(engine)) as session:
            base, cand = (runsets.load_run_set(session, run_ids=ids) for ids in (seeded.baseline_ids,
                                                                                  seeded.candidate_ids))
            stored = runsets.stored_limits(session, baseline_run_ids=seeded.baseline_ids,
                                           candidate_run_ids=seeded.candidate_ids)
            limits = stored.limits.model_copy(update={"max_accuracy_drop": 0.0})
            spec = SequentialSpec(min_rounds=2, max_rounds=2, passage_step=4, max_passages=8)
            record = SequentialRecord(spec, spec.levels(exact_passages=8))
            for index, passages in ((1, 4), (2, 8)):
                first = [replace(s, quality=replace(s.quality, **{f: getattr(s.quality, f)[:passages] for f in (
                    "passage_ids", "correct", "nll", "num_target_tokens")})) for s in (base, cand)]
                record.add(Look(index, 2, passages, index / 2), [compare(*first, limits, levels=record.levels)], limits,
                           has_passages=True)
            comparison_id = save_comparison(
                session, plan_name="dash-sequential", plan={"limits": limits.model_dump(mode="json")},
                baseline_run_ids=seeded.baseline_ids, candidate_run_ids=seeded.candidate_ids,
                report={"sequential": record.as_dict()})
        at = open_app(seeded.database_url, baseline=",".join(seeded.baseline_ids),
                      candidates=",".join(seeded.candidate_ids))
        shown = texts(at)
        assert "How the intervals narrowed" in [h.value for h in at.header] and record.stop in shown
        narrowing = [spec for spec in (json.loads(c.spec) for c in charts(at)) if "facet" in spec]
        assert len(narrowing) == 1 and narrowing[0]["facet"]["field"] == "criterion"
        frame = narrowing_frame(record.as_dict(), seeded.candidate_name)  # what the chart draws
        assert set(frame["look"]) == {1, 2} and list(frame["where"])[0] == "2 rounds, 4 passages"
        assert set(frame["criterion"]) == {c.name for c in record.verdicts[seeded.candidate_name].criteria}
        weights = frame[frame["criterion"] == "weight_bytes"]
        assert list(weights["limit"]) == [0.75, 0.75] and (weights["low"] <= weights["high"]).all()
        # the page's verdict reads these runs at the comparison's own levels, not at a fixed 95 %
        # (one look over rounds: the runs' 95 %; two over passages: 97.5 % each)
        level = f"the runs' {100 * record.levels.runs:.2f} %, the passages' {100 * record.levels.passages:.2f} %"
        assert record.levels.passages > 0.95 and any(level in c.value for c in at.caption), shown
    finally:
        if comparison_id is not None:
            with session_scope(session_factory(engine)) as session:
                session.execute(delete(ComparisonRow).where(ComparisonRow.id == uuid.UUID(comparison_id)))
        engine.dispose()


def test_several_candidates_are_ranked_with_each_pair_told_apart_or_not(tmp_path) -> None:
    """The compare page's ranking section on hand-made run sets (tests/analysis/test_ranking.py's), as a script of its
    own. NOTE: not AppTest.from_function: it leaves this process's __main__ such that later subprocesses (the bench's
    relay, the fault tests' forked workers) fail to start."""
    script = tmp_path / "ranking_page.py"
    script.write_text(
        "from dashboard.pages.compare import show_ranking\n"
        "from servelab.analysis.verdict import compare\n"
        "from tests.analysis.test_ranking import candidates\n"
        "from tests.analysis.test_verdict import BASE, LIMITS\n"
        "sets = candidates()\n"
        "show_ranking(sets, [compare(BASE, c, LIMITS) for c in sets], LIMITS, None)\n")
    at = AppTest.from_file(str(script), default_timeout=60).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.success[0].value.startswith("best: fast")
    ranked, pairs = (d.value for d in at.dataframe)
    assert list(ranked["candidate"]) == ["fast", "second", "close"]
    assert pairs.set_index("pair").loc["second / close", "told apart"].startswith("no")
    assert any("Not ranked: slow" in c.value for c in at.caption)
