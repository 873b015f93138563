"""Comparison plans: run a baseline and candidates on one workload, measure quality, judge, print, store.

Knows the plan file (workload, baseline, candidates, limits, repeats, quality sample size), the
order of work (every config's repeats, then quality once per config with the engine stopped from
serving), how stored runs become RunSets, and the printed report. The judging is verdict.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from servelab.config import ConfigError, ServingConfig, describe_validation_error, read_yaml_mapping
from servelab.lab.runner import run_workload, start_worker, warm_up
from servelab.lab.verdict import Limits, RunSet, Verdict, compare
from servelab.lab.workload import Workload, load_workload
from servelab.runtime import Runtime
from servelab.lab import runsets
from servelab.store import runs as store
from servelab.store.db import session_scope


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
    repeats: int = Field(default=2, ge=1, le=20)
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


def run_plan(plan: Plan, runtime: Runtime, *, progress=lambda message: None) -> PlanResult:
    run_ids: dict[str, list[str]] = {}
    for config, path in (plan.baseline, *plan.candidates):
        progress(f"[{config.name}] starting a worker")
        with start_worker(config, path, runtime) as worker:
            warm_up(worker, config, plan.workload)
            for repeat in range(plan.spec.repeats):
                progress(f"[{config.name}] run {repeat + 1}/{plan.spec.repeats}")
                outcome = run_workload(workload=plan.workload, config=config, worker=worker,
                                       plan_name=plan.spec.name, repeat_index=repeat, progress=progress)
                run_ids.setdefault(config.name, []).append(outcome.run_id)
    if plan.spec.quality.lambada_samples:
        for config, _ in (plan.baseline, *plan.candidates):
            progress(f"[{config.name}] LAMBADA on {plan.spec.quality.lambada_samples} passages")
            quality = measure_quality(config, runtime, plan.spec.quality)
            with session_scope(runtime.sessions) as session:
                for run_id in run_ids[config.name]:
                    store.set_run_quality(session, run_id=run_id, quality=quality)
    baseline = load_run_set(runtime, run_ids[plan.baseline[0].name])
    verdicts = tuple(compare(baseline, load_run_set(runtime, run_ids[c.name]), plan.spec.limits)
                     for c, _ in plan.candidates)
    with session_scope(runtime.sessions) as session:
        comparison_id = store.save_comparison(
            session, plan_name=plan.spec.name, plan=plan.spec.model_dump(mode="json"),
            baseline_run_ids=run_ids[plan.baseline[0].name],
            candidate_run_ids=[i for c, _ in plan.candidates for i in run_ids[c.name]],
            report={"verdicts": [v.as_dict() for v in verdicts]},
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
        lines.append(f"== {v.candidate} vs {v.baseline}: {'ACCEPT' if v.accepted else 'REJECT'} ==")
        lines.append(f"   {v.reason}")
        for w in v.warnings:
            lines.append(f"   warning: {w}")
        for check in v.repeat_checks:
            lines.append(f"   repeats: {check}")
        lines.append(f"   {'criterion':<34} {'measured':>10} {'95% interval':>22} {'limit':>10}  result")
        for c in v.criteria:
            interval = f"[{c.measured.low:.3g}, {c.measured.high:.3g}]" if c.measured.has_interval else "-"
            lines.append(f"   {c.kind + ': ' + c.name:<34} {c.measured.value:>10.3g} {interval:>22} {c.limit:>10}  "
                         f"{'pass' if c.passed else 'FAIL'} {c.note}")
        lines.append(f"   {'figure':<40} {'baseline':>12} {'candidate':>12} {'ratio':>8} {'95% interval':>20}")
        for f in v.figures:
            ratio = f"x{f.ratio.value:.3f}" if f.ratio else "-"
            interval = f"[{f.ratio.low:.3f}, {f.ratio.high:.3f}]" if f.ratio and f.ratio.has_interval else "-"
            lines.append(f"   {f.name:<40} {_num(f.baseline):>12} {_num(f.candidate):>12} {ratio:>8} {interval:>20}")
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
