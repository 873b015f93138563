"""`servelab bench queue`: the same burst in-process and through the real queue, with the ratio."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from servelab.cli import app
from tests.conftest import service_env


def test_bench_queue_prints_both_paths_and_the_ratio(forked_workers, tmp_path: Path, tiny_folder: Path,
                                                     service_settings) -> None:
    config, baseline = tmp_path / "tiny.yaml", tmp_path / "tiny-transformers.yaml"
    body = (f"model: {tiny_folder}\ndevice: cpu\nbatching:\n  max_batch_size: 4\n  max_wait_ms: 50\n"
            "decoding:\n  max_new_tokens: 16\n  max_context_tokens: 128\n")
    config.write_text(f"name: tiny\n{body}")
    baseline.write_text(f"name: tiny-transformers\ndecoder: transformers\n{body}")
    env = service_env(service_settings)
    result = CliRunner().invoke(app, ["bench", "queue", "--config", str(baseline), "--config", str(config), "--requests", "6",
                                      "--prompt-tokens", "8", "--new-tokens", "3", "--rounds", "1"], env=env)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    direct = next(line for line in lines if line.startswith("in-process")).split()
    queued = next(line for line in lines if line.startswith("queue ")).split()
    assert direct[1] == queued[1] == "6"
    assert float(direct[2]) > 0 and float(queued[2]) > 0
    assert any(line.startswith("ratio") and line.count("x") == 3 for line in lines)
    assert sum(line.startswith("queue ") for line in lines) == 2  # one table per config
    compared = {line.split()[0]: line.split() for line in lines[lines.index(next(
        line for line in lines if line.startswith("through the queue"))) + 2:]}
    assert compared["tiny-transformers"][2] == "1.00x" and float(compared["tiny"][1]) > 0


def test_bench_workers_shares_one_burst_between_worker_processes_and_runs_each_request_once(
        forked_workers, tmp_path: Path, tiny_folder: Path, service_settings) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(f"name: tiny\nmodel: {tiny_folder}\ndevice: cpu\nbatching:\n  max_batch_size: 2\n  max_wait_ms: 20\n"
                      "decoding:\n  max_new_tokens: 16\n  max_context_tokens: 128\n")
    result = CliRunner().invoke(app, ["bench", "workers", "--config", str(config), "--workers", "1,2", "--requests", "8",
                                      "--prompt-tokens", "6", "--new-tokens", "12", "--rounds", "1"],
                                env=service_env(service_settings))
    assert result.exit_code == 0, result.output
    rows = {int(line.split()[0]): line.split() for line in result.stdout.splitlines()
            if line.split() and line.split()[0] in ("1", "2") and line.split()[1] == "1"}
    assert set(rows) == {1, 2}
    for count, row in rows.items():
        assert float(row[2]) > 0 and row[5] == "0"  # tokens/s; no request ran twice
        shares = [int(n) for n in row[6:]]
        assert sum(shares) == 8 and len(shares) <= count
    assert "requests that ran more than once, or have other than one result: 0 of 16" in result.stdout
    assert "2 worker(s):" in result.stdout and "against 1" in result.stdout


def test_bench_hol_prints_each_policy_alone_and_during_the_bulk_job(tmp_path: Path, tiny_folder: Path,
                                                                    service_settings) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(f"name: tiny\nmodel: {tiny_folder}\ndevice: cpu\nbatching:\n  max_batch_size: 2\n"
                      "  max_wait_ms: 10\ndecoding:\n  max_new_tokens: 16\n  max_context_tokens: 128\n")
    env = service_env(service_settings)
    result = CliRunner().invoke(app, ["bench", "hol", "--config", str(config), "--bulk", "4", "--bulk-prompt-tokens",
                                      "8", "--bulk-tokens", "16", "--calls", "2", "--call-tokens", "2", "--interval",
                                      "0.05"], env=env)
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()
            if line.split() and line.split()[0] in ("window", "continuous") and "against" not in line}
    assert set(rows) == {"window", "continuous"}
    assert all(float(row[-2]) > 0 for row in rows.values())  # the bulk job's tokens/s: all 4 x 16 tokens made
    assert all(0 < float(row[-4].removesuffix("ms")) <= float(row[-3].removesuffix("ms")) for row in rows.values())
    assert "continuous against window: interactive p95 during the bulk job x" in result.stdout
    assert "a newcomer's prefill (8 tokens) adds " in result.stdout and "to the step of 2 running rows it joins" in result.stdout
    bad = CliRunner().invoke(app, ["bench", "hol", "--config", str(config), "--policies", "fifo"], env=env)
    assert bad.exit_code != 0 and "fifo is not a policy" in bad.output


def test_bench_stream_prints_streamed_against_unstreamed_tokens_per_s(forked_workers, tmp_path: Path, tiny_folder: Path,
                                                                     service_settings) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(f"name: tiny\nmodel: {tiny_folder}\ndevice: cpu\nbatching:\n  max_batch_size: 4\n"
                      "decoding:\n  max_new_tokens: 16\n  max_context_tokens: 128\n")
    env = service_env(service_settings)
    result = CliRunner().invoke(app, ["bench", "stream", "--config", str(config), "--rows", "4", "--prompt-tokens",
                                      "8", "--new-tokens", "12", "--rounds", "2"], env=env)
    assert result.exit_code == 0, result.output
    rounds = [line.split() for line in result.stdout.splitlines() if line.split() and line.split()[0] in ("1", "2")]
    assert len(rounds) == 2 and all(float(r[1]) > 0 and float(r[2]) > 0 for r in rounds)
    assert "every row streamed against none: x" in result.stdout
    too_many = CliRunner().invoke(app, ["bench", "stream", "--config", str(config), "--rows", "9", "--new-tokens", "8"], env=env)
    assert too_many.exit_code != 0 and "max_batch_size (4)" in too_many.output
