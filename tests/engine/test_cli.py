"""`servelab generate`, `quantize` and `bench engine` end to end, on the tiny model, through the real CLI."""

from __future__ import annotations

import importlib.util
import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from servelab.cli import app
from tests.engine.conftest import save_tiny_llama
from tests.engine.kernel_labels import auto_kernel_label

REPO = Path(__file__).resolve().parents[2]

runner = CliRunner()


def tiny_config(tmp_path: Path, tiny_folder: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(f"model: {tiny_folder}\nweights: fp32\ndevice: cpu\nnum_threads: 1\n"
                    "decoding:\n  max_new_tokens: 32\n  max_context_tokens: 128\n")
    return path


def test_generate_json_reports_completions_timings_and_memory(tmp_path: Path, tiny_folder: Path) -> None:
    result = runner.invoke(app, ["generate", "--config", str(tiny_config(tmp_path, tiny_folder)), "--json",
                                 "--max-new-tokens", "5", "the cat", "a river of seven"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert [c["num_generated_tokens"] for c in record["completions"]] == [5, 5]
    assert record["completions"][0]["finish_reason"] == "length"
    assert 0 < record["memory"]["kv_cache_bytes"] <= record["memory"]["kv_cache_allocated_bytes"]
    assert record["timings"]["num_rows_per_step"] == [2, 2, 2, 2, 2]
    assert record["config"]["name"] == "tiny"
    assert record["kernel"] == f"servelab decoder, dense float32, {auto_kernel_label(REPO / '.cache', tiny_folder)}"


def test_generate_reports_a_bad_prompt_and_serves_the_rest(tmp_path: Path, tiny_folder: Path) -> None:
    result = runner.invoke(app, ["generate", "-c", str(tiny_config(tmp_path, tiny_folder)),
                                 "--max-new-tokens", "3", "the cat", ""])
    assert result.exit_code == 1
    assert "error: prompt is empty" in result.stdout
    assert "generated 3 tok" in result.stdout


def test_generate_with_a_bad_config_exits_2_with_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("weights: int2\n")
    result = runner.invoke(app, ["generate", "-c", str(bad), "hello"])
    assert result.exit_code == 2
    assert "weights: got 'int2'" in result.stderr


def test_generate_rejects_out_of_range_max_new_tokens(tmp_path: Path, tiny_folder: Path) -> None:
    result = runner.invoke(app, ["generate", "-c", str(tiny_config(tmp_path, tiny_folder)),
                                 "--max-new-tokens", "500", "the cat"])
    assert result.exit_code == 1
    assert "max_new_tokens must be between 1 and 32, got 500" in result.stdout


def test_bench_engine_prints_ratio_and_roofline(tmp_path: Path, tiny_folder: Path) -> None:
    result = runner.invoke(app, ["bench", "engine", "--configs", str(tiny_config(tmp_path, tiny_folder)),
                                 "--batch-sizes", "1,2", "--prompt-tokens", "8", "--new-tokens", "4",
                                 "--rounds", "1", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert [r["batch_size"] for r in record["rows"]] == [1, 2]
    assert record["bandwidth_gbs"] > 0 and record["threads"] == 1
    for row in record["rows"]:
        assert row["tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0
        assert row["ratio_to_hf"] == row["tokens_per_s"] / row["hf_tokens_per_s"]


def test_bench_engine_rejects_bad_batch_sizes(tmp_path: Path, tiny_folder: Path) -> None:
    result = runner.invoke(app, ["bench", "engine", "--configs", str(tiny_config(tmp_path, tiny_folder)),
                                 "--batch-sizes", "1,x"])
    assert result.exit_code == 2
    assert "--batch-sizes must be comma-separated whole numbers" in result.stderr


def test_a_missing_config_is_named_before_the_engine_is_imported(tmp_path: Path) -> None:
    """Each command that takes a config reads it before importing torch and the engine (seconds)."""
    import subprocess
    import sys

    probe = ("import sys\nfrom servelab.cli import app\n"
             "try:\n    app(sys.argv[1:])\nexcept SystemExit as exc:\n    code = exc.code\n"
             "print('exit', code, 'torch' in sys.modules)\n")
    for argv in (["generate", "--config", "nope.yaml", "hi"], ["quantize", "--config", "nope.yaml"],
                 ["quality", "--configs", "nope.yaml"], ["bench", "engine", "--configs", "nope.yaml"]):
        run = subprocess.run([sys.executable, "-c", probe, *argv], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
        assert "nope.yaml" in run.stderr and "no such config file" in run.stderr, (argv, run.stderr[-2000:])
        assert run.stdout.split()[-3:] == ["exit", "2", "False"], (argv, run.stdout[-500:])


def _quantize(tmp_path: Path, config: Path, *, stderr_is_a_terminal: bool) -> tuple[int, str, str]:
    """`servelab quantize` in a process of its own -> (exit code, stdout, what its stderr showed)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "SERVELAB_CACHE_DIR": str(tmp_path / "cache"),
           "SERVELAB_STATE_DIR": str(tmp_path / "state")}
    argv = [sys.executable, "-m", "servelab.cli", "quantize", "--config", str(config)]
    if not stderr_is_a_terminal:
        run = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
        return run.returncode, run.stdout, run.stderr
    terminal, child_side = pty.openpty()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=child_side, env=env, text=True)
    os.close(child_side)
    shown = b""
    while True:
        try:
            chunk = os.read(terminal, 65536)
        except OSError:  # NOTE: EIO once the child has closed its side
            break
        if not chunk:
            break
        shown += chunk
    os.close(terminal)
    out = proc.stdout.read()
    return proc.wait(timeout=60), out, shown.decode(errors="replace")


@pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None, reason="needs gptqmodel==7.6.0")
def test_quantize_keeps_gptqmodels_output_in_a_log_and_shows_one_moving_line(tmp_path: Path,
                                                                            bundled_folder: str) -> None:
    base = save_tiny_llama(tmp_path / "base", bundled_folder, hidden_size=128, intermediate_size=256)
    config = tmp_path / "awq.yaml"
    config.write_text(f"name: tiny-awq\nmodel: {base}\nweights: awq-int4\ndevice: cpu\n"
                      "decoding: {max_new_tokens: 8, max_context_tokens: 128}\n"
                      "awq: {num_calibration_samples: 8, calibration_seq_len: 64}\n")
    code, out, shown = _quantize(tmp_path, config, stderr_is_a_terminal=True)
    assert code == 0, shown[-3000:]
    assert len(out.splitlines()) == 1 and out.startswith("awq int4 g64 checkpoint made"), out[-3000:]
    assert "layer 2 of 2" in shown and "INFO" not in shown and "Quantizing layer" not in shown, shown[-3000:]
    assert len(shown.replace("\r", "\n").splitlines()) < 60, "one line redrawn, not hundreds"
    log = (tmp_path / "state" / "logs" / "quantize-tiny-awq.log").read_text()
    assert "Quantizing layer" in log, "gptqmodel's own output is kept in the log"

    code, out, err = _quantize(tmp_path, config, stderr_is_a_terminal=False)  # a pipe: no line is drawn
    assert code == 0 and len(out.splitlines()) == 1 and "reused" in out, out + err
    assert "\r" not in err and "\x1b" not in err and len(err.splitlines()) <= 3, err


def _drain(fd: int) -> str:
    """Everything written to a pty so far: one read returns one write's worth, so read until it stays quiet."""
    import select

    chunks = []
    while select.select([fd], [], [], 0.2)[0]:
        chunks.append(os.read(fd, 65536))
    return b"".join(chunks).decode()


def test_a_progress_bar_is_drawn_on_a_terminal_s_stderr_only(monkeypatch) -> None:
    from servelab.cli.progress import progress_bar

    terminal, child_side = pty.openpty()
    with open(child_side, "w", closefd=True) as stream:
        monkeypatch.setattr(sys, "stderr", stream)
        with progress_bar(length=4, label="lines") as bar:
            bar.update(4)
        stream.flush()
        drawn = _drain(terminal)
    os.close(terminal)
    assert "lines" in drawn and "100%" in drawn, drawn

    piped = Path(os.devnull).open("w")
    monkeypatch.setattr(sys, "stderr", piped)
    with progress_bar(length=4, label="lines") as bar:
        bar.update(4)
    assert type(bar).__name__ == "_NoBar", "nothing is drawn off a terminal"
    piped.close()
