"""The lab's commands: a run, a comparison plan, LAMBADA quality and the batch-size sweep.

Knows these commands' options and how their results are printed. Does not know how a run, a verdict,
a quality score or a sweep is made: servelab/lab does. The engine and torch are imported inside the commands.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from servelab.cli.options import (ConfigOption, ThreadsOption, config_paths, connected, fail, load_config, load_engines,
                                  parse_ints, progress, settings)


def run(
    config: ConfigOption,
    workload: Annotated[Path, typer.Option("--workload", "-w", help="workload YAML, e.g. workloads/smoke.yaml")],
    as_json: Annotated[bool, typer.Option("--json", help="print the run's id and summary as JSON")] = False,
) -> None:
    """Serve a workload with one config through a real worker and the queue; store and print the run."""
    from servelab.lab.runner import RunError, run_workload, start_worker, warm_up

    serving, loaded = _config_and_workload(config, workload)
    with connected() as runtime:
        try:
            with start_worker(serving, config, runtime) as started:
                warm_up(started, serving, loaded)
                outcome = run_workload(workload=loaded, config=serving, worker=started, progress=progress)
        except RunError as exc:
            fail(str(exc))
    if as_json:
        typer.echo(json.dumps({"run_id": str(outcome.run_id), "config": serving.name, "workload": loaded.name,
                               "workload_fingerprint": loaded.fingerprint, "kernel": outcome.kernel,
                               "summary": outcome.summary.as_dict()}, indent=2, default=str))
        return
    typer.echo(f"run {outcome.run_id}: {serving.name} on {loaded.name} ({loaded.fingerprint}), "
               f"kernel {outcome.kernel}")
    typer.echo(_format_summary(outcome.summary))


def _config_and_workload(config: Path, workload: Path):
    """The serving config and the workload, or one line naming what is wrong with either (exit 2)."""
    serving = load_config(config)

    from servelab.analysis.workload import WorkloadError, load_workload

    try:
        return serving, load_workload(workload)
    except WorkloadError as exc:
        fail(str(exc))


def _format_summary(summary) -> str:
    from servelab.analysis.report import NO_PRICE, is_priced

    lines = [f"requests {summary.num_succeeded}/{summary.num_requests} in {summary.duration_s:.1f} s: "
             f"{summary.output_tokens_per_s:.1f} output tok/s, {summary.requests_per_s:.2f} req/s, "
             f"mean batch {summary.mean_batch_size:.1f} {summary.batch_size_counts}"]
    for name, lat in summary.latency.items():
        lines.append(f"  {name:<9} p50 {lat.p50:9.1f}  p95 {lat.p95:9.1f}  p99 {lat.p99:9.1f}")
    if summary.goodput_fraction is not None:
        lines.append(f"  goodput {summary.goodput_fraction:.0%} of requests met the SLOs "
                     f"({summary.goodput_requests_per_s:.2f} req/s)")
    lines.append(f"  memory: weights {summary.weight_bytes / 1e6:.1f} MB, KV cache peak "
                 f"{summary.kv_cache_peak_bytes / 1e6:.2f} MB, working peak {summary.working_peak_bytes / 1e6:.1f} MB")
    lines.append(f"  {prefix_cache_text(summary)}")
    lines.append(f"  {capacity_text(summary)}")
    lines.append(f"  cost: {summary.cost_per_request:.6f} per request, {summary.cost_per_1k_output_tokens:.6f} "
                 "per 1k output tokens (SERVELAB_PRICE_PER_HOUR)" if is_priced(summary.cost_per_request)
                 else f"  cost: {NO_PRICE}")
    return "\n".join(lines)


def prefix_cache_text(summary) -> str:
    """The prefix cache's figures of a run: its hit rate (n/a where nothing was looked up), its blocks."""
    rate = summary.prefix_cache_hit_rate
    hits = ("prefix cache: n/a (no prompt token was looked up)" if rate is None else
            f"prefix cache: {rate:.1%} hit ({summary.prefix_cache_hit_tokens} of {summary.prefix_cache_query_tokens} "
            "prompt tokens looked up)")
    if not summary.kv_block_size:
        return f"{hits}; KV cache not paged"
    return (f"{hits}; at the KV peak {summary.kv_blocks_shared} shared + {summary.kv_blocks_private} private "
            f"blocks of {summary.kv_block_size} tokens")


def capacity_text(summary) -> str:
    """The cache's capacity at work in a run: the paged pool and its peak use, the most rows of a pass, preemptions."""
    if not summary.kv_pool_blocks:
        pool = "KV pool: not paged"
    elif summary.kv_pool_peak_use is None:
        pool = f"KV pool: {summary.kv_pool_blocks} blocks"
    else:
        pool = (f"KV pool: {summary.kv_pool_blocks} blocks of {summary.kv_block_size} tokens, "
                f"{summary.kv_pool_peak_use:.0%} held at the KV peak")
    return f"{pool}; at most {summary.peak_rows} rows a pass; {summary.num_preempted} rows preempted"


# NOTE: 2 stays every command's "bad input or failed step" (options.fail), so a CI job can tell the three apart.
EXIT_CODES = {"accept": 0, "reject": 1, "inconclusive": 3}


