"""The batch sweep on the tiny model: decode cost from real modules, points per (config, batch), the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from servelab.cli import app
from servelab.engine.engine import Engine
from servelab.lab.sweep import decode_cost, measure_peak_flops, run_sweep, sweep_report
from tests.conftest import service_env
from tests.engine.conftest import make_config

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_twin(tiny_engine: Engine, settings) -> Engine:
    """The same tiny model under a second config name: a candidate to sweep against the baseline."""
    return Engine.from_config(make_config(str(tiny_engine.loaded.folder), name="twin"), settings)


def test_decode_cost_counts_every_matmul_weight_of_the_tiny_llama(tiny_engine: Engine) -> None:
    hidden, inter, kv_width, vocab = 64, 128, 2 * 16, tiny_engine.loaded.shape.vocab_size
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_width + 3 * hidden * inter  # q, o, k, v, gate, up, down
    cost = decode_cost(tiny_engine)
    assert cost.num_matmul_params == 2 * per_layer + hidden * vocab  # the tied lm_head is a matmul too
    assert cost.attention_width == 64 and cost.num_layers == 2
    assert cost.kv_bytes_per_token == 2 * 2 * kv_width * 4  # keys + values, 2 layers, fp32
    assert cost.weight_bytes == tiny_engine.step_weight_bytes  # what a step reads: no embedding table


def test_peak_flops_of_a_small_matmul_is_positive() -> None:
    assert measure_peak_flops(torch.device("cpu"), torch.float32, size=128, repeats=1) > 0


def test_sweep_gives_one_point_per_config_and_batch_size_with_rooflines(tiny_engine: Engine, tiny_twin: Engine) -> None:
    messages = []
    points = run_sweep([tiny_engine, tiny_twin], batch_sizes=[1, 3], num_prompt_tokens=8, num_new_tokens=4,
                       num_rounds=2, progress=messages.append, bandwidth_gbs=10.0, peak_flops_per_s={"fp32": 1e10})
    assert [(p.config, p.batch_size) for p in points] == [("test", 1), ("test", 3), ("twin", 1), ("twin", 3)]
    assert len(messages) == 2 * 2 * 2  # rounds x configs x batch sizes, interleaved
    for p in points:
        assert p.decode_tokens_per_s > 0 and p.tpot_ms > 0 and p.tokens_per_s > 0
        assert p.num_prompt_tokens == 8 and p.num_new_tokens == 4
        assert p.compute_roofline_tokens_per_s == points[0].compute_roofline_tokens_per_s  # batch-independent
    by_batch = {p.batch_size: p.bandwidth_roofline_tokens_per_s for p in points if p.config == "test"}
    assert 2.9 * by_batch[1] < by_batch[3] < 3 * by_batch[1]  # 3 rows share one read of the weights


def test_sweep_report_holds_every_later_config_against_the_first(tiny_engine: Engine, tiny_twin: Engine) -> None:
    report = sweep_report([tiny_engine, tiny_twin], batch_sizes=[1, 2], num_prompt_tokens=8, num_new_tokens=3,
                          num_rounds=1)
    assert report.baseline == "test" and set(report.crossovers) == {"twin"}
    assert set(report.peak_flops_per_s) == {"fp32"} and report.bandwidth_gbs > 0
    assert len(report.points) == 4
    json.dumps(report.as_dict())


def test_sweep_refuses_duplicate_config_names_and_too_few_new_tokens(tiny_engine: Engine) -> None:
    with pytest.raises(ValueError, match="config names must differ"):
        run_sweep([tiny_engine, tiny_engine], batch_sizes=[1], num_prompt_tokens=8, num_new_tokens=4, num_rounds=1)
    with pytest.raises(ValueError, match="num_new_tokens must be at least 2"):
        run_sweep([tiny_engine], batch_sizes=[1], num_prompt_tokens=8, num_new_tokens=1, num_rounds=1)


def tiny_config(tmp_path: Path, tiny_folder: Path, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\nmodel: {tiny_folder}\nweights: fp32\ndevice: cpu\nnum_threads: 1\n"
                    "decoding:\n  max_new_tokens: 32\n  max_context_tokens: 128\n")
    return path


def test_sweep_command_prints_the_table_and_each_candidates_crossover(tmp_path: Path, tiny_folder: Path) -> None:
    configs = f"{tiny_config(tmp_path, tiny_folder, 'base')},{tiny_config(tmp_path, tiny_folder, 'cand')}"
    result = runner.invoke(app, ["sweep", "--configs", configs, "--batch-sizes", "1,2", "--prompt-tokens", "8",
                                 "--new-tokens", "3", "--rounds", "1", "--threads", "1", "--no-store"])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith(("base ", "cand "))]
    assert [(r[0], r[2]) for r in rows] == [("base", "1"), ("base", "2"), ("cand", "1"), ("cand", "2")]
    assert all(r[-1] in ("bandwidth", "compute") for r in rows)
    assert "crossover (cand vs base)" in result.stdout and "ridge batch (base)" in result.stdout


def test_sweep_command_json_has_points_machine_and_crossovers(tmp_path: Path, tiny_folder: Path) -> None:
    result = runner.invoke(app, ["sweep", "--configs", str(tiny_config(tmp_path, tiny_folder, "solo")),
                                 "--batch-sizes", "2", "--prompt-tokens", "8", "--new-tokens", "3", "--rounds", "1",
                                 "--threads", "1", "--json", "--no-store"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["num_threads"] == 1 and record["crossovers"] == {} and record["baseline"] == "solo"
    assert [(p["config"], p["batch_size"]) for p in record["points"]] == [("solo", 2)]
    assert record["points"][0]["bound"] in ("bandwidth", "compute")


@pytest.mark.parametrize(("args", "message"), [
    (["--batch-sizes", "1,x"], "--batch-sizes must be comma-separated whole numbers"),
    (["--new-tokens", "1"], "--new-tokens must be at least 2"),
])
def test_sweep_command_rejects_bad_flags_with_exit_2(tmp_path: Path, tiny_folder: Path, args: list[str],
                                                     message: str) -> None:
    result = runner.invoke(app, ["sweep", "--configs", str(tiny_config(tmp_path, tiny_folder, "solo")), *args])
    assert result.exit_code == 2
    assert message in result.stderr


def test_sweep_command_rejects_two_configs_with_one_name(tmp_path: Path, tiny_folder: Path) -> None:
    path = tiny_config(tmp_path, tiny_folder, "same")
    result = runner.invoke(app, ["sweep", "--configs", f"{path},{path}"])
    assert result.exit_code == 2
    assert "config names must differ" in result.stderr


def test_sweep_command_stores_the_report_for_the_dashboard(tmp_path: Path, tiny_folder: Path, service_settings) -> None:
    import uuid

    from servelab.store.db import make_engine, session_factory, session_scope
    from servelab.store.models import SweepRow

    env = service_env(service_settings)
    result = runner.invoke(app, ["sweep", "--configs", str(tiny_config(tmp_path, tiny_folder, "kept")),
                                 "--batch-sizes", "1", "--prompt-tokens", "8", "--new-tokens", "3", "--rounds", "1",
                                 "--threads", "1"], env=env)
    assert result.exit_code == 0, result.output
    sweep_id = result.stderr.split("stored as sweep ")[1].split()[0]
    engine = make_engine(service_settings.database_url)
    with session_scope(session_factory(engine)) as session:
        row = session.get(SweepRow, uuid.UUID(sweep_id))
        assert [p["config"] for p in row.report["points"]] == ["kept"] and row.hardware["cpu"]
    engine.dispose()
