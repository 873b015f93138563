"""The lab's commands print data as JSON when asked: `servelab run --json`, `servelab quality --json`."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from typer.testing import CliRunner

from servelab.cli import app
from tests.conftest import service_env
from tests.lab.test_runs import tiny_config, workload_file


def test_run_json_is_the_stored_run_s_id_and_summary(forked_workers, tmp_path: Path, tiny_folder: Path,
                                                     service_settings, redis_client) -> None:
    config = tiny_config(tmp_path, tiny_folder, f"tiny-{uuid.uuid4().hex[:6]}")
    env = service_env(service_settings)
    result = CliRunner().invoke(app, ["run", "--config", str(config), "--workload", str(workload_file(tmp_path)),
                                      "--json"], env=env)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert uuid.UUID(record["run_id"]) and record["config"] == config.stem
    assert record["summary"]["num_succeeded"] == record["summary"]["num_requests"] == 6
    assert record["summary"]["output_tokens"] == 6 * 4


def test_quality_json_gives_each_config_s_figures_and_the_paired_drop(tmp_path: Path, tiny_folder: Path) -> None:
    first, second = (tiny_config(tmp_path, tiny_folder, name) for name in ("left", "right"))
    result = CliRunner().invoke(app, ["quality", "--configs", f"{first},{second}", "--samples", "4", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["baseline"] == "left" and [c["config"] for c in record["configs"]] == ["left", "right"]
    assert all(c["num_passages"] == 4 for c in record["configs"])
    assert "accuracy_drop" not in record["configs"][0]
    # the same weights on the same passages: no drop, the same perplexity
    assert record["configs"][1]["accuracy_drop"]["value"] == 0.0
    assert record["configs"][1]["perplexity_ratio"]["value"] == 1.0
