"""The shipped plans: each loads (its configs and workload too), and the prefix-caching plan changes one factor."""

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
    assert changed_factors(base, cand) == ["KV blocks and prefix caching"]
    assert plan.workload.name == "shared-prefix" and plan.spec.limits.gains


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
