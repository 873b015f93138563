"""Calibration of the verdict, measured: how often it is wrong when nothing changed, and whether it finds a
difference that is known to be there.

Three experiments on one config and one workload, each repeated as many independent comparisons as asked,
through real workers and the real queue, with the rounds of a plan (counterbalanced order, paired by round):
- A/A: the config against itself (one worker; its runs go alternately to two sides);
- A/A': the config against a copy that differs only in its name (two workers);
- the known difference: max_batch_size 1 against 16 under the workload's burst, judged both ways (16 against 1
  must be accepted, 1 against 16 rejected).
Counts what a calibration is about: A/A comparisons wrongly accepted as a gain or rejected for a latency
limit (nominal at most 5 %), and how often each figure's 95 % interval excludes x1 when nothing changed.
Also reports the run-to-run spread per figure and the interval width it implies for a number of repeats,
which is how the plans' default repeats were chosen. Stores its runs (plan name "calibration"). With a
sequential budget, every comparison adds rounds until it is settled (servelab/analysis/sequential.py) and the
rounds it used are counted: the same error counts, now of the sequential verdict.

NOTE: unlike a plan, it keeps its worker processes for the whole calibration (a fresh process per run
would make twenty comparisons take hours): it calibrates the intervals against the variation between runs;
the A/A' comparisons, two processes throughout, would show a process-level effect as extra interval misses.
"""

from __future__ import annotations

import math
import statistics
import tempfile
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from servelab.config import ServingConfig
from servelab.analysis.plan import round_order
from servelab.lab.compare import load_run_set, start_workers
from servelab.lab.runner import WorkerProcess, run_workload
from servelab.analysis.sequential import Look, SequentialRecord, SequentialSpec
from servelab.analysis.stats import RunRatio, t95
from servelab.analysis.verdict import GainGoal, LatencyLimit, Levels, Limits, RunSet, Verdict, compare
from servelab.analysis.workload import Workload
from servelab.runtime import Runtime

# NOTE: limits whose answer is known for every experiment: nothing changes in A/A, and batching 16 rows
# against one under a burst raises tokens/s and lowers TTFT and end-to-end latency. TPOT is left out: batching
# trades time per token for throughput, so its direction is not the known part.
CALIBRATION_LIMITS = Limits(
    max_accuracy_drop=None,
    latency=(LatencyLimit(metric="ttft_ms", percentile=95, max_ratio=1.2),
             LatencyLimit(metric="e2el_ms", percentile=95, max_ratio=1.2)),
    gains=(GainGoal(metric="output_tokens_per_s", min_ratio=1.2),),
)
PLAN_NAME = "calibration"
NULL_FIGURES = ("output_tokens_per_s", "p50 ttft_ms", "p95 ttft_ms", "p95 tpot_ms", "p95 e2el_ms", "p95 queue_ms")


@dataclass
class NullExperiment:
    """Comparisons where nothing changed: how often the verdict or an interval says otherwise."""

    name: str
    decisions: dict[str, int] = field(default_factory=dict)
    accepted_as_gain: int = 0
    rejected_for_latency: int = 0
    excluding_one: dict[str, int] = field(default_factory=dict)  # figure -> intervals that exclude x1
    unit_sd: dict[str, list[float]] = field(default_factory=dict)  # figure -> log spread of one paired repeat
    rounds_used: list[int] = field(default_factory=list)  # per comparison

    @property
    def num_comparisons(self) -> int:
        return sum(self.decisions.values())

    @property
    def num_wrong(self) -> int:
        return self.accepted_as_gain + self.rejected_for_latency

    def add(self, verdict: Verdict) -> None:
        self.decisions[verdict.decision] = self.decisions.get(verdict.decision, 0) + 1
        self.accepted_as_gain += verdict.decision == "accept"
        self.rejected_for_latency += any(c.kind == "latency" and c.outcome == "fail" for c in verdict.criteria)
        for figure in verdict.figures:
            if figure.name in NULL_FIGURES and isinstance(figure.ratio, RunRatio) and figure.ratio.has_interval:
                excluded = not (figure.ratio.low <= 1.0 <= figure.ratio.high)
                self.excluding_one[figure.name] = self.excluding_one.get(figure.name, 0) + excluded
                if figure.ratio.unit_sd is not None:
                    self.unit_sd.setdefault(figure.name, []).append(figure.ratio.unit_sd)


