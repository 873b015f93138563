"""The peer benchmark run: convert, start the adapters one by one, warm up, measure interleaved, report.

Knows the order of a run and what becomes of failures: a peer whose venv is missing, whose precision
has no counterpart, whose conversion or load fails, or that fails at one batch size is shown as such in
its cells, and the run goes on. Measurement is the same for every engine (bench/peers/measure.py), and
every adapter times its own generate call (bench/peers/protocol.py). Progress goes to stderr, the
tables to stdout.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path

from bench.peers.machine import MachineFacts, awq_checkpoint, bundled_folder, measure_machine, prompt_ids
from bench.peers.measure import Cell, Sample, median_cell, rooflines, schedule
from bench.peers.options import OptionError, Options, parse_options
from bench.peers.peers import LOGS, PEERS, ROOT, Unavailable
from bench.peers.process import EngineError, EngineProcess
from bench.peers.protocol import AdapterArgs, Request
from bench.peers.report import PrecisionResult, Report, Slot, format_report, format_scaling, report_json
from servelab.analysis.stats import common_prefix_length

LOAD_TIMEOUT_S = 1200  # vLLM compiles its model on load: minutes on a busy 2-core machine
CALL_TIMEOUT_S = 900
Key = tuple[str, str]  # (precision, engine)
CellKey = tuple[str, int, str]  # (precision, batch size, engine)


def _stop(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)  # NOTE: unwinds through run()'s cleanup, which closes every adapter


def main(argv: list[str] | None = None) -> int:
    try:
        options = parse_options(argv)
    except OptionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop)
    reports = []
    try:
        for threads in options.threads:  # NOTE: a run per count, each printed as it ends
            reports.append(run(options, threads))
            print(format_report(reports[-1]), flush=True)
    except KeyboardInterrupt:
        print("interrupted: every adapter was stopped", file=sys.stderr)
        return 130
    if len(reports) > 1:
        print("\n" + format_scaling(reports))
    if options.json_path:
        data = report_json(reports[0]) if len(reports) == 1 else {"runs": [report_json(r) for r in reports]}
        options.json_path.write_text(json.dumps(data, indent=1))
        print(f"wrote {options.json_path}")
    return 0


def run(options: Options, threads: int) -> Report:
    """Every engine at `threads` compute threads: one table."""
    folder = bundled_folder()
    say(f"model folder: {folder}")
    prompt = prompt_ids(folder, options.prompt_tokens)
    say(f"measuring the machine at {threads} thread(s)")
    machine = measure_machine(threads)
    notes: list[str] = []
    slots, models = prepare(options, folder, notes)
    processes: dict[Key, EngineProcess] = {}
    try:
        ready = start_one_at_a_time(launchers(options, slots, models, threads), slots, processes)
        notes.extend(f"servelab {precision}: {m['info']['kernel']}" for (precision, engine), m in ready.items()
                     if engine == "servelab" and "kernel" in m.get("info", {}))
        notes.extend(f"{engine} {precision}: {m['info']['note']}" for (precision, engine), m in ready.items()
                     if "note" in m.get("info", {}))
        warm_up(options, processes, prompt)
        samples, firsts, errors = measure(options, processes, prompt)
    finally:
        for process in processes.values():
            process.close()
    versions = {PEERS[e].package: m["version"] for (_, e), m in ready.items()}
    results = tuple(assemble(options, precision, slots, ready, machine, samples, firsts, errors)
                    for precision in options.precisions)
    return Report(options, machine.cpu, machine.bandwidth_gbs, machine.peak_flops_per_s, tuple(prompt), versions,
                  results, tuple(notes), threads)


def assemble(options: Options, precision: str, slots: dict[Key, Slot], ready: dict[Key, dict],
             machine: MachineFacts, samples: dict[CellKey, list[Sample]], firsts: dict[CellKey, list[list[int]]],
             errors: dict[CellKey, str]) -> PrecisionResult:
    """One precision's cells (medians, agreement with servelab, or the error) and servelab's rooflines."""
    cells = {}
    for batch_size in options.batch_sizes:
        for engine in options.engines:
            key = (precision, batch_size, engine)
            if samples[key]:
                agreement = min((common_prefix_length(a, b) for a, b in
                                 zip(firsts[(precision, batch_size, "servelab")], firsts[key])), default=None)
                cells[(batch_size, engine)] = median_cell(samples[key], agreement)
            else:
                cells[(batch_size, engine)] = Cell(error=errors.get(key, "not measured"))
    info = ready.get((precision, "servelab"), {}).get("info")
    peak = machine.peak_flops_per_s.get(info["compute_dtype"]) if info else None
    roofs = None if peak is None else rooflines(
        info["decode_cost"], info["compute_dtype"], bandwidth_gbs=machine.bandwidth_gbs, peak_flops_per_s=peak,
        batch_sizes=options.batch_sizes, prompt_tokens=options.prompt_tokens, new_tokens=options.new_tokens)
    return PrecisionResult(precision, tuple(slots[(precision, e)] for e in options.engines), cells, roofs)


def prepare(options: Options, folder: Path, notes: list[str]) -> tuple[dict[Key, Slot], dict[Key, Path]]:
    """Each (precision, engine): the model it loads (converted if needed), or why it will not run."""
    slots: dict[Key, Slot] = {}
    models: dict[Key, Path] = {}
    for precision in options.precisions:
        for engine in options.engines:
            peer = PEERS[engine]
            label = peer.precisions[precision]
            if isinstance(label, Unavailable):
                slots[(precision, engine)] = Slot(engine, None, f"n/a at {precision}: {label.reason}")
                continue
            if not peer.installed:
                slots[(precision, engine)] = Slot(engine, label, peer.setup_hint)
                continue
            slots[(precision, engine)] = Slot(engine, label)
            if engine == "servelab":
                models[(precision, engine)] = ROOT / "configs" / f"{label}.yaml"
            elif engine == "vllm" and label == "awq":
                checkpoint = awq_checkpoint(ROOT / "configs" / f"{PEERS['servelab'].precisions[precision]}.yaml")
                if (checkpoint / "config.json").is_file():
                    models[(precision, engine)] = checkpoint
                else:
                    slots[(precision, engine)] = Slot(engine, label, "servelab's AWQ checkpoint is missing: "
                                                      ".venv/bin/servelab quantize --config configs/awq-int4-fast.yaml")
            elif not peer.converts:
                models[(precision, engine)] = folder
            else:
                try:
                    models[(precision, engine)] = convert(engine, label, folder, notes)
                except RuntimeError as exc:
                    slots[(precision, engine)] = Slot(engine, label, str(exc))
    return slots, models


def convert(engine: str, label: str, folder: Path, notes: list[str]) -> Path:
    log = LOGS / f"convert-{engine}-{label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    say(f"converting (or reusing) {engine} {label}")
    with log.open("w") as stderr:
        done = subprocess.run([str(PEERS[engine].python), "-m", "bench.peers.convert", "--peer", engine,
                               "--precision", label, "--source", str(folder)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"conversion failed (exit {done.returncode}); log: {log}")
    path = Path(done.stdout.strip().splitlines()[-1])
    made = json.loads(((path if path.is_dir() else path.parent) / "SOURCE.json").read_text())
    size = sum(f.stat().st_size for f in (path.iterdir() if path.is_dir() else [path]) if f.is_file())
    notes.append(f"model {engine} {label}: {path} ({size / 1e6:.0f} MB; its conversion took {made['seconds']:.0f} s)")
    return path


def launchers(options: Options, slots: dict[Key, Slot], models: dict[Key, Path], threads: int
              ) -> dict[Key, Callable[[], EngineProcess]]:
    """Each runnable (precision, engine): how to start its adapter."""
    launch = {}
    for key, model in models.items():
        if slots[key].note is None:
            args = AdapterArgs(str(model), slots[key].label, threads, max(options.batch_sizes),
                               options.prompt_tokens + options.new_tokens)
            launch[key] = partial(EngineProcess, PEERS[key[1]].python, f"bench.peers.engines.{key[1]}", args,
                                  LOGS / f"{key[1]}-{key[0]}.log")
    return launch


def start_one_at_a_time(launch: dict[Key, Callable[[], EngineProcess]], slots: dict[Key, Slot],
                        processes: dict[Key, EngineProcess]) -> dict[Key, dict]:
    """Start each adapter, wait for its ready line and hold it stopped before the next one starts; fills
    `processes` (the caller closes them, also when this raises) and returns each ready message. A load that
    fails becomes its slot's note. NOTE: one at a time because a load measures: servelab's `auto` kernel
    choice and int4 crossover time their candidates at the run's thread count, and ten adapters loading
    side by side on a 2-core machine made those timings (and so the kernels measured) those of a machine
    the measurement never runs on."""
    say(f"starting {len(launch)} adapter(s), one at a time")
    ready = {}
    for key, start in launch.items():
        started = time.monotonic()
        process = processes[key] = start()
        try:
            ready[key] = process.wait_ready(LOAD_TIMEOUT_S)
            process.hold()  # NOTE: only the engine being measured runs (warm-up and measure release it)
            say(f"{key[1]} {slots[key].label} ready (loaded in {time.monotonic() - started:.0f} s)")
        except EngineError as exc:
            slots[key] = Slot(key[1], slots[key].label, str(exc))
            process.close()
            del processes[key]
    return ready


def warm_up(options: Options, processes: dict[Key, EngineProcess], prompt: list[int]) -> None:
    """One short call per (engine, batch size): first calls pay for lazy initialisation and shape setup."""
    for (precision, engine), process in processes.items():
        for batch_size in options.batch_sizes:
            say(f"warm-up {precision} {engine} batch {batch_size}")
            try:
                with process.running():
                    process.call(Request(batch_size, prompt, 2), CALL_TIMEOUT_S)
            except EngineError:
                break  # the process is dead; measure() reports why in its cells


def measure(options: Options, processes: dict[Key, EngineProcess], prompt: list[int]
            ) -> tuple[dict[CellKey, list[Sample]], dict[CellKey, list[list[int]]], dict[CellKey, str]]:
    """Every scheduled call pair -> samples, row 0's tokens of each t_N call, and the first error per cell."""
    samples: dict[CellKey, list[Sample]] = defaultdict(list)
    firsts: dict[CellKey, list[list[int]]] = defaultdict(list)
    errors: dict[CellKey, str] = {}
    n = options.new_tokens
    for round_idx, precision, batch_size, engine in schedule(options.rounds, options.precisions,
                                                             options.batch_sizes, options.engines):
        process = processes.get((precision, engine))
        if process is None:
            continue
        key = (precision, batch_size, engine)
        try:
            with process.running():
                full = process.call(Request(batch_size, prompt, n), CALL_TIMEOUT_S)
                one = full if "error" in full else process.call(Request(batch_size, prompt, 1), CALL_TIMEOUT_S)
        except EngineError as exc:
            errors.setdefault(key, str(exc))
            continue
        if "error" in full or "error" in one:
            errors.setdefault(key, full.get("error") or one["error"])
            say(f"round {round_idx + 1} {precision} batch {batch_size} {engine}: {errors[key]}")
            continue
        sample = Sample(batch_size, n, full["seconds"], one["seconds"])
        samples[key].append(sample)
        firsts[key].append(full["first_row_token_ids"])
        decode = sample.decode_tokens_per_s
        say(f"round {round_idx + 1}/{options.rounds} {precision} batch {batch_size} {engine}: decode "
            f"{decode or float('nan'):.1f} tok/s, e2e {sample.e2e_tokens_per_s:.1f} tok/s")
    return samples, firsts, errors


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
