"""A comparison, run: a plan's rounds on real workers, then quality once per config, judged and stored; or, run until
settled, rounds and steps of LAMBADA passages judged after each step until every candidate is settled or the budget
is spent, a rejected candidate measured no more. With several candidates, those that meet every limit ranked.

Knows the order of work (rounds, each starting a fresh worker per config and running every config once in a
counterbalanced order; then quality once per config with the workers stopped) and how stored runs become
RunSets. The plan file and the rounds' order are servelab/analysis/plan.py's, the judging verdict.py's, when to
stop sequential.py's, the ranking ranking.py's and the printed report report.py's.
"""

from __future__ import annotations

import random
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from servelab.analysis.plan import Plan, QualitySpec, round_order
from servelab.analysis.ranking import Ranking, rank
from servelab.analysis.sequential import Look, SequentialRecord, SequentialSpec
from servelab.analysis.verdict import RunSet, Verdict, compare
from servelab.analysis.workload import Workload
from servelab.config import ServingConfig
from servelab.lab.runner import WorkerProcess, run_workload, start_together, start_worker, warm_up
from servelab.runtime import Runtime
from servelab.lab import runsets
from servelab.store import runs as store
from servelab.store.db import session_scope

if TYPE_CHECKING:
    from servelab.lab.quality import LambadaPassage, QualityResult


@dataclass(frozen=True)
class PlanResult:
    comparison_id: str
    baseline: RunSet
    verdicts: tuple[Verdict, ...]
    sequential: SequentialRecord | None = None  # run until settled: its looks, what settled it and when
    ranking: Ranking | None = None  # with several candidates: those that meet every limit, best first


@dataclass
class Rounds:
    """A plan's runs so far: each config's run ids, and every round's order."""

    run_ids: dict[str, list[str]]
    orders: list[list[str]] = field(default_factory=list)


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


def run_plan(plan: Plan, runtime: Runtime, *, progress=lambda message: None, clock=time.monotonic) -> PlanResult:
    """The plan's `repeats` rounds then its quality; with a `sequential:` section, run_until_settled."""
    if plan.spec.sequential is not None:
        return run_until_settled(plan, runtime, progress=progress, clock=clock)
    configs = [plan.baseline, *plan.candidates]
    names = [config.name for config, _ in configs]
    rounds = Rounds({name: [] for name in names})
    with ExitStack() as kept:
        workers = {} if plan.spec.fresh_workers else start_workers(kept, configs, runtime, plan.workload, progress)
        for repeat in range(plan.spec.repeats):
            run_round(plan, runtime, rounds, workers, f"{repeat + 1}/{plan.spec.repeats}", progress)
    run_ids = rounds.run_ids
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
    candidates = [load_run_set(runtime, run_ids[c.name]) for c, _ in plan.candidates]
    verdicts = tuple(compare(baseline, c, plan.spec.limits) for c in candidates)
    ranking = ranked(plan, candidates, verdicts)
    return PlanResult(save(plan, runtime, rounds, verdicts, ranking), baseline, verdicts, ranking=ranking)


def ranked(plan: Plan, candidates: list[RunSet], verdicts: tuple[Verdict, ...], level: float | None = None,
           ) -> Ranking | None:
    """A plan with several candidates: those accepted, ranked by the plan's rank_by (its first gain's figure)."""
    if len(plan.candidates) < 2:
        return None
    return rank(candidates, verdicts, plan.spec.limits, rank_by=plan.spec.rank_by,
                **({"level": level} if level is not None else {}))


def run_round(plan: Plan, runtime: Runtime, rounds: Rounds, workers: dict[str, WorkerProcess], label: str,
              progress, *, left_out: frozenset[str] = frozenset()) -> None:
    """One more round: every config once (but those left out: candidates rejected earlier), in the round's order,
    each on a fresh worker unless `workers` are kept."""
    every = [config.name for config, _ in (plan.baseline, *plan.candidates)]
    configs = [c for c in (plan.baseline, *plan.candidates) if c[0].name not in left_out]
    by_name = {config.name: config for config, _ in configs}
    repeat = len(rounds.orders)
    # NOTE: the order is drawn over every config, then those left out are taken from it: a block of two rounds keeps
    # its reversal when a candidate drops out between them
    rounds.orders.append([n for n in round_order(every, repeat, seed=plan.spec.seed) if n not in left_out])
    with ExitStack() as fresh:
        if plan.spec.fresh_workers:
            workers = start_workers(fresh, configs, runtime, plan.workload, progress)
        for name in rounds.orders[-1]:
            progress(f"round {label}: [{name}]")
            outcome = run_workload(workload=plan.workload, config=by_name[name], worker=workers[name],
                                   plan_name=plan.spec.name, repeat_index=repeat, progress=progress)
            rounds.run_ids[name].append(outcome.run_id)