@dataclass
class KnownExperiment:
    """max_batch_size 16 against 1 under a burst: must be accepted, and the reverse rejected."""

    found: int = 0
    reverse_rejected: int = 0
    num_comparisons: int = 0
    gains: list[float] = field(default_factory=list)  # tokens/s ratio of each comparison
    rounds_used: list[int] = field(default_factory=list)  # per comparison (the forward and reverse verdicts both)


@dataclass
class Calibration:
    config: str
    workload: str
    repeats: int
    known_repeats: int
    experiments: list[NullExperiment]
    known: KnownExperiment
    sequential: dict[str, Any] | None = None  # the budget when run until settled (repeats: its max_rounds)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def variant(config: ServingConfig, folder: Path, name: str, **batching: Any) -> tuple[ServingConfig, Path]:
    """A copy of the config under another name (and optionally other batching), written where a worker reads it."""
    data = config.model_dump(mode="json")
    data["name"] = name
    data["batching"] = {**data["batching"], **batching}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return ServingConfig.from_yaml(path), path


def calibrate(config: ServingConfig, config_path: Path, workload: Workload, runtime: Runtime, *,
              num_comparisons: int = 20, num_known: int = 5, repeats: int = 5, known_repeats: int | None = None,
              sequential: SequentialSpec | None = None, progress=lambda message: None) -> Calibration:
    """`repeats` rounds per A/A and A/A' comparison; `known_repeats` (default: the same) per known one. With
    `sequential`, each comparison runs until settled within its round budget instead (passages play no part)."""
    known_repeats = known_repeats or repeats
    if sequential is not None:
        repeats = known_repeats = sequential.max_rounds
    assert min(repeats, known_repeats) >= 2 and num_comparisons >= 1 and num_known >= 0, "calibration needs intervals"
    aa, aa_copy, known = NullExperiment("A/A (the config against itself)"), \
        NullExperiment("A/A' (against a copy that differs only in its name)"), KnownExperiment()
    with tempfile.TemporaryDirectory(prefix="servelab-calibrate-") as tmp:
        copy = variant(config, Path(tmp), f"{config.name}-copy")
        with ExitStack() as stack:
            workers = start_workers(stack, [(config, config_path), copy], runtime, workload, progress)
            first, second = workers[config.name], workers[copy[0].name]
            for k in range(num_comparisons):
                cells = {"A": (config, first), "A2": (config, first), "A'": (copy[0], second)}
                pairs = {"aa": ("A", "A2"), "aa'": ("A", "A'")}
                judged = _rounds(cells, workload, repeats, runtime, progress, f"comparison {k + 1}/{num_comparisons}",
                                 pairs, seed=k, sequential=sequential)
                for experiment, key in ((aa, "aa"), (aa_copy, "aa'")):
                    experiment.add(judged[key][0])
                    experiment.rounds_used.append(judged[key][1])
        if num_known:
            one, sixteen = (variant(config, Path(tmp), f"{config.name}-batch{n}", max_batch_size=n) for n in (1, 16))
            with ExitStack() as stack:
                started = start_workers(stack, [one, sixteen], runtime, workload, progress)
                workers = {"1": (one[0], started[one[0].name]), "16": (sixteen[0], started[sixteen[0].name])}
                for k in range(num_known):
                    judged = _rounds(workers, workload, known_repeats, runtime, progress,
                                     f"known {k + 1}/{num_known}", {"forward": ("1", "16"), "backward": ("16", "1")},
                                     seed=k, sequential=sequential)
                    (forward, used), (backward, used_back) = judged["forward"], judged["backward"]
                    known.num_comparisons += 1
                    known.rounds_used.append(max(used, used_back))
                    known.found += forward.decision == "accept"
                    known.reverse_rejected += backward.decision == "reject"
                    known.gains.append(next(c for c in forward.criteria if c.kind == "gain").measured.value)
    return Calibration(config.name, workload.name, repeats, known_repeats, [aa, aa_copy], known,
                       sequential.model_dump(mode="json") if sequential else None)


