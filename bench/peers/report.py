"""The peer benchmark's results, as a printed table per precision and as JSON: pure formatting.

Knows the result records (which engine ran at which native precision, or why not; medians per cell;
rooflines) and how to lay them out: rows are batch sizes, and per engine decode tok/s, its ratio to
servelab's, end-to-end tok/s and how many leading greedy tokens of the first row match servelab's.
Long texts (errors, reasons) go in numbered notes under a table so the columns stay aligned.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from bench.peers.measure import Cell, Rooflines, ratio
from bench.peers.options import Options

CELL_WIDTH = 29


@dataclass(frozen=True)
class Slot:
    """One engine at one precision: its own precision label, or why it did not run."""

    engine: str
    label: str | None
    note: str | None = None  # not installed / not available / failed to load


@dataclass(frozen=True)
class PrecisionResult:
    precision: str
    slots: tuple[Slot, ...]
    cells: dict[tuple[int, str], Cell]  # (batch size, engine) -> medians or an error
    rooflines: Rooflines | None  # None when servelab did not load at this precision


@dataclass(frozen=True)
class Report:
    options: Options
    cpu: str
    bandwidth_gbs: float
    peak_flops_per_s: dict[str, float]
    prompt_ids: tuple[int, ...]
    versions: dict[str, str]
    results: tuple[PrecisionResult, ...]
    notes: tuple[str, ...] = field(default=())  # run-wide remarks (conversions, timings)
    threads: int = 1  # compute threads every engine had in this run


def format_report(report: Report) -> str:
    o = report.options
    peaks = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in report.peak_flops_per_s.items())
    lines = [
        f"cpu: {report.cpu}; threads per engine: {report.threads}; memory bandwidth (measured): "
        f"{report.bandwidth_gbs:.1f} GB/s; matmul peak GFLOP/s: {peaks}",
        f"prompt {o.prompt_tokens} tokens (same ids for every engine and row), {o.new_tokens} new tokens per row, "
        f"greedy, EOS ignored; medians of {o.rounds} interleaved round(s)",
        "versions: " + ", ".join(f"{k} {v}" for k, v in report.versions.items()),
    ]
    for result in report.results:
        lines += ["", *format_precision(result, o)]
    lines += [
        "",
        "decode tok/s = B x (N-1) / (t_N - t_1); e2e tok/s = B x N / t_N; t = one generate call with N or 1 new "
        "tokens, timed inside each adapter; x = decode tok/s / servelab's; agree = leading tokens of row 0 equal "
        "to servelab's at the same precision",
        "BW roof = B x bandwidth / (servelab's weight bytes + B x mean context x KV bytes per token); "
        "FLOP roof = peak in servelab's compute dtype / (2 x matmul params + attention) FLOPs per token",
        *report.notes,
    ]
    return "\n".join(lines)


def format_scaling(reports: list[Report]) -> str:
    """Runs at several thread counts side by side: each engine's decode tok/s per count, and its ratio to the same
    engine at the first count."""
    counts = [r.threads for r in reports]
    lines = [f"decode tok/s by threads per engine ({', '.join(map(str, counts))}); x = against the same engine at "
             f"{counts[0]} thread(s); each count a run of its own (medians of its rounds)"]
    for i, result in enumerate(reports[0].results):
        for b in reports[0].options.batch_sizes:
            for slot in result.slots:
                cells = [r.results[i].cells.get((b, slot.engine)) for r in reports]
                speeds = [c.decode_tokens_per_s if c is not None and c.error is None else None for c in cells]
                parts = []
                for n, speed in zip(counts, speeds):
                    x = ratio(speed, speeds[0])
                    parts.append(f"{n}t {_num(speed):>7}" + (f" (x{x:.2f})" if x is not None else ""))
                lines.append(f"  {result.precision:<5} batch {b:>3} {slot.engine:<9} " + " | ".join(parts))
    return "\n".join(lines)


def format_precision(result: PrecisionResult, o: Options) -> list[str]:
    notes: list[str] = []
    labels = "; ".join(f"{s.engine} {s.label or 'n/a'}" for s in result.slots)
    lines = [f"== {result.precision} ==  ({labels})"]
    engines = " ".join(f"{s.engine:^{CELL_WIDTH}}" for s in result.slots)
    header = f"{'batch':>5} {engines} {'BW roof':>8} {'FLOP roof':>9}"
    sub = f"{'':>5} " + " ".join(f"{'decode':>8} {'x':>6} {'e2e':>7} {'agree':>5}" for _ in result.slots)
    lines += [header, sub]
    base = {b: result.cells.get((b, "servelab"), Cell()) for b in o.batch_sizes}
    for b in o.batch_sizes:
        parts = [_cell(result.cells.get((b, s.engine)), s, base[b], o.new_tokens, notes) for s in result.slots]
        roof = result.rooflines
        bw = f"{roof.bandwidth_tokens_per_s[b]:>8.0f}" if roof else f"{'-':>8}"
        flop = f"{roof.compute_tokens_per_s:>9.0f}" if roof else f"{'-':>9}"
        lines.append(f"{b:>5} " + " ".join(parts) + f" {bw} {flop}")
    if result.rooflines:
        r = result.rooflines
        shares = [f"B={b} {cell.decode_tokens_per_s / r.bandwidth_tokens_per_s[b]:.0%}" for b in o.batch_sizes
                  if (cell := result.cells.get((b, "servelab"))) is not None and cell.decode_tokens_per_s]
        if shares:
            lines.append(f"servelab's decode against the bandwidth roofline: {', '.join(shares)}")
        lines.append(f"rooflines from servelab {result.precision}: weights {r.weight_bytes / 1e6:.1f} MB, KV "
                     f"{r.kv_bytes_per_token / 1e3:.1f} kB/token, compute {r.compute_dtype} at "
                     f"{r.peak_flops_per_s / 1e9:.1f} GFLOP/s")
    return lines + [f"[{i}] {note}" for i, note in enumerate(notes, 1)]


def _cell(cell: Cell | None, slot: Slot, base: Cell, new_tokens: int, notes: list[str]) -> str:
    if slot.note is not None or cell is None or cell.error is not None:
        reason = slot.note if slot.note is not None else (cell.error if cell else "not measured")
        note = f"{slot.engine}: {reason}"
        if note not in notes:
            notes.append(note)
        return f"{f'see [{notes.index(note) + 1}]':^{CELL_WIDTH}}"
    x = ratio(cell.decode_tokens_per_s, base.decode_tokens_per_s)
    agree = "-" if slot.engine == "servelab" or cell.agreement is None else f"{cell.agreement}/{new_tokens}"
    return (f"{_num(cell.decode_tokens_per_s):>8} {(f'{x:.2f}x' if x is not None else '-'):>6} "
            f"{_num(cell.e2e_tokens_per_s):>7} {agree:>5}")


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def report_json(report: Report) -> dict[str, Any]:
    options = asdict(report.options)
    options["json_path"] = str(report.options.json_path) if report.options.json_path else None
    return {
        "options": options, "cpu": report.cpu, "bandwidth_gbs": report.bandwidth_gbs,
        "peak_flops_per_s": report.peak_flops_per_s, "prompt_ids": list(report.prompt_ids), "threads": report.threads,
        "versions": report.versions, "notes": list(report.notes),
        "results": [{
            "precision": r.precision,
            "engines": [asdict(s) for s in r.slots],
            "rooflines": asdict(r.rooflines) if r.rooflines else None,
            "cells": [{"batch_size": b, "engine": e, **asdict(c)} for (b, e), c in r.cells.items()],
        } for r in report.results],
    }