def save(plan: Plan, runtime: Runtime, rounds: Rounds, verdicts: tuple[Verdict, ...], ranking: Ranking | None,
         **report: Any) -> str:
    names = [config.name for config, _ in (plan.baseline, *plan.candidates)]
    if ranking is not None:
        report["ranking"] = ranking.as_dict()
    with session_scope(runtime.sessions) as session:
        return store.save_comparison(
            session, plan_name=plan.spec.name, plan=plan.spec.model_dump(mode="json"),
            baseline_run_ids=rounds.run_ids[names[0]],
            candidate_run_ids=[i for name in names[1:] for i in rounds.run_ids[name]],
            report={"verdicts": [v.as_dict() for v in verdicts], "rounds": rounds.orders, **report},
        )


def run_until_settled(plan: Plan, runtime: Runtime, *, progress=lambda message: None,
                      clock=time.monotonic) -> PlanResult:
    """min_rounds rounds and a first step of passages, then a look; after each look the round and the step of
    passages the unsure criteria need (servelab/analysis/sequential.py), until it says stop. A candidate rejected at
    a look is left out of the rounds and passages after it (its verdict kept as that look read it).

    NOTE: the passages are scored between rounds, on every core, with no worker serving (fresh workers stop after
    their round; kept ones wait idle); the long-context segments, a fixed set, are scored once, at the first step.
    """
    spec, q, limits = plan.spec.sequential, plan.spec.quality, plan.spec.limits
    assert spec is not None, "a plan run until settled has a sequential budget"
    configs = [plan.baseline, *plan.candidates]
    names = [config.name for config, _ in configs]
    rounds, steps, scored = Rounds({name: [] for name in names}), passage_steps(q, spec), {n: Scored() for n in names}
    levels = spec.levels(exact_passages=q.lambada_samples)
    record, start = SequentialRecord(spec, levels), clock()
    with ExitStack() as kept:
        workers = {} if plan.spec.fresh_workers else start_workers(kept, configs, runtime, plan.workload, progress)
        num_rounds, take_passages = spec.min_rounds, True
        while not record.stop:
            left_out = frozenset(record.rejected)
            for _ in range(num_rounds):
                run_round(plan, runtime, rounds, workers, f"{len(rounds.orders) + 1} (of at most {spec.max_rounds})",
                          progress, left_out=left_out)
            if take_passages:
                first = not record.looks
                for config, _ in configs:
                    if config.name not in left_out:
                        score_step(config, runtime, q, steps[0] if steps else [], scored[config.name],
                                   long_context=first, progress=progress)
                steps = steps[1:]
            look = Look(len(record.looks) + 1, len(rounds.orders), scored[names[0]].num_passages,
                        (clock() - start) / 60)
            step = record.add(look, judge_so_far(plan, runtime, rounds, scored, levels, left_out=left_out), limits,
                              has_passages=bool(q.lambada_samples))
            num_rounds, take_passages = int(step.take_round), step.take_passages
            dropped = sorted(record.rejected - left_out) if not record.stop else []
            progress(f"look {look.index}: " + "; ".join(f"{v.candidate} {v.decision}" for v in record.verdicts.values())
                     + (f"; {', '.join(dropped)} measured no more (rejected)" if dropped else "")
                     + (f"; {record.stop}" if record.stop else ""))
    with session_scope(runtime.sessions) as session:
        for name in names:
            for run_id in rounds.run_ids[name]:
                store.set_run_quality(session, run_id=run_id, quality=scored[name].record() or None)
    verdicts = tuple(record.verdicts[c.name] for c, _ in plan.candidates)
    ranking = ranked(plan, [load_run_set(runtime, rounds.run_ids[c.name]) for c, _ in plan.candidates], verdicts,
                     levels.runs)
    comparison_id = save(plan, runtime, rounds, verdicts, ranking, sequential=record.as_dict())
    return PlanResult(comparison_id, load_run_set(runtime, rounds.run_ids[names[0]]), verdicts, record, ranking)


