"""The dashboard's queries on runs made by the real lab code; no Streamlit."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
import redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from servelab.analysis.metrics import prefix_cache
from servelab.memory import ModelShape
from servelab.lab import runsets
from servelab.queue.streams import stream_depths
from servelab.store import queries
from servelab.store.db import make_engine
from servelab.store.models import RunRequestRow, RunRow
from servelab.store.requests import register_worker
from tests.conftest import REDIS_URL

# tests/engine/conftest.py's tiny Llama: 2 layers, 2 KV heads, hidden 64 / 4 heads = head_dim 16
TINY_SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_dim=16, vocab_size=0)


@pytest.fixture(scope="module")
def db(seeded):
    engine = make_engine(seeded.database_url)
    with Session(engine) as session:
        yield session
    engine.dispose()


def test_runs_are_listed_newest_first_with_every_setting(db, seeded) -> None:
    listing = queries.list_runs(db)
    assert len(listing) == 5
    assert [r.started_at for r in listing] == sorted((r.started_at for r in listing), reverse=True)
    by_id = {r.id: r for r in listing}
    base = by_id[seeded.baseline_ids[0]]
    assert base.settings["weight precision"] == "fp32" and by_id[seeded.candidate_ids[0]].settings[
        "weight precision"] == "bf16"
    assert set(base.settings) >= {"model", "batch policy", "cache precision", "cache eviction", "prefix caching",
                                  "cache block size", "cache capacity"}
    assert "max_batch_size=4" in base.settings["batch policy"]
    # NOTE: the tiny model is served by servelab's decoder: a paged pool, sized by max_batch_tokens, that its
    # worker registered with its hardware
    assert base.kv_pool_blocks and f"pool {base.kv_pool_blocks} blocks x 16 tokens" in base.settings["cache capacity"]
    assert base.settings["cache eviction"].startswith("none") and base.settings["prefix caching"] == "on (default)"
    assert base.num_preempted == 0 and base.mean_batch_size > 0 and base.p95_queue_ms is not None
    assert base.num_succeeded == 6 and base.output_tokens_per_s > 0 and base.p95_ttft_ms > 0
    assert 0 <= base.lambada_accuracy <= 1 and by_id[seeded.other_workload_run_id].lambada_accuracy is None
    assert len(queries.list_runs(db, workload_fingerprint=base.workload_fingerprint)) == 4


def test_a_run_set_holds_every_request_its_runs_sent(db, seeded) -> None:
    """What the verdict judges: every request of every repeat, and figures that add up to the stored runs."""
    run_set = runsets.load_run_set(db, run_ids=seeded.baseline_ids)
    sent = db.scalars(select(RunRequestRow.request_id).where(
        RunRequestRow.run_id.in_([uuid.UUID(i) for i in seeded.baseline_ids]))).all()
    assert sorted(s.request_id for s in run_set.pooled()) == sorted(str(i) for i in sent)
    assert sum(s.num_output_tokens for s in run_set.pooled()) == sum(x["output_tokens"] for x in run_set.summaries)
    assert len(run_set.summaries) == len(seeded.baseline_ids) == 2
    for run_id, samples, summary in zip(seeded.baseline_ids, run_set.samples, run_set.summaries):  # run by run
        sent_by_run = db.scalars(select(RunRequestRow.request_id).where(RunRequestRow.run_id == uuid.UUID(run_id))).all()
        assert sorted(s.request_id for s in samples) == sorted(str(i) for i in sent_by_run)
        assert sum(s.num_output_tokens for s in samples) == summary["output_tokens"]
    assert run_set.repeat_indices == (0, 1)  # the rounds of the plan, which pair runs across configs
    assert run_set.quality is not None and len(run_set.quality.correct) == 8
    with pytest.raises(ValueError, match="must share a config and a workload"):
        runsets.load_run_set(db, run_ids=[seeded.baseline_ids[0], seeded.candidate_ids[0]])


def test_limits_come_from_the_stored_plan_else_defaults(db, seeded) -> None:
    stored = runsets.stored_limits(db, baseline_run_ids=seeded.baseline_ids, candidate_run_ids=seeded.candidate_ids)
    assert "dash-precision" in stored.source and stored.limits.max_accuracy_drop == 1.0
    assert stored.limits.gains[0].metric == "weight_bytes"
    one_repeat = runsets.stored_limits(db, baseline_run_ids=seeded.baseline_ids[:1],
                                       candidate_run_ids=seeded.candidate_ids[:1])
    assert one_repeat.limits == stored.limits  # a subset of a stored comparison's runs keeps its plan
    other = runsets.stored_limits(db, baseline_run_ids=seeded.baseline_ids,
                                  candidate_run_ids=[seeded.other_workload_run_id])
    assert other.source == "defaults" and other.limits == runsets.DEFAULT_LIMITS


def test_retained_tokens_put_every_batch_on_its_configs_line(db, seeded) -> None:
    points = queries.batch_points(db, run_ids=seeded.baseline_ids)
    assert points and {p.serving_config_name for p in points} == {seeded.baseline_name}
    fp32_per_token = TINY_SHAPE.kv_bytes_per_token(4)
    for p in points:  # the engine's own figure, from the model shape, equals the rebuilt tokens x bytes per token
        assert p.kv_cache_bytes == fp32_per_token * p.retained_tokens
    assert queries.kv_bytes_per_token(points) == pytest.approx(fp32_per_token)
    requests = queries.request_tokens(db, run_ids=seeded.baseline_ids[:1])
    assert len(requests) == 6 and all(r.num_generated_tokens == 4 for r in requests)
    assert all(r.retained_tokens == r.num_prompt_tokens + 3 for r in requests)


def test_a_runs_stored_prefix_cache_figures_are_its_batches(db, seeded) -> None:
    """The run summary's hit rate and blocks, as the KV page rebuilds them from the batches it reads."""
    for run_id in seeded.baseline_ids:
        summary = db.get(RunRow, uuid.UUID(run_id)).summary
        cache = prefix_cache(queries.batch_points(db, run_ids=[run_id]))
        assert (summary["prefix_cache_query_tokens"], summary["prefix_cache_hit_tokens"],
                summary["prefix_cache_hit_rate"]) == (cache.num_query_tokens, cache.num_hit_tokens, cache.hit_rate)
        assert (summary["kv_block_size"], summary["kv_blocks_shared"], summary["kv_blocks_private"]) == (
            cache.kv_block_size, cache.kv_blocks_shared, cache.kv_blocks_private)
        assert (summary["prefix_cache_hit_rate"] is None) == (summary["prefix_cache_query_tokens"] == 0)


