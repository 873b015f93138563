"""Comparison plans: the plan file (workload, baseline, candidates, limits, repeats, quality sample size, and a
sequential budget when it runs until settled) and the order of its rounds.

Reads YAML and the configs and workload a plan names; bad files get a PlanError naming the field and the fix.
Does not run anything: servelab/lab/compare.py runs a plan's rounds on workers and stores the comparison.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any, Literal
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from servelab.analysis.sequential import SequentialSpec
from servelab.analysis.verdict import GAIN_METRICS, Limits
from servelab.analysis.workload import Workload, load_workload
from servelab.config import ConfigError, ServingConfig, describe_validation_error, read_yaml_mapping


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
    long_context_segments: int = Field(default=0, ge=0, le=64, description=(
        "long-context perplexity: segments of long_context_tokens tokens cut from pydoc's topics (the standard "
        "library's reference documentation), scored from long_context_scored_from on; 0 skips it"))
    long_context_tokens: int = Field(default=2048, ge=16, le=8192)
    long_context_scored_from: int = Field(default=1024, ge=1)

    @model_validator(mode="after")
    def _scored_within(self) -> QualitySpec:
        if self.long_context_scored_from >= self.long_context_tokens:
            raise ValueError(f"long_context_scored_from ({self.long_context_scored_from}) must be below "
                             f"long_context_tokens ({self.long_context_tokens})")
        return self


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
    sequential: SequentialSpec | None = Field(default=None, description=(
        "run until every candidate is settled or this budget is spent, instead of `repeats` rounds and "
        "quality.lambada_samples passages (servelab/analysis/sequential.py)"))
    rank_by: Literal[GAIN_METRICS] | None = Field(default=None, description=(  # type: ignore[valid-type]
        "with several candidates: the figure that ranks those meeting every limit (null: the first gain's)"))


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


def until_settled(plan: Plan, **budget: Any) -> Plan:
    """The plan run until settled: its `sequential:` section (or the defaults) with the budget given (None: kept)."""
    given = (plan.spec.sequential or SequentialSpec()).model_dump()
    try:
        spec = SequentialSpec.model_validate({**given, **{k: v for k, v in budget.items() if v is not None}})
    except ValidationError as exc:
        raise PlanError(f"the sequential budget (the plan's sequential: section, then the options): "
                        f"{describe_validation_error(exc).replace('(top level)', 'sequential')}") from None
    return replace(plan, spec=plan.spec.model_copy(update={"sequential": spec}))


def _resolve(plan_path: Path, ref: str) -> Path:
    """A path as written if it exists from here, else relative to the plan file."""
    given = Path(ref)
    return given if given.is_absolute() or given.exists() else plan_path.parent / given


def _config(plan_path: Path, ref: str) -> tuple[ServingConfig, Path]:
    path = _resolve(plan_path, ref)
    return ServingConfig.from_yaml(path), path


def round_order(names: list[str], round_index: int, *, seed: int = 0) -> list[str]:
    """The configs' order in one round: rounds come in blocks of two, a random order then its reverse.

    NOTE: each round pairs one run of every config measured side by side. Reversing within a block cancels a
    drift of the machine (a neighbour's load rising, a clock settling) and the effect of running first or
    last; drawing each block's order at random (seeded, stored with the comparison) keeps any position effect
    that remains (an odd last round, a middle place) a random error that the intervals cover, not a bias.
    """
    first = random.Random(f"{seed}:{round_index // 2}").sample(list(names), len(names))
    return first if round_index % 2 == 0 else first[::-1]
