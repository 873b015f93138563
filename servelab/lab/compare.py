"""A comparison, run: a plan's rounds on real workers, then quality once per config, judged and stored.

Knows the order of work (rounds, each starting a fresh worker per config and running every config once in a
counterbalanced order; then quality once per config with the workers stopped) and how stored runs become
RunSets. The plan file and the rounds' order are servelab/analysis/plan.py's, the judging verdict.py's and
the printed report report.py's.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from servelab.analysis.plan import Plan, QualitySpec, round_order
from servelab.analysis.verdict import RunSet, Verdict, compare
from servelab.analysis.workload import Workload
from servelab.config import ServingConfig
from servelab.lab.runner import WorkerProcess, run_workload, start_together, start_worker, warm_up
from servelab.runtime import Runtime
from servelab.lab import runsets
from servelab.store import runs as store
from servelab.store.db import session_scope


@dataclass(frozen=True)
class PlanResult:
    comparison_id: str
    baseline: RunSet
    verdicts: tuple[Verdict, ...]


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
    if plan.spec.quality.lambada_samples or plan.spec.quality.long_context_segments:
        for config, _ in configs:
            q = plan.spec.quality
            asked = [f"LAMBADA on {q.lambada_samples} passages" if q.lambada_samples else "",
                     f"long-context perplexity on {q.long_context_segments} segments" if q.long_context_segments else ""]
            progress(f"[{config.name}] " + ", ".join(a for a in asked if a))
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
    """LAMBADA (and, when asked, long-context perplexity) through the serving engine with this config's weights, cache,
    attention window and batching."""
    from servelab.lab.quality import evaluate_lambada, lambada_passages, scoring_engine

    engine = scoring_engine(config, runtime.settings)
    record: dict[str, Any] = {}
    if spec.lambada_samples:
        record = quality_record(evaluate_lambada(engine, lambada_passages(spec.lambada_samples, seed=spec.seed),
                                                 batch_size=config.batching.max_batch_size))
    if spec.long_context_segments:
        from servelab.lab.long_context import evaluate_long_context, long_segments

        segments = long_segments(engine.tokenizer, length=spec.long_context_tokens,
                                 num_segments=spec.long_context_segments)
        result = evaluate_long_context(engine, segments, scored_from=spec.long_context_scored_from)
        record["long_context"] = {**result.as_dict(), "length": spec.long_context_tokens,
                                  "scored_from": spec.long_context_scored_from}
    return record


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
