"""Comparison plans: run a baseline and candidates on one workload, measure quality, judge, print, store.

Knows the plan file (workload, baseline, candidates, limits, repeats, quality sample size), the
order of work (rounds, each starting a fresh worker per config and running every config once in a
counterbalanced order; then quality once per config with the workers stopped), how stored runs become
RunSets, and the printed report. The judging is verdict.py's.
"""

from __future__ import annotations

import math
import random
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from servelab.config import ConfigError, ServingConfig, describe_validation_error, read_yaml_mapping
from servelab.lab.runner import WorkerProcess, run_workload, start_together, start_worker, warm_up
from servelab.lab.verdict import Limits, RunSet, Verdict, compare
from servelab.lab.workload import Workload, load_workload
from servelab.runtime import Runtime
from servelab.lab import runsets
from servelab.store import runs as store
from servelab.store.db import session_scope


# NOTE: chosen from `servelab calibrate` on the 2-core machines this project runs on (docs/lab.md, "Calibration"):
# one paired round of the smoke workload spreads by about 0.09 on the log scale there (quiet), so six rounds
# give a +-10 % interval (t with 5 degrees of freedom), enough to decide the x1.1-x1.2 limits plans set; an
# even number completes the order's blocks of two; fewer leave most criteria unsure.
DEFAULT_REPEATS = 6


class PlanError(ValueError):
    """A plan file that cannot be used; the message names the field and the fix."""


class QualitySpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    lambada_samples: int = Field(default=100, ge=0, le=5153, description="0 skips the quality measurement")
    seed: int = 0


class PlanSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    workload: str
    baseline: str
    candidates: tuple[str, ...] = Field(min_length=1)
    repeats: int = Field(default=DEFAULT_REPEATS, ge=1, le=50, description="rounds: each runs every config once")
    seed: int = Field(default=0, description="draws the configs' order in each block of two rounds")
    fresh_workers: bool = Field(default=True, description=(
        "a new worker process per config for every round, so the intervals include what differs between "
        "processes (memory placement, kernel set-up); false keeps one per config for the whole plan"))
    quality: QualitySpec = QualitySpec()
    limits: Limits


@dataclass(frozen=True)
class Plan:
    spec: PlanSpec
    workload: Workload
    baseline: tuple[ServingConfig, Path]
    candidates: tuple[tuple[ServingConfig, Path], ...]


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    data = read_yaml_mapping(path, "plan", PlanError)
    try:
        spec = PlanSpec.model_validate(data)
    except ValidationError as exc:
        raise PlanError(f"{path}: {describe_validation_error(exc)}") from None
    try:
        configs = [_config(path, p) for p in (spec.baseline, *spec.candidates)]
        workload = load_workload(_resolve(path, spec.workload))
    except (ConfigError, ValueError) as exc:
        raise PlanError(f"{path}: {exc}") from None
    names = [c.name for c, _ in configs]
    if len(set(names)) != len(names):
        raise PlanError(f"{path}: the configs' names must differ (each serves its own stream), got {names}")
    return Plan(spec, workload, configs[0], tuple(configs[1:]))


def _resolve(plan_path: Path, ref: str) -> Path:
    """A path as written if it exists from here, else relative to the plan file."""
    given = Path(ref)
    return given if given.is_absolute() or given.exists() else plan_path.parent / given


def _config(plan_path: Path, ref: str) -> tuple[ServingConfig, Path]:
    path = _resolve(plan_path, ref)
    return ServingConfig.from_yaml(path), path


@dataclass(frozen=True)
class PlanResult:
    comparison_id: str
    baseline: RunSet
    verdicts: tuple[Verdict, ...]


def round_order(names: list[str], round_index: int, *, seed: int = 0) -> list[str]:
    """The configs' order in one round: rounds come in blocks of two, a random order then its reverse.

    NOTE: each round pairs one run of every config measured side by side. Reversing within a block cancels a
    drift of the machine (a neighbour's load rising, a clock settling) and the effect of running first or
    last; drawing each block's order at random (seeded, stored with the comparison) keeps any position effect
    that remains (an odd last round, a middle place) a random error that the intervals cover, not a bias.
    """
    first = random.Random(f"{seed}:{round_index // 2}").sample(list(names), len(names))
    return first if round_index % 2 == 0 else first[::-1]


def start_workers(stack: ExitStack, configs, runtime: Runtime, workload: Workload, progress) -> dict[str, WorkerProcess]:
    """A warmed-up worker process per config, stopped when the stack closes. NOTE: the processes start together
    (a plan with fresh workers starts them every round); nothing is measured until every one is up and warmed."""
    workers = {}
    for config, path in configs:
        progress(f"[{config.name}] starting a worker")
        workers[config.name] = start_worker(config, path, runtime)
    start_together(stack, list(workers.values()))
    for config, _ in configs:
        warm_up(workers[config.name], config, workload)
    return workers