def compare(
    plan: Annotated[Path, typer.Argument(help="comparison plan YAML, e.g. plans/precision.yaml")],
    as_json: Annotated[bool, typer.Option("--json", help="print the stored report as JSON instead of the table")] = False,
    until_settled: Annotated[bool, typer.Option("--until-settled", help=(
        "add rounds and LAMBADA passages in steps until every candidate is accepted or rejected or the budget is "
        "spent (the plan's sequential: section, else its defaults), with intervals valid under the repeated looks"))]
    = False,
    max_rounds: Annotated[int | None, typer.Option(help="the round budget (with --until-settled)")] = None,
    max_passages: Annotated[int | None, typer.Option(help="the LAMBADA passage budget (with --until-settled)")] = None,
    max_minutes: Annotated[float | None, typer.Option(help="the time budget (with --until-settled)")] = None,
) -> None:
    """Run a plan's baseline and candidates, judge each candidate, print and store the verdicts.

    Exit status: 0 accepted, 1 rejected, 3 inconclusive, 2 an error. With several candidates the plan picks one:
    0 when one meets every limit (the ranking names the best), 3 when none does yet but one may, 1 when all failed.
    """
    from servelab.analysis.plan import PlanError, load_plan
    from servelab.analysis.plan import until_settled as run_until_settled
    from servelab.analysis.report import decision_of, format_ranking, format_sequential, format_verdicts
    from servelab.lab.compare import run_plan
    from servelab.lab.runner import RunError

    budget = {"max_rounds": max_rounds, "max_passages": max_passages, "max_minutes": max_minutes}
    try:
        loaded = load_plan(plan)
        if until_settled or loaded.spec.sequential is not None:
            loaded = run_until_settled(loaded, **budget)
        elif any(v is not None for v in budget.values()):
            fail("--max-rounds, --max-passages and --max-minutes are a budget for --until-settled: add it (or a "
                 "sequential: section to the plan)")
    except PlanError as exc:
        fail(str(exc))
    # NOTE: what libraries print while loading models (gptqmodel's banner) goes to stderr: stdout is the verdict
    with connected() as runtime, contextlib.redirect_stdout(sys.stderr):
        try:
            result = run_plan(loaded, runtime, progress=progress)
        except RunError as exc:
            fail(str(exc))
        except Exception as exc:  # NOTE: any failure must exit 2, never 1 (reject) through a traceback
            logging.getLogger(__name__).info("the comparison failed", exc_info=True)
            fail(f"the comparison failed: {type(exc).__name__}: {exc} (run with -v for the traceback)")
    decision = decision_of(result.verdicts)
    if as_json:
        from servelab.store.runs import json_safe

        extra = {**({"sequential": result.sequential.as_dict()} if result.sequential else {}),
                 **({"ranking": result.ranking.as_dict()} if result.ranking else {})}
        typer.echo(json.dumps(json_safe({"comparison_id": result.comparison_id, "plan": loaded.spec.name,
                                         "decision": decision, "verdicts": [v.as_dict() for v in result.verdicts],
                                         **extra}), indent=2, default=str))
    else:
        typer.echo(f"comparison {result.comparison_id} ({loaded.spec.name}, workload {loaded.workload.name})")
        if result.sequential:
            typer.echo(format_sequential(result.sequential))
        typer.echo(format_verdicts(result.verdicts))
        if result.ranking:
            typer.echo(format_ranking(result.ranking))
    raise typer.Exit(EXIT_CODES[decision])


def calibrate(
    config: ConfigOption,
    workload: Annotated[Path, typer.Option("--workload", "-w", help="workload YAML with a burst, e.g. "
                                                                    "workloads/smoke.yaml")],
    comparisons: Annotated[int, typer.Option(min=1, max=500, help="A/A and A/A' comparisons")] = 20,
    known: Annotated[int, typer.Option(min=0, max=100, help="comparisons of max_batch_size 16 against 1")] = 5,
    repeats: Annotated[int, typer.Option(min=2, max=50, help="rounds per comparison")] = 5,
    known_repeats: Annotated[int | None, typer.Option(min=2, max=50, help="rounds per known-difference "
                                                                          "comparison (default: --repeats)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the counts as JSON")] = False,
    until_settled: Annotated[bool, typer.Option("--until-settled", help=(
        "run each comparison until settled (a look after every round, 5 % spent over the looks) instead of "
        "--repeats rounds, and count the rounds used"))] = False,
    max_rounds: Annotated[int | None, typer.Option(help="the round budget (with --until-settled; default 12)")] = None,
) -> None:
    """Measure the verdict's error rates: A/A and A/A' comparisons (nothing changed) and a known difference."""
    from pydantic import ValidationError

    from servelab.analysis.sequential import SequentialSpec
    from servelab.config import describe_validation_error
    from servelab.lab.calibrate import calibrate as run_calibration
    from servelab.lab.calibrate import format_calibration
    from servelab.lab.runner import RunError

    if max_rounds is not None and not until_settled:
        fail("--max-rounds is the budget of --until-settled: add it")
    try:
        sequential = SequentialSpec(**({"max_rounds": max_rounds} if max_rounds else {})) if until_settled else None
    except ValidationError as exc:
        fail(f"--max-rounds: {describe_validation_error(exc)}")
    serving, loaded = _config_and_workload(config, workload)
    with connected() as runtime, contextlib.redirect_stdout(sys.stderr):
        try:
            result = run_calibration(serving, config, loaded, runtime, num_comparisons=comparisons, num_known=known,
                                     repeats=repeats, known_repeats=known_repeats, sequential=sequential,
                                     progress=progress)
        except RunError as exc:
            fail(str(exc))
    typer.echo(json.dumps(result.as_dict(), indent=2) if as_json else format_calibration(result))