def test_peak_retained_tokens_follow_the_batch_shape() -> None:
    assert queries.peak_retained_tokens([4, 4, 4, 4], 4 * 10) == 4 * 13
    assert queries.peak_retained_tokens([4, 4, 1, 1, 1, 1, 1], 40) == max(4 * 11, 1 * 16)
    assert queries.peak_retained_tokens([], 0) == 0


def test_jobs_queues_workers_and_failures(db, seeded) -> None:
    [job] = queries.job_progress(db)
    assert job.counts == {"failed": 1, "queued": 2} and job.num_total == 3 and job.num_finished == 1
    counts = queries.request_status_counts(db)
    # 2 repeats x 6 requests, and whatever the runner sends to warm its worker up
    assert counts[seeded.baseline_name]["succeeded"] >= 12 and counts[seeded.baseline_name]["queued"] == 3
    assert seeded.baseline_name in queries.unfinished_config_names(db)
    assert queries.workers(db, now=datetime.now(UTC)) == []  # the lab's workers stopped cleanly and unregistered
    register_worker(db, name="gpu0", serving_config_name=seeded.baseline_name, config_hash="h",
                    hardware={"cpu": "AMD EPYC"}, software={})  # a live worker (rolled back below)
    workers = queries.workers(db, now=datetime.now(UTC))
    db.rollback()
    assert [(w.name, w.serving_config_name) for w in workers] == [("gpu0", seeded.baseline_name)]
    assert all(w.seconds_since_heartbeat >= 0 and "AMD EPYC" in w.hardware for w in workers), workers
    [failure] = queries.recent_failures(db)
    assert failure.reason == seeded.failure_reason and failure.num_attempts == 1
    client = redis.Redis.from_url(REDIS_URL)
    try:
        depths = stream_depths(client, prefix=seeded.key_prefix, config_names=["never-served"])
    finally:
        client.close()
    assert depths["never-served"] == {"interactive": 0, "bulk": 0}
    assert depths[seeded.baseline_name] == {"interactive": 0, "bulk": 0}  # served and acknowledged


def test_a_real_sweep_report_is_read_back_point_for_point() -> None:
    from servelab.analysis.roofline import DecodeCost, Machine, SweepReport, sweep_point
    from servelab.store.queries import sweep_crossovers, sweep_points

    cost = DecodeCost(weight_bytes=1000, num_matmul_params=500, num_layers=2, attention_width=64, kv_bytes_per_token=8)
    machine = Machine(bandwidth_gbs=10.0, peak_flops_per_s=1e10)
    points = [sweep_point(config="fp32", weights="fp32", batch_size=b, num_prompt_tokens=8, num_new_tokens=4,
                          decode_tokens_per_s=10.0 * b, tpot_ms=100.0, tokens_per_s=9.0 * b, cost=cost, machine=machine)
              for b in (1, 4)]
    report = SweepReport(10.0, {"fp32": 1e10}, 1, "cpu", tuple(points), {"bf16": 4}, "fp32").as_dict()
    read = sweep_points(report)
    assert [(p.config, p.batch_size, p.decode_tokens_per_s) for p in read] == [("fp32", 1, 10.0), ("fp32", 4, 40.0)]
    assert read[0].bandwidth_roofline_tokens_per_s == points[0].bandwidth_roofline_tokens_per_s
    assert read[1].compute_roofline_tokens_per_s == points[1].compute_roofline_tokens_per_s
    assert [(c.label, c.batch_size) for c in sweep_crossovers(report)] == [("bf16 stops paying against fp32", 4)]
