"""The peer benchmark's own parts, without any peer venv: arithmetic, order, options, tables, protocol,
conversion caching, and the servelab adapter on the bundled model when it is already converted."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from bench.peers import convert, peers
from bench.peers.machine import prompt_ids
from bench.peers.measure import Cell, Sample, median_cell, rooflines, schedule
from bench.peers.options import OptionError, parse_options
from bench.peers.process import EngineError, EngineProcess
from bench.peers.protocol import AdapterArgs, Request, answer
from bench.peers.report import PrecisionResult, Report, Slot, format_report, format_scaling, report_json
from servelab.analysis.stats import common_prefix_length

PYTHON = Path(sys.executable)
REPO = Path(__file__).resolve().parents[2]


def test_tokens_per_second_from_a_full_and_a_one_token_call():
    sample = Sample(batch_size=16, new_tokens=64, seconds_n=4.0, seconds_1=0.85)
    assert sample.e2e_tokens_per_s == pytest.approx(16 * 64 / 4.0)
    assert sample.decode_tokens_per_s == pytest.approx(16 * 63 / 3.15)
    assert Sample(1, 8, seconds_n=0.5, seconds_1=0.6).decode_tokens_per_s is None  # noise, not a speed


def test_medians_skip_rounds_without_a_decode_speed():
    samples = [Sample(1, 9, 2.0, 1.0), Sample(1, 9, 3.0, 1.0), Sample(1, 9, 0.9, 1.0)]
    cell = median_cell(samples, agreement=5)
    assert cell.decode_tokens_per_s == pytest.approx((8 / 1.0 + 8 / 2.0) / 2)
    assert cell.e2e_tokens_per_s == pytest.approx(9 / 2.0)
    assert cell.agreement == 5 and len(cell.samples) == 3


def test_schedule_interleaves_engines_innermost_and_rounds_outermost():
    order = list(schedule(2, ["fp32", "bf16"], [1, 16], ["servelab", "ct2"]))
    assert order[:4] == [(0, "fp32", 1, "servelab"), (0, "fp32", 1, "ct2"), (0, "fp32", 16, "servelab"),
                         (0, "fp32", 16, "ct2")]
    assert order[4] == (0, "bf16", 1, "servelab") and order[8] == (1, "fp32", 1, "servelab")
    assert len(order) == 16


def test_agreement_counts_leading_tokens_up_to_the_first_difference():
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2]) == 2
    assert common_prefix_length([5], [6]) == 0


def test_rooflines_come_from_servelabs_decode_cost():
    cost = {"weight_bytes": 1000, "num_matmul_params": 100, "num_layers": 2, "attention_width": 4,
            "kv_bytes_per_token": 10.0}
    roofs = rooflines(cost, "fp32", bandwidth_gbs=1e-6, peak_flops_per_s=1e4, batch_sizes=[1, 4],
                      prompt_tokens=8, new_tokens=4)
    context = 8 + 4 / 2
    assert roofs.bandwidth_tokens_per_s[4] == pytest.approx(4 * 1e3 / (1000 + 4 * context * 10))
    assert roofs.compute_tokens_per_s == pytest.approx(1e4 / (2 * 100 + 4 * 2 * context * 4))


def test_default_options():
    options = parse_options([])
    assert options.batch_sizes == (1, 16, 64) and options.threads == (1,) and options.rounds == 3
    assert parse_options(["--threads", "1,2,3"]).threads == (1, 2, 3)
    assert options.engines == ("servelab", "vllm", "llamacpp", "ct2", "ortgenai")
    assert (options.prompt_tokens, options.new_tokens) == (64, 64)


@pytest.mark.parametrize(("argv", "message"), [
    (["--engines", "servelab,tgi"], "--engines: unknown tgi"),
    (["--engines", "ct2"], "must include servelab"),
    (["--precisions", "fp16"], "--precisions: unknown fp16"),
    (["--batch-sizes", "1,0"], "--batch-sizes: each must be between 1"),
    (["--batch-sizes", "4,4"], "repeated"),
    (["--batch-sizes", "1,x"], "'x' is not an integer"),
    (["--batch-sizes", ","], "give at least one value"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--threads", "2,2"], "--threads: repeated value"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--new-tokens", "1"], "--new-tokens must be at least 2"),
    (["--prompt-tokens", "2000", "--new-tokens", "100"], "at most 2048"),
    (["--json", "/no/such/folder/out.json"], "--json: folder /no/such/folder does not exist"),
])
def test_option_errors_name_the_option(argv, message):
    with pytest.raises(OptionError, match=message.replace("(", r"\(")):
        parse_options(argv)


def _report() -> Report:
    options = parse_options(["--batch-sizes", "1,16", "--engines", "servelab,ct2,ortgenai", "--precisions", "bf16",
                             "--new-tokens", "8"])
    cells = {
        (1, "servelab"): Cell(10.0, 9.0), (16, "servelab"): Cell(100.0, 80.0),
        (1, "ct2"): Cell(15.0, 12.0, agreement=8), (16, "ct2"): Cell(error="RuntimeError: out of memory"),
        (1, "ortgenai"): Cell(), (16, "ortgenai"): Cell(),
    }
    roofs = rooflines({"weight_bytes": 269_000_000, "num_matmul_params": 134_000_000, "num_layers": 30,
                       "attention_width": 576, "kv_bytes_per_token": 23040.0}, "bf16", bandwidth_gbs=15.0,
                      peak_flops_per_s=1.2e11, batch_sizes=[1, 16], prompt_tokens=64, new_tokens=8)
    slots = (Slot("servelab", "bf16"), Slot("ct2", "bfloat16"), Slot("ortgenai", None, "n/a at bf16: no CPU kernel"))
    return Report(options, "test cpu", 15.0, {"fp32": 5e10, "bf16": 1.2e11}, (1, 2, 3), {"servelab": "0.1.0"},
                  (PrecisionResult("bf16", slots, cells, roofs),), ("model ct2 bfloat16: somewhere",))


def test_table_has_a_row_per_batch_size_with_ratios_and_notes():
    text = format_report(_report())
    lines = text.splitlines()
    table = [line for line in lines if line.lstrip().startswith(("1 ", "16 "))]
    assert len(table) == 2
    assert "1.50x" in table[0] and "8/8" in table[0] and "1.00x" in table[0]
    assert "see [1]" in table[0] and "see [2]" in table[1] and "see [1]" in table[1]  # one note per reason
    assert len({len(line) for line in table}) == 1  # columns line up
    assert "[1] ortgenai: n/a at bf16: no CPU kernel" in lines
    assert "[2] ct2: RuntimeError: out of memory" in lines
    assert "weights 269.0 MB" in text and "threads per engine: 1" in text


def test_json_holds_every_cell_and_the_rooflines():
    data = json.loads(json.dumps(report_json(_report())))
    result = data["results"][0]
    assert {(c["batch_size"], c["engine"]) for c in result["cells"]} == {
        (b, e) for b in (1, 16) for e in ("servelab", "ct2", "ortgenai")}
    assert result["rooflines"]["bandwidth_tokens_per_s"]["16"] > result["rooflines"]["bandwidth_tokens_per_s"]["1"]


def test_answer_checks_every_row_has_exactly_the_new_tokens():
    good = answer(lambda prompts, n: [[7] * n for _ in prompts], Request(3, [1, 2], 4))
    assert good["num_output_tokens"] == 12 and good["first_row_token_ids"] == [7, 7, 7, 7] and good["seconds"] >= 0
    bad = answer(lambda prompts, n: [[7] * (n - 1) for _ in prompts], Request(2, [1], 4))
    assert "lengths [3]" in bad["error"]
    assert Request.from_line(Request(2, [5, 6], 3).to_line()) == Request(2, [5, 6], 3)


def _fake(tmp_path: Path, behaviour: str) -> EngineProcess:
    args = AdapterArgs("unused", behaviour, threads=1, max_batch_size=4, max_tokens=16)
    return EngineProcess(PYTHON, "tests.bench.fake_adapter", args, tmp_path / f"{behaviour}.log")


def test_adapter_protocol_over_a_subprocess(tmp_path):
    process = _fake(tmp_path, "ok")
    try:
        ready = process.wait_ready(30)
        assert ready == {"ready": True, "version": "0.0-fake", "info": {"threads": 1}}
        reply = process.call(Request(3, [1, 2, 3], 5), 30)
        assert reply["num_output_tokens"] == 15 and reply["first_row_token_ids"] == [0, 1, 2, 3, 4]
    finally:
        process.close()
    assert "engines print to stdout" in (tmp_path / "ok.log").read_text()


def test_a_held_adapter_is_stopped_until_released(tmp_path):
    process = _fake(tmp_path, "ok")
    try:
        process.wait_ready(30)
        process.hold()
        state = Path(f"/proc/{process._proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state == "T"  # stopped when hold returns: it takes no CPU while other engines are measured
        with process.running():
            assert process.call(Request(1, [1], 2), 30)["num_output_tokens"] == 2
        assert Path(f"/proc/{process._proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    finally:
        process.close()  # a held adapter is released first, so it can see the end of its input


def test_adapter_errors_become_cell_errors_or_engine_errors(tmp_path):
    short = _fake(tmp_path, "short")
    try:
        short.wait_ready(30)
        assert "error" in short.call(Request(1, [1], 3), 30)
    finally:
        short.close()
    failing = _fake(tmp_path, "fail-load")
    with pytest.raises(EngineError, match="load failed: RuntimeError: no such model"):
        failing.wait_ready(30)
    with pytest.raises(EngineError, match="load failed"):
        failing.call(Request(1, [1], 2), 30)
    failing.close()


def test_conversion_is_cached_by_source_and_atomic(tmp_path, monkeypatch):
    source = tmp_path / "hf"
    source.mkdir()
    (source / "config.json").write_text("{}")
    monkeypatch.setattr(peers, "MODELS", tmp_path / "models")
    calls = []

    def fake_converter(label: str, src: Path, out: Path) -> None:
        assert out.name.endswith(".partial")
        calls.append(label)
        (out / "model.bin").write_text(label)

    monkeypatch.setitem(convert.CONVERTERS, "ct2", fake_converter)
    path = convert.ensure_converted("ct2", "int8", source)
    assert path == tmp_path / "models" / "ct2-int8" and (path / "model.bin").read_text() == "int8"
    assert convert.ensure_converted("ct2", "int8", source) == path and calls == ["int8"]
    (source / "config.json").write_text('{"changed": true}')
    convert.ensure_converted("ct2", "int8", source)
    assert calls == ["int8", "int8"] and not (tmp_path / "models" / "ct2-int8.partial").exists()


def _bundled_folder() -> Path:
    """The bundled model's transformers folder in the repo's cache, converted here on first use (~40 s)."""
    from servelab.engine.loader import resolve_model_folder
    from servelab.settings import Settings

    return Path(resolve_model_folder("bundled:smollm2-135m-instruct",
                                     Settings(cache_dir=Path(__file__).resolve().parents[2] / ".cache")))


def test_servelab_adapter_speaks_the_protocol(tmp_path):
    folder = _bundled_folder()  # NOTE: before the adapter starts, so it never converts under a deadline
    config = Path(__file__).resolve().parents[2] / "configs" / "fp32.yaml"
    args = AdapterArgs(str(config), "fp32", threads=1, max_batch_size=2, max_tokens=16)
    process = EngineProcess(PYTHON, "bench.peers.engines.servelab", args, tmp_path / "servelab.log")
    try:
        ready = process.wait_ready(120)
        assert ready["ready"] and ready["info"]["weight_bytes"] > 100_000_000
        assert ready["info"]["compute_dtype"] == "fp32"
        reply = process.call(Request(2, prompt_ids(folder, 6), 3), 120)
        assert reply["num_output_tokens"] == 6 and len(reply["first_row_token_ids"]) == 3
        assert "servelab takes text" in process.call(Request(1, [504, 3458, 3005, 702, 260, 6594], 2), 120)["error"]
    finally:
        process.close()


def test_held_adapters_end_with_a_runner_that_is_killed(tmp_path):
    """A runner killed outright (no cleanup runs) while its adapter is held stopped: the adapter ends too."""
    import signal
    import subprocess
    import sys
    import time

    runner = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from bench.peers.process import EngineProcess\n"
        "from bench.peers.protocol import AdapterArgs\n"
        "args = AdapterArgs('unused', 'ok', threads=1, max_batch_size=4, max_tokens=16)\n"
        f"p = EngineProcess(Path(sys.executable), 'tests.bench.fake_adapter', args, Path({str(tmp_path)!r}) / 'a.log')\n"
        "p.wait_ready(60); p.hold(); print(p._proc.pid, flush=True); time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", runner], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        adapter = int(proc.stdout.readline())
        assert Path(f"/proc/{adapter}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"  # held
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{adapter}").exists() and time.monotonic() < deadline:
            state = Path(f"/proc/{adapter}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":  # killed, waiting for its (new) parent to reap it
                break
            time.sleep(0.05)
        alive = Path(f"/proc/{adapter}").exists() and \
            Path(f"/proc/{adapter}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        assert not alive, "the adapter outlived its runner"
    finally:
        proc.kill()


def test_runs_at_several_thread_counts_are_compared_engine_by_engine():
    one = _report()
    result = one.results[0]
    faster = {**result.cells, (1, "servelab"): Cell(18.0, 15.0), (1, "ct2"): Cell(21.0, 16.0, agreement=8)}
    two = replace(one, threads=2, results=(replace(result, cells=faster),))
    assert "threads per engine: 2" in format_report(two)
    lines = format_scaling([one, two]).splitlines()
    assert lines[0].startswith("decode tok/s by threads per engine (1, 2)")
    servelab = next(line for line in lines if "batch   1 servelab" in line)
    assert "1t    10.0 (x1.00)" in servelab and "2t    18.0 (x1.80)" in servelab
    ct2 = next(line for line in lines if "batch   1 ct2" in line)
    assert "2t    21.0 (x1.40)" in ct2
    failed = next(line for line in lines if "batch  16 ct2" in line)  # an error at every count: no ratio
    assert "1t       -" in failed and "x" not in failed.split("ct2")[1]


def test_adapters_load_one_at_a_time_and_wait_held(tmp_path):
    """A load measures (servelab's kernel choices time their candidates), so no two adapters load side by side:
    each starts after the one before is ready and held; a failed load becomes its slot's note."""
    from functools import partial

    from bench.peers.run import start_one_at_a_time

    record = tmp_path / "loads.txt"
    behaviours = {("fp32", "a"): "record", ("fp32", "b"): "fail-load", ("bf16", "a"): "record", ("bf16", "b"): "record"}
    launch = {key: partial(EngineProcess, PYTHON, "tests.bench.fake_adapter",
                           AdapterArgs(str(record), b, threads=1, max_batch_size=4, max_tokens=16),
                           tmp_path / f"{key[0]}-{key[1]}.log") for key, b in behaviours.items()}
    slots = {key: Slot(key[1], b) for key, b in behaviours.items()}
    processes: dict = {}
    try:
        ready = start_one_at_a_time(launch, slots, processes)
        assert set(ready) == set(processes) == {("fp32", "a"), ("bf16", "a"), ("bf16", "b")}
        assert "no such model" in slots[("fp32", "b")].note
        for process in processes.values():
            assert Path(f"/proc/{process._proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
        loads = sorted(tuple(float(v) for v in line.split()[1:]) for line in record.read_text().splitlines())
        assert len(loads) == 3
        assert all(later[0] >= earlier[1] for earlier, later in zip(loads, loads[1:]))  # never overlapping
    finally:
        for process in processes.values():
            process.close()
