"""The shipped plans: each loads (its configs and workload too), and the one-factor plans (prefix caching, cache
capacity, cache precision, cache eviction) change exactly their factor."""

from __future__ import annotations

from pathlib import Path

import pytest

from servelab.analysis.plan import load_plan
from servelab.analysis.verdict import changed_factors

REPO = Path(__file__).resolve().parents[2]

@pytest.mark.parametrize("path", sorted((REPO / "plans").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_plans_load(path: Path) -> None:
    plan = load_plan(path)
    assert plan.spec.name == path.stem and plan.workload.items and plan.candidates


def without_name(data: dict) -> dict:
    return {k: v for k, v in data.items() if k != "name"}


def differences(a: dict, b: dict, where: str = "") -> list[str]:
    """The dotted paths where two nested mappings differ."""
    found = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            found += differences(x, y, f"{where}{key}.")
        elif x != y:
            found.append(f"{where}{key}")
    return found


def test_the_prefix_caching_plan_turns_prefix_caching_on_and_changes_nothing_else() -> None:
    plan = load_plan(REPO / "plans" / "prefix-caching.yaml")
    (baseline, _), [(candidate, _)] = plan.baseline, plan.candidates
    assert not baseline.uses_prefix_caching and candidate.uses_prefix_caching
    base, cand = baseline.model_dump(mode="json"), candidate.model_dump(mode="json")
    assert differences(without_name(base), without_name(cand)) == ["kv_cache.prefix_caching"]
    assert changed_factors(base, cand) == ["prefix caching"]
    assert plan.workload.name == "shared-prefix" and plan.spec.limits.gains


@pytest.mark.parametrize(("plan_file", "fields", "factor"), [
    ("kv-capacity.yaml", ["batching.max_kv_cache_mib"], "cache capacity"),
    ("kv-int8.yaml", ["kv_cache_dtype"], "cache precision"),
    ("kv-window.yaml", None, "cache eviction"),  # None: the kv_cache fields of eviction, whatever their names
])
def test_each_cache_plan_changes_its_factor_alone(plan_file: str, fields: list[str] | None, factor: str) -> None:
    plan = load_plan(REPO / "plans" / plan_file)
    (baseline, _), [(candidate, _)] = plan.baseline, plan.candidates
    base, cand = baseline.model_dump(mode="json"), candidate.model_dump(mode="json")
    changed = differences(without_name(base), without_name(cand))
    assert changed == fields if fields is not None else changed and all(f.startswith("kv_cache.") for f in changed)
    assert changed_factors(base, cand) == [factor]


def test_the_capacity_plan_makes_the_small_pool_the_limit() -> None:
    """The burst's peak (every row at its full length, in blocks) fits the baseline's pool, not the candidate's."""
    plan = load_plan(REPO / "plans" / "kv-capacity.yaml")
    (large, _), [(small, _)] = plan.baseline, plan.candidates
    block_bytes = 2 * 30 * 3 * 64 * 4 * large.kv_cache.block_size  # the bundled model in fp32: 720 KiB a block
    # NOTE: 48 prompt tokens bounds the chat prompts with the bundled model's template (35-41)
    need = len(plan.workload.items) * -(-(48 + plan.workload.spec.max_new_tokens) // large.kv_cache.block_size)
    pool = {c.name: c.batching.max_kv_cache_mib * 2**20 // block_bytes for c in (large, small)}
    assert pool[small.name] < need / 4 and pool[large.name] >= need, (pool, need)
    assert small.decoding.max_context_tokens // small.kv_cache.block_size <= pool[small.name]  # the floor does not lift it


def test_the_window_configs_differ_by_eviction_alone_and_the_workload_fits_them() -> None:
    from servelab.analysis.plan import QualitySpec
    from servelab.analysis.workload import load_workload
    from servelab.config import ServingConfig

    long = ServingConfig.from_yaml(REPO / "configs" / "fp32-continuous-long.yaml")
    window = ServingConfig.from_yaml(REPO / "configs" / "fp32-continuous-window.yaml")
    assert differences(without_name(long.model_dump(mode="json")), without_name(window.model_dump(mode="json"))) == [
        "kv_cache.eviction"]
    workload = load_workload(REPO / "workloads" / "long-generation.yaml")
    assert all(item.max_new_tokens == 4000 <= window.decoding.max_new_tokens for item in workload.items)
    with pytest.raises(ValueError, match=r"long_context_scored_from \(2048\) must be below long_context_tokens"):
        QualitySpec(long_context_segments=4, long_context_scored_from=2048)


def test_the_demo_runs_until_settled_within_the_fixed_plans_budget() -> None:
    from servelab.analysis.plan import DEFAULT_REPEATS

    plan = load_plan(REPO / "plans" / "demo.yaml")
    budget = plan.spec.sequential
    assert budget is not None and budget.min_rounds < budget.max_rounds <= DEFAULT_REPEATS
    assert budget.passage_step < budget.max_passages <= plan.spec.quality.lambada_samples


def test_the_precision_pick_ranks_three_candidates_and_a_bad_rank_figure_is_refused(tmp_path) -> None:
    from servelab.analysis.plan import PlanError

    plan = load_plan(REPO / "plans" / "pick-precision.yaml")
    assert len(plan.candidates) == 3 and plan.spec.rank_by == "output_tokens_per_s" and plan.spec.sequential
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "plans" / "pick-precision.yaml").read_text().replace(
        "rank_by: output_tokens_per_s", "rank_by: p95_ttft"))
    with pytest.raises(PlanError, match="rank_by.*output_tokens_per_s"):
        load_plan(bad)