@dataclass
class Scored:
    """One config's quality scored so far in a sequential comparison (stored on its runs at the end)."""

    lambada: QualityResult | None = None
    long_context: dict[str, Any] | None = None

    @property
    def num_passages(self) -> int:
        return self.lambada.num_passages if self.lambada else 0

    def record(self) -> dict[str, Any]:
        record = quality_record(self.lambada) if self.lambada else {}
        return {**record, "long_context": self.long_context} if self.long_context else record


def judge_so_far(plan: Plan, runtime: Runtime, rounds: Rounds, scored: dict[str, Scored], levels, *,
                 left_out: frozenset[str] = frozenset()) -> list[Verdict]:
    """Every candidate still measured, against the baseline, on all the data so far."""
    def run_set(name: str) -> RunSet:
        loaded = load_run_set(runtime, rounds.run_ids[name])
        return replace(loaded, quality=runsets.quality_outcome(scored[name].record()),
                       long_context=scored[name].long_context)

    baseline = run_set(plan.baseline[0].name)
    return [compare(baseline, run_set(c.name), plan.spec.limits, levels=levels) for c, _ in plan.candidates
            if c.name not in left_out]


def passage_steps(quality: QualitySpec, spec: SequentialSpec) -> list[list[LambadaPassage]]:
    """The LAMBADA passages a sequential comparison scores, step by step: a seeded sample of its budget in a
    seeded order, so each step adds passages drawn at random from LAMBADA; none when quality.lambada_samples is 0."""
    if not quality.lambada_samples:
        return []
    from servelab.lab.quality import lambada_passages

    chosen = lambada_passages(spec.max_passages, seed=quality.seed)
    chosen = random.Random(f"{quality.seed}:steps").sample(chosen, len(chosen))
    return [chosen[i:i + spec.passage_step] for i in range(0, len(chosen), spec.passage_step)]


def score_step(config: ServingConfig, runtime: Runtime, spec: QualitySpec, passages: list[LambadaPassage],
               scored: Scored, *, long_context: bool, progress) -> None:
    """Score one step of passages (and, at the first step, the long-context segments) and add them to `scored`."""
    from servelab.lab.quality import QualityResult

    segments = spec.long_context_segments if long_context else 0
    if not passages and not segments:
        return
    progress(f"[{config.name}] LAMBADA on {len(passages)} more passages"
             + (f", long-context perplexity on {segments} segments" if segments else ""))
    result, measured = score_quality(config, runtime, spec.model_copy(update={"long_context_segments": segments}),
                                     passages)
    if result is not None:
        earlier = scored.lambada.passages if scored.lambada else ()
        scored.lambada = QualityResult(result.config, earlier + result.passages)
    scored.long_context = measured or scored.long_context


def measure_quality(config: ServingConfig, runtime: Runtime, spec: QualitySpec) -> dict[str, Any]:
    """LAMBADA on the plan's sample (and, when asked, long-context perplexity), as a run's quality record."""
    from servelab.lab.quality import lambada_passages

    passages = lambada_passages(spec.lambada_samples, seed=spec.seed) if spec.lambada_samples else []
    return Scored(*score_quality(config, runtime, spec, passages)).record()


def score_quality(config: ServingConfig, runtime: Runtime, spec: QualitySpec, passages: list[LambadaPassage],
                  ) -> tuple[QualityResult | None, dict[str, Any] | None]:
    """LAMBADA on these passages (and, when spec asks, long-context perplexity) through the serving engine with this
    config's weights, cache, attention window and batching."""
    from servelab.lab.quality import evaluate_lambada, scoring_engine

    engine = scoring_engine(config, runtime.settings)
    result = evaluate_lambada(engine, passages, batch_size=config.batching.max_batch_size) if passages else None
    if not spec.long_context_segments:
        return result, None
    from servelab.lab.long_context import evaluate_long_context, long_segments

    segments = long_segments(engine.tokenizer, length=spec.long_context_tokens, num_segments=spec.long_context_segments)
    measured = evaluate_long_context(engine, segments, scored_from=spec.long_context_scored_from)
    return result, {**measured.as_dict(), "length": spec.long_context_tokens,
                    "scored_from": spec.long_context_scored_from}


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
