"""Runs and plans end to end: real worker processes, the real queue, PostgreSQL and Redis; tiny model."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from servelab.cli import app
from servelab.config import ServingConfig
from servelab.analysis.report import format_verdicts
from servelab.lab.runner import run_workload, start_worker
from servelab.analysis.stats import Estimate
from servelab.analysis.verdict import Criterion, Verdict
from servelab.analysis.workload import load_workload
from servelab.runtime import connect
from servelab.store.db import session_scope
from servelab.store.models import ComparisonRow, RequestRow, ResultRow, RunRequestRow, RunRow, StreamKind
from tests.conftest import service_env
from tests.engine.kernel_labels import auto_kernel_label


@pytest.fixture
def runtime(service_settings):
    rt = connect(service_settings)
    yield rt
    rt.close()


def tiny_config(tmp_path: Path, tiny_folder: Path, name: str, *, weights: str = "fp32", batch: int = 4) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\nmodel: {tiny_folder}\nweights: {weights}\ndevice: cpu\nnum_threads: 1\n"
                    f"batching:\n  max_batch_size: {batch}\n  max_wait_ms: 50\n"
                    "decoding:\n  max_new_tokens: 16\n  max_context_tokens: 256\n")
    return path


def workload_file(tmp_path: Path) -> Path:
    path = tmp_path / "burst.yaml"
    path.write_text("prompts: {set: chat, num_prompts: 4, seed: 2}\nmax_new_tokens: 4\nignore_eos: true\n"
                    "arrival: {process: burst}\nbulk: {num_requests: 2, min_new_tokens: 4, max_new_tokens: 4}\n"
                    "slo: {ttft_ms: 600000}\n")
    return path


def test_a_run_stores_its_config_hardware_and_every_request_it_sent(tmp_path, tiny_folder, runtime) -> None:
    config_path = tiny_config(tmp_path, tiny_folder, f"tiny-{uuid.uuid4().hex[:6]}")
    config = ServingConfig.from_yaml(config_path)
    workload = load_workload(workload_file(tmp_path))
    with start_worker(config, config_path, runtime) as worker:
        outcome = run_workload(workload=workload, config=config, worker=worker)
    with session_scope(runtime.sessions) as session:
        run = session.get(RunRow, uuid.UUID(outcome.run_id))
        sent = session.scalars(select(RunRequestRow.request_id).where(RunRequestRow.run_id == run.id)).all()
        tokens = session.scalar(select(func.sum(ResultRow.num_generated_tokens)).where(ResultRow.request_id.in_(sent)))
        configs = set(session.scalars(select(RequestRow.serving_config_name).where(RequestRow.id.in_(sent))))
        streams = sorted(session.scalars(select(RequestRow.stream).where(RequestRow.id.in_(sent))))
    assert run.config == config.model_dump(mode="json") and run.config_hash == config.config_hash
    assert run.workload_fingerprint == workload.fingerprint
    assert run.hardware["bandwidth_gbs"] > 0 and run.hardware["cpu"] and "torch" in run.software
    expected = f"servelab decoder, dense float32, {auto_kernel_label(runtime.settings.cache_dir, tiny_folder)}"
    assert run.hardware["kernel"] == outcome.kernel == expected
    assert run.hardware["model_weights"] == f"the local folder {tiny_folder}"  # what was served, in words
    assert (run.hardware["num_threads"], run.hardware["adaptive_threads"]) == (1, False)  # the config pins one
    assert len(sent) == 6 and configs == {config.name}
    assert streams == [StreamKind.BULK] * 2 + [StreamKind.INTERACTIVE] * 4  # the backlog went to the bulk stream
    summary = run.summary
    assert summary["num_succeeded"] == 6
    assert summary["output_tokens"] == tokens == 6 * 4  # the figure traces to the stored results
    # every token came from a pass (a prefill or a decode step) with that many rows
    assert sum(size * n for size, n in ((int(k), v) for k, v in summary["batch_size_counts"].items())) == 6 * 4
    assert summary["goodput_fraction"] == 1.0
    assert summary["weight_bytes"] > 0 and summary["kv_cache_peak_bytes"] > 0
    # the capacity it was served with: the worker's pool (the tiny Llama: 2 layers x 2 KV heads x head_dim 16, fp32,
    # keys and values, 16-token blocks: 8 KiB a block), the share its KV peak held, the most rows of a pass
    pool = run.hardware["kv_pool_blocks"]
    assert summary["kv_pool_blocks"] == pool > 0 and run.hardware["kv_pool_bytes"] == pool * 2 * 2 * 2 * 16 * 16 * 4
    assert 0 < summary["kv_pool_peak_use"] <= 1 and summary["num_preempted"] == 0
    assert summary["peak_rows"] == max(int(k) for k in summary["batch_size_counts"])


def test_a_plan_runs_every_config_interleaved_and_compare_exits_1_on_a_reject(forked_workers, tmp_path, tiny_folder,
                                                                             runtime, service_settings) -> None:
    suffix = uuid.uuid4().hex[:6]
    base = tiny_config(tmp_path, tiny_folder, f"b1-{suffix}", batch=1)
    batched = tiny_config(tmp_path, tiny_folder, f"b4-{suffix}", batch=4)
    # NOTE: one candidate: each config and round starts a worker process (about 10 s); a second candidate (it was a
    # bf16 one) added two and checked nothing the first does not
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(
        f"workload: {workload_file(tmp_path)}\nbaseline: {base}\ncandidates: [{batched}]\nrepeats: 2\n"
        "quality: {lambada_samples: 8}\n"
        "limits:\n  max_accuracy_drop: 1.0\n  latency: [{metric: tpot_ms, percentile: 95, max_ratio: 1000}]\n"
        # NOTE: a goal past any interval two rounds of timings can give (a t interval with 1 degree of freedom
        # reaches 6.4 times the rounds' log difference either side: x1000 was within a loaded host's reach): the
        # reject is certain
        "  gains: [{metric: output_tokens_per_s, min_ratio: 1.0e+300}]\n")
    env = service_env(service_settings)
    result = CliRunner().invoke(app, ["compare", str(plan_path), "--json"], env=env)
    assert result.exit_code == 1, result.output  # a reject: a CI job can gate on it
    printed = json.loads(result.stdout)
    assert printed["decision"] == "reject"
    verdicts = [Verdict(**{**v, "figures": (), "criteria": tuple(
        Criterion(**{**c, "measured": Estimate(c["measured"]["value"], c["measured"]["low"], c["measured"]["high"])})
        for c in v["criteria"])}) for v in printed["verdicts"]]
    assert [v.candidate for v in verdicts] == [f"b4-{suffix}"]
    for verdict in verdicts:
        assert {c.kind for c in verdict.criteria} == {"quality", "latency", "gain"}
        assert verdict.decision == "reject" and "out of reach" in verdict.reason  # past the whole interval
        assert not any("factors" in w for w in verdict.warnings)  # each changes one factor
        assert len(verdict.repeat_checks) == 2
    report = format_verdicts(verdicts)
    assert "REJECT" in report and "LAMBADA accuracy drop" in report and "runs: " in report
    with session_scope(runtime.sessions) as session:
        stored = session.get(ComparisonRow, uuid.UUID(printed["comparison_id"]))
        assert len(stored.baseline_run_ids) == 2 and len(stored.candidate_run_ids) == 2
        assert [v["decision"] for v in stored.report["verdicts"]] == ["reject"]
        runs = session.scalars(select(RunRow).where(RunRow.id.in_(stored.baseline_run_ids))).all()
        assert all(r.quality and len(r.quality["correct"]) == 8 for r in runs)
        every = session.scalars(select(RunRow).where(RunRow.id.in_(stored.baseline_run_ids + stored.candidate_run_ids))
                                .order_by(RunRow.started_at)).all()
    # interleaved: round by round, every config once per round, in the stored order (a block's second is reversed)
    rounds = stored.report["rounds"]
    names = [f"b1-{suffix}", f"b4-{suffix}"]
    assert len(rounds) == 2 and sorted(rounds[0]) == sorted(names) and rounds[1] == rounds[0][::-1]
    assert [(r.repeat_index, r.serving_config_name) for r in every] == \
        [(i, name) for i, order in enumerate(rounds) for name in order]
    assert len({r.worker_name for r in every}) == 4  # a fresh worker process per config and round


def test_a_plan_run_until_settled_adds_rounds_and_passages_until_its_budget_is_spent(forked_workers, tmp_path,
                                                                                    tiny_folder, runtime,
                                                                                    service_settings) -> None:
    """Two copies of one bf16 config (they differ in name only) and an fp32 candidate. Deterministic on purpose: the
    copy's weights are exactly x1 the baseline's (settled at the first look) and fp32's x2 (its goal out of reach:
    rejected at the first look, then measured no more); no passage can be lost (an exact check, final only at the
    plan's 8 passages), and with no price set the cost has no value on either side, so it stays unsure and asks for
    rounds to the end."""
    suffix = uuid.uuid4().hex[:6]
    base, copy = (tiny_config(tmp_path, tiny_folder, f"{side}-{suffix}", weights="bf16") for side in ("a", "b"))
    wider = tiny_config(tmp_path, tiny_folder, f"c-{suffix}")
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(
        f"workload: {workload_file(tmp_path)}\nbaseline: {base}\ncandidates: [{copy}, {wider}]\n"
        "fresh_workers: false\nquality: {lambada_samples: 8}\nsequential: {min_rounds: 2, passage_step: 4}\n"
        "limits:\n  max_accuracy_drop: 0\n  gain_rule: all\n"
        "  gains: [{metric: weight_bytes, max_ratio: 1.0}, {metric: cost_per_request, max_ratio: 1.0}]\n")
    env = service_env(service_settings, SERVELAB_PRICE_PER_HOUR="0")
    refused = CliRunner().invoke(app, ["compare", str(plan_path), "--max-passages", "2"], env=env)
    assert refused.exit_code == 2 and "passage_step (4) must be at most max_passages (2)" in refused.output
    result = CliRunner().invoke(app, ["compare", str(plan_path), "--until-settled", "--max-rounds", "3",
                                      "--max-passages", "8", "--json"], env=env)
    assert result.exit_code == 3, result.output  # inconclusive: no candidate accepted, the copy's cost unsure
    printed = json.loads(result.stdout)
    sequential = printed["sequential"]
    # look 1 after 2 rounds and 4 passages; look 2 after a round and a step of passages more: both budgets spent
    assert [(look["num_rounds"], look["num_passages"]) for look in sequential["looks"]] == [(2, 4), (3, 8)]
    assert sequential["stop"].startswith("the budget is spent after 3 rounds, 8 passages") and \
        sequential["stop"].endswith("still unsure: cost_per_request")
    assert sequential["settled_at"][f"b-{suffix}"] == {"weight_bytes": 1, "LAMBADA accuracy drop": 2}
    assert sequential["decided_at"] == {f"c-{suffix}": 1}
    assert [sorted(h) for h in sequential["history"]] == [[f"b-{suffix}", f"c-{suffix}"], [f"b-{suffix}"]]
    assert sequential["levels"]["runs"] == pytest.approx(1 - 0.05 / 2)  # two looks planned over rounds 2-3
    copy_verdict, wider_verdict = printed["verdicts"]
    criteria = {c["name"]: c for c in copy_verdict["criteria"]}
    assert criteria["LAMBADA accuracy drop"]["note"].startswith("exact: 0 of 8 passages lost")
    assert criteria["cost_per_request"]["outcome"] == "unsure"
    assert wider_verdict["decision"] == "reject" and "weight_bytes x2.000" in wider_verdict["reason"]
    ranking = printed["ranking"]
    assert ranking["ranked"] == [] and [n for n, _ in ranking["not_ranked"]] == [f"b-{suffix}", f"c-{suffix}"]
    with session_scope(runtime.sessions) as session:
        stored = session.get(ComparisonRow, uuid.UUID(printed["comparison_id"]))
        runs = session.scalars(select(RunRow).where(RunRow.id.in_(stored.baseline_run_ids))).all()
        rejected = session.scalars(select(RunRow).where(RunRow.id.in_(stored.candidate_run_ids),
                                                        RunRow.serving_config_name == f"c-{suffix}")).all()
    assert stored.report["sequential"]["stop"] == sequential["stop"] and len(stored.report["rounds"]) == 3
    assert f"c-{suffix}" not in stored.report["rounds"][2] and len(stored.report["rounds"][2]) == 2
    assert stored.report["ranking"]["summary"] == "no candidate meets every limit: nothing to rank"
    assert stored.plan["sequential"]["max_rounds"] == 3  # the budget it ran under, options included
    assert len(runs) == 3 and all(len(r.quality["correct"]) == 8 for r in runs)
    assert len(rejected) == 2 and all(len(r.quality["correct"]) == 4 for r in rejected)  # measured no more


def test_a_run_is_refused_while_another_worker_serves_its_config(tmp_path, tiny_folder, runtime) -> None:
    from servelab.lab.runner import RunError
    from servelab.store.requests import register_worker

    config_path = tiny_config(tmp_path, tiny_folder, f"busy-{uuid.uuid4().hex[:6]}")
    config = ServingConfig.from_yaml(config_path)
    with session_scope(runtime.sessions) as session:
        register_worker(session, name=f"prod-{config.name}", serving_config_name=config.name,
                        config_hash=config.config_hash, hardware={}, software={})
    with pytest.raises(RunError, match=f"already serves config '{config.name}'"):
        start_worker(config, config_path, runtime)


def test_a_worker_that_fails_to_start_is_named_with_its_own_log(tmp_path, runtime) -> None:
    """A lab worker's output goes to its own file under the state folder, never to the console the verdict is
    printed on; a start that fails names that file and its last lines."""
    from servelab.lab.runner import RunError

    config_path = tmp_path / "missing.yaml"
    config_path.write_text(f"name: missing-{uuid.uuid4().hex[:6]}\nmodel: {tmp_path / 'no-such-model'}\n"
                           "weights: fp32\ndevice: cpu\nnum_threads: 1\n")
    config = ServingConfig.from_yaml(config_path)
    with pytest.raises(RunError, match=r"exited with code \d+ while starting; its output: .*lab-missing-") as info:
        with start_worker(config, config_path, runtime):
            pass
    log = Path(str(info.value).split("its output: ")[1].splitlines()[0])
    assert log.is_file() and log.parent == Path(runtime.settings.state_dir) / "logs"
    assert "no-such-model" in log.read_text() and "no-such-model" in str(info.value)
