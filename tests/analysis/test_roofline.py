"""Roofline arithmetic and the crossover rule, on hand-made numbers (no torch, no timing)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from servelab.analysis.roofline import (
    DecodeCost,
    Machine,
    SweepPoint,
    SweepReport,
    bandwidth_roofline,
    binding_bound,
    compute_roofline,
    crossover_batch_size,
    mean_decode_context,
    ridge_batch_size,
    sweep_point,
)

# 1,000 weight bytes, 100 matmul params, 2 layers x attention width 4, 10 KV bytes per cached token
COST = DecodeCost(weight_bytes=1000, num_matmul_params=100, num_layers=2, attention_width=4, kv_bytes_per_token=10)
MACHINE = Machine(bandwidth_gbs=1e-6, peak_flops_per_s=1000.0)  # 1,000 bytes/s, 1,000 FLOP/s
CONTEXT = 5.0


def test_flops_per_token_count_two_per_weight_plus_attention_over_the_context() -> None:
    assert COST.flops_per_token(CONTEXT) == 2 * 100 + 4 * 2 * 5 * 4  # 360


def test_bytes_per_step_read_weights_once_and_every_rows_kv_cache() -> None:
    assert COST.bytes_per_step(batch_size=2, context_tokens=CONTEXT) == 1000 + 2 * 5 * 10


def test_bandwidth_roofline_is_batch_times_bandwidth_over_bytes_per_step() -> None:
    assert bandwidth_roofline(COST, MACHINE, 2, CONTEXT) == pytest.approx(2 * 1000 / 1100)


def test_compute_roofline_is_peak_over_flops_per_token_whatever_the_batch() -> None:
    assert compute_roofline(COST, MACHINE, CONTEXT) == pytest.approx(1000 / 360)


def test_the_rooflines_meet_at_the_ridge_batch_size() -> None:
    ridge = ridge_batch_size(COST, MACHINE, CONTEXT)
    assert ridge == pytest.approx(1000 * 1000 / (1000 * 360 - 1000 * 5 * 10))
    assert bandwidth_roofline(COST, MACHINE, ridge, CONTEXT) == pytest.approx(compute_roofline(COST, MACHINE, CONTEXT))
    assert binding_bound(COST, MACHINE, int(ridge), CONTEXT) == "bandwidth"
    assert binding_bound(COST, MACHINE, int(ridge) + 1, CONTEXT) == "compute"


def test_without_a_kv_cache_the_ridge_is_machine_balance_over_intensity_per_row() -> None:
    no_kv = replace(COST, kv_bytes_per_token=0, num_layers=0)
    balance = MACHINE.peak_flops_per_s / (MACHINE.bandwidth_gbs * 1e9)  # FLOPs per byte
    assert ridge_batch_size(no_kv, MACHINE, CONTEXT) == pytest.approx(balance / (200 / 1000))


def test_an_expensive_kv_cache_keeps_every_batch_bandwidth_bound() -> None:
    heavy_kv = replace(COST, kv_bytes_per_token=1000)  # 5 tokens x 1,000 bytes outweigh 360 FLOPs a token
    assert ridge_batch_size(heavy_kv, MACHINE, CONTEXT) is None
    assert binding_bound(heavy_kv, MACHINE, 1_000_000, CONTEXT) == "bandwidth"


def test_int4_weights_raise_the_bandwidth_roofline_but_not_the_compute_roofline() -> None:
    int4 = replace(COST, weight_bytes=COST.weight_bytes // 8)  # same logical weights, 1/8 of the fp32 bytes
    assert bandwidth_roofline(int4, MACHINE, 1, CONTEXT) > bandwidth_roofline(COST, MACHINE, 1, CONTEXT)
    assert compute_roofline(int4, MACHINE, CONTEXT) == compute_roofline(COST, MACHINE, CONTEXT)
    assert ridge_batch_size(int4, MACHINE, CONTEXT) < ridge_batch_size(COST, MACHINE, CONTEXT)


def test_mean_decode_context_is_the_prompt_plus_half_the_new_tokens() -> None:
    assert mean_decode_context(64, 32) == 80


def point(config: str, batch_size: int, decode_tokens_per_s: float, *, bandwidth: float = 100.0,
          compute: float = 50.0) -> SweepPoint:
    return SweepPoint(config=config, weights="fp32", batch_size=batch_size, num_prompt_tokens=64, num_new_tokens=32,
                      decode_tokens_per_s=decode_tokens_per_s, tpot_ms=10.0, tokens_per_s=decode_tokens_per_s / 2,
                      bandwidth_roofline_tokens_per_s=bandwidth, compute_roofline_tokens_per_s=compute,
                      ridge_batch_size=3.0)


def curve(config: str, speeds: dict[int, float]) -> list[SweepPoint]:
    return [point(config, b, s) for b, s in speeds.items()]


def test_crossover_is_the_first_batch_size_where_the_candidate_stops_winning() -> None:
    base = curve("fp32", {1: 10, 2: 20, 4: 40, 8: 80})
    cand = curve("bf16", {1: 15, 2: 25, 4: 39, 8: 70})
    assert crossover_batch_size(base, cand) == 4


def test_crossover_is_none_when_the_candidate_wins_at_every_batch_size() -> None:
    assert crossover_batch_size(curve("fp32", {1: 10, 4: 40}), curve("bf16", {1: 11, 4: 41})) is None


def test_crossover_ignores_a_loss_the_candidate_recovers_from() -> None:
    base = curve("fp32", {1: 10, 2: 20, 4: 40, 8: 80, 16: 160})
    cand = curve("bf16", {1: 15, 2: 19, 4: 45, 8: 70, 16: 100})
    assert crossover_batch_size(base, cand) == 8


def test_crossover_counts_a_tie_as_no_win_and_a_loss_everywhere_as_the_smallest_size() -> None:
    base = curve("fp32", {1: 10, 4: 40})
    assert crossover_batch_size(base, curve("bf16", {1: 15, 4: 40})) == 4
    assert crossover_batch_size(base, curve("bf16", {1: 5, 4: 20})) == 1


def test_crossover_compares_only_batch_sizes_measured_on_both_sides() -> None:
    base = curve("fp32", {1: 10, 2: 20, 4: 40})
    cand = curve("bf16", {1: 15, 4: 30, 8: 1})
    assert crossover_batch_size(base, cand) == 4


def test_crossover_refuses_points_of_two_configs_on_one_side() -> None:
    with pytest.raises(AssertionError, match="one config"):
        crossover_batch_size(curve("fp32", {1: 10}) + curve("other", {2: 20}), curve("bf16", {1: 15}))


def test_a_point_is_bound_by_the_lower_roofline_and_reports_its_fraction() -> None:
    p = point("fp32", 1, 25.0, bandwidth=100.0, compute=50.0)
    assert (p.bound, p.roofline_tokens_per_s, p.fraction_of_roofline) == ("compute", 50.0, 0.5)
    q = point("fp32", 1, 25.0, bandwidth=40.0, compute=50.0)
    assert (q.bound, q.fraction_of_roofline) == ("bandwidth", 25.0 / 40.0)


def test_sweep_point_places_a_measurement_against_both_rooflines() -> None:
    p = sweep_point(config="c", weights="fp32", batch_size=2, num_prompt_tokens=4, num_new_tokens=2,
                    decode_tokens_per_s=1.0, tpot_ms=1000.0, tokens_per_s=0.5, cost=COST, machine=MACHINE)
    assert p.bandwidth_roofline_tokens_per_s == pytest.approx(bandwidth_roofline(COST, MACHINE, 2, CONTEXT))
    assert p.compute_roofline_tokens_per_s == pytest.approx(compute_roofline(COST, MACHINE, CONTEXT))
    assert p.ridge_batch_size == pytest.approx(ridge_batch_size(COST, MACHINE, CONTEXT))


def test_a_sweep_report_serialises_to_json_with_derived_fields() -> None:
    points = (point("fp32", 1, 10.0), point("bf16", 1, 12.0))
    report = SweepReport(bandwidth_gbs=38.0, peak_flops_per_s={"fp32": 5e10, "bf16": 1e9}, num_threads=1,
                         device="cpu", points=points, crossovers={"bf16": None}, baseline="fp32")
    record = json.loads(json.dumps(report.as_dict()))
    assert record["crossovers"] == {"bf16": None} and record["baseline"] == "fp32"
    assert record["points"][0]["bound"] == "compute" and record["points"][0]["fraction_of_roofline"] == 0.2