def quality(
    configs: Annotated[str, typer.Option(help="comma-separated serving configs; the first is the baseline")],
    samples: Annotated[int, typer.Option(help="LAMBADA passages, the same for every config")] = 100,
    seed: int = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print each config's figures (and the paired drop and "
                                                         "ratio against the first) as JSON")] = False,
) -> None:
    """LAMBADA last-word accuracy and perplexity of each config through the serving engine, paired."""
    serving = [load_config(path) for path in config_paths(configs)]

    from servelab.engine.loader import ModelLoadError
    from servelab.lab.quality import (accuracy_drop, evaluate_lambada, lambada_passages, perplexity_ratio,
                                      scoring_engine)

    passages = lambada_passages(samples, seed=seed)
    results = []
    for config in serving:
        try:
            engine = scoring_engine(config, settings())
        except ModelLoadError as exc:
            fail(str(exc))
        results.append(evaluate_lambada(engine, passages, batch_size=config.batching.max_batch_size))
        del engine
    if as_json:
        records = [{**r.as_dict(), **({} if r is results[0] else {
            "accuracy_drop": accuracy_drop(results[0], r).as_dict(),
            "perplexity_ratio": perplexity_ratio(results[0], r).as_dict()})} for r in results]
        typer.echo(json.dumps({"samples": samples, "seed": seed, "baseline": serving[0].name, "configs": records},
                              indent=2))
        return
    typer.echo(f"LAMBADA, {samples} passages (seed {seed}); intervals are 95 %; drop and ratio are paired "
               f"against {serving[0].name}")
    for config, result in zip(serving, results):
        acc, ppl = result.accuracy, result.perplexity
        line = (f"{config.name:<12} accuracy {acc.value:.3f} [{acc.low:.3f}, {acc.high:.3f}]  "
                f"perplexity {ppl.value:.2f} [{ppl.low:.2f}, {ppl.high:.2f}]")
        if result is not results[0]:
            drop, ratio = accuracy_drop(results[0], result), perplexity_ratio(results[0], result)
            line += (f"  drop {drop.value:+.3f} [{drop.low:+.3f}, {drop.high:+.3f}]  "
                     f"ppl x{ratio.value:.3f} [{ratio.low:.3f}, {ratio.high:.3f}]")
        typer.echo(line)


def sweep(
    configs: Annotated[str, typer.Option(help="comma-separated serving config files; the first is the baseline")]
    = "configs/fp32.yaml,configs/bf16.yaml",
    batch_sizes: Annotated[str, typer.Option(help="comma-separated batch sizes")] = "1,2,4,8,16,32",
    prompt_tokens: int = 64,
    new_tokens: int = 32,
    rounds: Annotated[int, typer.Option(help="interleaved rounds; medians are printed")] = 2,
    threads: ThreadsOption = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    store: Annotated[bool, typer.Option(help="store the sweep in PostgreSQL for the dashboard")] = True,
) -> None:
    """Decode speed against batch size per config, beside the bandwidth and compute rooflines."""
    serving = [load_config(path) for path in config_paths(configs)]

    from servelab.lab.sweep import format_sweep_table, sweep_report

    sizes = parse_ints(batch_sizes, "--batch-sizes")
    if not serving:
        fail(f"--configs names no config file, got {configs!r}")
    if len({c.name for c in serving}) != len(serving):
        fail(f"--configs: config names must differ, got {[c.name for c in serving]}")
    if new_tokens < 2 or prompt_tokens < 1 or rounds < 1:
        fail("--new-tokens must be at least 2, --prompt-tokens and --rounds at least 1")
    engines = load_engines(serving, threads)
    report = sweep_report(engines, batch_sizes=sizes, num_prompt_tokens=prompt_tokens, num_new_tokens=new_tokens,
                          num_rounds=rounds, progress=progress)
    typer.echo(json.dumps(report.as_dict(), indent=2) if as_json else format_sweep_table(report))
    if store:
        typer.echo(f"stored as sweep {_store_sweep(report)} (the dashboard's Sweep page)", err=True)


def _store_sweep(report) -> str:
    from servelab.hardware import describe_hardware
    from servelab.store.db import session_scope
    from servelab.store.runs import save_sweep

    with connected() as runtime, session_scope(runtime.sessions) as session:
        return save_sweep(session, report=report.as_dict(), hardware=describe_hardware().as_dict())