def _rounds(cells: dict[str, tuple[ServingConfig, WorkerProcess]], workload: Workload, repeats: int,
            runtime: Runtime, progress, label: str, pairs: dict[str, tuple[str, str]], *, seed: int,
            sequential: SequentialSpec | None = None) -> dict[str, tuple[Verdict, int]]:
    """Rounds of the cells, then each pair (baseline cell, candidate cell) judged: after `repeats` rounds, or, with
    `sequential`, after every round from its min_rounds until every pair is settled or the rounds run out.
    Returns each pair's verdict and the rounds it used."""
    run_ids: dict[str, list[str]] = {cell: [] for cell in cells}
    records = {key: SequentialRecord(sequential, sequential.levels()) for key in pairs} if sequential else {}
    used: dict[str, int] = {}
    for repeat in range(repeats):
        for cell in round_order(list(cells), repeat, seed=seed):
            config, worker = cells[cell]
            progress(f"{label}, round {repeat + 1}/{repeats}: {cell}")
            outcome = run_workload(workload=workload, config=config, worker=worker, plan_name=PLAN_NAME,
                                   repeat_index=repeat)
            run_ids[cell].append(outcome.run_id)
        if sequential is None or repeat + 1 < sequential.min_rounds:
            continue
        runs = {cell: load_run_set(runtime, ids) for cell, ids in run_ids.items()}
        for key, record in records.items():
            if not record.stop:
                look = Look(len(record.looks) + 1, repeat + 1, 0, 0.0)
                record.add(look, [_judge(runs, pairs[key], sequential.levels())], CALIBRATION_LIMITS,
                           has_passages=False)
                used[key] = repeat + 1
        if all(record.stop for record in records.values()):
            break
    if sequential is not None:
        return {key: (next(iter(records[key].verdicts.values())), used[key]) for key in pairs}
    runs = {cell: load_run_set(runtime, ids) for cell, ids in run_ids.items()}
    return {key: (_judge(runs, pair, Levels()), repeats) for key, pair in pairs.items()}


def _judge(runs: dict[str, RunSet], pair: tuple[str, str], levels: Levels) -> Verdict:
    """The pair's verdict; a cell against another of the same config (A/A) gets its own name."""
    baseline, candidate = runs[pair[0]], runs[pair[1]]
    if candidate.name == baseline.name:
        candidate = replace(candidate, name=f"{candidate.name} (second)")
    return compare(baseline, candidate, CALIBRATION_LIMITS, levels=levels)


def half_width(unit_sd: float, repeats: int) -> float:
    """The relative half-width (x) of a paired ratio's 95 % interval after `repeats` rounds at this spread."""
    return math.exp(t95(repeats - 1) * unit_sd / math.sqrt(repeats))


def format_calibration(result: Calibration, *, widths_for=(3, 5, 8, 10)) -> str:
    rounds = f"{result.repeats} rounds per comparison" if not result.sequential else (
        f"until settled, rounds {result.sequential['min_rounds']}-{result.sequential['max_rounds']} (5 % spent over "
        "the looks)")
    lines = [f"calibration of {result.config} on {result.workload}: {rounds}, "
             f"limits: gain tokens/s >= x1.2, p95 TTFT and p95 E2E latency <= x1.2"]
    for e in result.experiments:
        n = e.num_comparisons
        used = f"; mean rounds {statistics.fmean(e.rounds_used):.2f}" if e.rounds_used else ""
        lines.append(f"{e.name}: {n} comparisons: {dict(e.decisions)}; wrongly accepted as a gain "
                     f"{e.accepted_as_gain}/{n}, rejected for a latency limit {e.rejected_for_latency}/{n} "
                     f"(nominal at most 5 %: {math.floor(0.05 * n)}/{n}){used}")
        lines.append(f"   {'figure':<20} {'intervals excluding x1':>24} {'median log spread':>18}   "
                     + "  ".join(f"±x at {r} rounds" for r in widths_for))
        for name in NULL_FIGURES:
            spreads = e.unit_sd.get(name, [])
            median = statistics.median(spreads) if spreads else float("nan")
            widths = "  ".join(f"{half_width(median, r):>13.3f}" if spreads else f"{'-':>13}" for r in widths_for)
            lines.append(f"   {name:<20} {e.excluding_one.get(name, 0):>20}/{n:<3} {median:>18.3f}   {widths}")
    k = result.known
    if k.num_comparisons:
        each = "until settled" if result.sequential else f"{result.known_repeats} rounds each"
        lines.append(f"known difference (max_batch_size 16 against 1 under the burst, {each}): accepted {k.found}/"
                     f"{k.num_comparisons}, the reverse rejected {k.reverse_rejected}/{k.num_comparisons}; tokens/s "
                     f"ratios {', '.join(f'x{g:.2f}' for g in k.gains)}; mean rounds "
                     f"{statistics.fmean(k.rounds_used):.2f}")
    return "\n".join(lines)
