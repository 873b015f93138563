"""The one-factor check: which factors two stored configs differ in, the cache's named one by one."""

from __future__ import annotations

import dataclasses

import pytest

from servelab.analysis.factors import FACTORS, changed_factors, field_value
from servelab.analysis.verdict import compare
from servelab.config import ServingConfig
from tests.analysis.test_verdict import BASE, LIMITS, run_set

BASELINE = ServingConfig.from_yaml("configs/fp32-continuous.yaml").model_dump(mode="json")


def changed(**sections) -> dict:
    """The baseline with some fields changed: top-level values, or a section's fields merged into it."""
    config = {**BASELINE}
    for key, value in sections.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    return config


@pytest.mark.parametrize(("candidate", "factor"), [
    (changed(kv_cache_dtype="bf16"), "cache precision"),
    (changed(batching={"max_kv_cache_mib": 64}), "cache capacity"),
    (changed(batching={"max_batch_tokens": 4096}), "cache capacity"),
    (changed(kv_cache={"eviction": "window", "sink_tokens": 64, "window_tokens": 512}), "cache eviction"),
    (changed(kv_cache={"window_tokens": 1024}), "cache eviction"),
    (changed(kv_cache={"prefix_caching": False}), "prefix caching"),
    (changed(kv_cache={"block_size": 32}), "cache block size"),
    (changed(kv_cache={"a_later_field": 1}), "KV cache (other settings)"),
    (changed(batching={"max_batch_size": 4}), "batching"),
    (changed(lm_head_weights="int8"), "weight precision"),
    (changed(linear_kernel="onednn"), "decoder and kernels"),
])
def test_each_cache_setting_is_its_own_factor(candidate: dict, factor: str) -> None:
    assert changed_factors(BASELINE, candidate) == [factor]


def test_a_field_a_stored_config_lacks_counts_as_its_default() -> None:
    """A run stored before a field existed was served with its default: no factor changed."""
    old = {k: v for k, v in BASELINE.items() if k != "lm_head_weights"}
    old["kv_cache"] = {k: v for k, v in BASELINE["kv_cache"].items() if k != "prefix_caching"}
    assert changed_factors(old, BASELINE) == []
    assert changed_factors(old, changed(kv_cache={"prefix_caching": False})) == ["prefix caching"]


def test_a_section_stands_for_the_fields_no_other_factor_names() -> None:
    assert "max_kv_cache_mib" not in field_value(BASELINE, "batching")
    assert "max_batch_size" in field_value(BASELINE, "batching")
    assert set(field_value(BASELINE, "kv_cache")) == set()  # every field of today's kv_cache has its factor
    assert all(paths for paths in FACTORS.values())


def test_the_verdict_names_the_cache_factors_a_candidate_changes() -> None:
    cand = run_set("both", tokens_per_s=(150.0,) * 4, tpot_ms=50.0, correct=34,
                   config={"kv_cache_dtype": "bf16", "batching": {"max_batch_size": 16, "max_kv_cache_mib": 32},
                           "kv_cache": {"eviction": "window", "window_tokens": 256}})
    warning = next(w for w in compare(BASE, cand, LIMITS).warnings if "factors" in w)
    assert "changes 3 factors (cache precision, cache capacity, cache eviction)" in warning


def test_the_verdict_shows_how_the_batch_formed_beside_the_gains_without_judging_it() -> None:
    """Mean batch, peak rows, rows preempted and the pool's peak use: figures, never criteria; a side at 0 has no
    ratio, and runs stored before these were summarised show none."""
    def with_shape(run_set, **shape):
        return dataclasses.replace(run_set, summaries=tuple({**s, **shape} for s in run_set.summaries))
    base = with_shape(BASE, mean_batch_size=15.0, peak_rows=16, num_preempted=0, kv_pool_peak_use=0.7)
    cand = with_shape(run_set("small", tokens_per_s=(40.0,) * 4, tpot_ms=50.0, correct=34,
                              config={"batching": {"max_batch_size": 16, "max_kv_cache_mib": 16}}),
                      mean_batch_size=3.0, peak_rows=3, num_preempted=5, kv_pool_peak_use=0.9)
    verdict = compare(base, cand, LIMITS)
    figures = {f.name: f for f in verdict.figures}
    assert figures["mean_batch_size"].ratio.value == pytest.approx(0.2)
    assert (figures["num_preempted"].baseline, figures["num_preempted"].candidate) == pytest.approx((0, 5))
    assert figures["num_preempted"].ratio is None
    assert not {c.name for c in verdict.criteria} & {"mean_batch_size", "peak_rows", "num_preempted"}
    assert "peak_rows" not in {f.name for f in compare(BASE, run_set("x", tokens_per_s=(1.0,) * 4, tpot_ms=50.0,
                                                                     correct=34), LIMITS).figures}