def run_plan(plan: Plan, runtime: Runtime, *, progress=lambda message: None) -> PlanResult:
    configs = [plan.baseline, *plan.candidates]
    names = [config.name for config, _ in configs]
    run_ids: dict[str, list[str]] = {name: [] for name in names}
    rounds: list[list[str]] = []
    by_name = {config.name: config for config, _ in configs}
    with ExitStack() as kept:
        workers = {} if plan.spec.fresh_workers else start_workers(kept, configs, runtime, plan.workload, progress)
        for repeat in range(plan.spec.repeats):
            rounds.append(round_order(names, repeat, seed=plan.spec.seed))
            with ExitStack() as fresh:
                if plan.spec.fresh_workers:
                    workers = start_workers(fresh, configs, runtime, plan.workload, progress)
                for name in rounds[-1]:
                    progress(f"round {repeat + 1}/{plan.spec.repeats}: [{name}]")
                    outcome = run_workload(workload=plan.workload, config=by_name[name], worker=workers[name],
                                           plan_name=plan.spec.name, repeat_index=repeat, progress=progress)
                    run_ids[name].append(outcome.run_id)
    if plan.spec.quality.lambada_samples:
        for config, _ in configs:
            progress(f"[{config.name}] LAMBADA on {plan.spec.quality.lambada_samples} passages")
            quality = measure_quality(config, runtime, plan.spec.quality)
            with session_scope(runtime.sessions) as session:
                for run_id in run_ids[config.name]:
                    store.set_run_quality(session, run_id=run_id, quality=quality)
    baseline = load_run_set(runtime, run_ids[names[0]])
    verdicts = tuple(compare(baseline, load_run_set(runtime, run_ids[c.name]), plan.spec.limits)
                     for c, _ in plan.candidates)
    with session_scope(runtime.sessions) as session:
        comparison_id = store.save_comparison(
            session, plan_name=plan.spec.name, plan=plan.spec.model_dump(mode="json"),
            baseline_run_ids=run_ids[names[0]],
            candidate_run_ids=[i for c, _ in plan.candidates for i in run_ids[c.name]],
            report={"verdicts": [v.as_dict() for v in verdicts], "rounds": rounds},
        )
    return PlanResult(comparison_id, baseline, verdicts)


def measure_quality(config: ServingConfig, runtime: Runtime, spec: QualitySpec) -> dict[str, Any]:
    """LAMBADA through the serving engine with this config's weights, cache and batching."""
    from servelab.engine.engine import Engine
    from servelab.lab.quality import evaluate_lambada, lambada_passages

    engine = Engine.from_config(config, runtime.settings)
    result = evaluate_lambada(engine, lambada_passages(spec.lambada_samples, seed=spec.seed),
                              batch_size=config.batching.max_batch_size)
    return quality_record(result)


def quality_record(result) -> dict[str, Any]:
    return {
        "task": "lambada", "accuracy": result.accuracy.as_dict(), "perplexity": result.perplexity.as_dict(),
        "passage_ids": [p.passage_index for p in result.passages],
        "correct": [int(p.is_correct) for p in result.passages], "nll": [p.nll for p in result.passages],
        "num_target_tokens": [p.num_target_tokens for p in result.passages],
    }


def load_run_set(runtime: Runtime, run_ids: list[str]) -> RunSet:
    with session_scope(runtime.sessions) as session:
        return runsets.load_run_set(session, run_ids=run_ids)


def format_verdicts(verdicts: tuple[Verdict, ...] | list[Verdict]) -> str:
    lines = []
    for v in verdicts:
        lines.append(f"== {v.candidate} vs {v.baseline}: {v.decision.upper()} ==")
        lines.append(f"   {v.reason}")
        for hint in v.to_settle:
            lines.append(f"   to settle: {hint}")
        for w in v.warnings:
            lines.append(f"   warning: {w}")
        for check in v.repeat_checks:
            lines.append(f"   runs: {check}")
        lines.append(f"   {'criterion':<34} {'measured':>10} {'95% interval':>22} {'limit':>10}  result")
        for c in v.criteria:
            interval = f"[{c.measured.low:.3g}, {c.measured.high:.3g}]" if c.measured.has_interval else "-"
            lines.append(f"   {c.kind + ': ' + c.name:<34} {c.measured.value + 0.0:>10.3g} {interval:>22} {c.limit:>10}  "
                         f"{OUTCOME_LABELS[c.outcome]:<6} {c.note}")
        lines.append(f"   {'figure':<40} {'baseline':>12} {'candidate':>12} {'ratio':>8} {'95% interval':>20}")
        for f in v.figures:
            ratio, interval = _ratio(f), "-"
            if ratio != "-" and f.ratio.has_interval:
                interval = f"[{f.ratio.low:+.3f}, {f.ratio.high:+.3f}]" if _is_difference(f) else \
                    f"[{f.ratio.low:.3f}, {f.ratio.high:.3f}]"
            lines.append(f"   {f.name:<40} {_num(f.baseline):>12} {_num(f.candidate):>12} {ratio:>8} {interval:>20}")
    return "\n".join(lines)


OUTCOME_LABELS = {"pass": "pass", "fail": "FAIL", "unsure": "unsure"}


def decision_of(verdicts) -> str:
    """The plan's answer over every candidate: reject if any is rejected, else inconclusive if any is, else accept."""
    decisions = {v.decision for v in verdicts}
    return next(d for d in ("reject", "inconclusive", "accept") if d in decisions or d == "accept")


def _is_difference(figure) -> bool:
    return "difference" in figure.name


def _ratio(figure) -> str:
    """x1.234 for a ratio, +0.012 for a difference, - where there is none (e.g. a side measured 0)."""
    if figure.ratio is None or not math.isfinite(figure.ratio.value):
        return "-"
    return f"{figure.ratio.value + 0.0:+.3f}" if _is_difference(figure) else f"x{figure.ratio.value:.3f}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
