"""The `servelab` command: the process entry point that reads Settings once and wires the core.

Knows argument parsing and printing. Every bad input (a config file, a flag) ends in one clear
line on stderr and exit code 2, never a traceback. Heavy modules are imported inside commands.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from servelab.config import ConfigError, ServingConfig
from servelab.settings import Settings

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__.split("\n")[0])
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print ratios measured side by side.")
app.add_typer(bench_app, name="bench")

ConfigOption = Annotated[Path, typer.Option("--config", "-c", help="serving config YAML, e.g. configs/fp32.yaml")]


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code=2)


def _load_config(path: Path) -> ServingConfig:
    try:
        return ServingConfig.from_yaml(path)
    except ConfigError as exc:
        _fail(str(exc))


def _parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        _fail(f"{what} must be comma-separated whole numbers, got {text!r}")
    if not values or any(v < 1 for v in values):
        _fail(f"{what} must be positive whole numbers, got {text!r}")
    return values


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@app.command()
def generate(
    prompts: Annotated[list[str], typer.Argument(help="one or more prompts, served as one batch")],
    config: ConfigOption = Path("configs/fp32.yaml"),
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate per prompt")] = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop string; repeat for more")] = None,
    chat: Annotated[bool, typer.Option(help="wrap each prompt as a user message in the chat template")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON record")] = False,
) -> None:
    """Run the engine in-process (no queue) and print each completion with its timings."""
    from servelab.engine.engine import Engine
    from servelab.engine.loader import ModelLoadError
    from servelab.request import ChatMessage, GenerationRequest, SamplingParams

    serving = _load_config(config)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=tuple(stop or ()))
    requests = [
        GenerationRequest(f"p{i}", messages=(ChatMessage("user", p),), params=params) if chat
        else GenerationRequest(f"p{i}", prompt=p, params=params)
        for i, p in enumerate(prompts)
    ]
    try:
        engine = Engine.from_config(serving, Settings())
    except ModelLoadError as exc:
        _fail(str(exc))
    result = engine.generate(requests)
    if as_json:
        typer.echo(json.dumps(_result_record(serving, engine, result), indent=2))
    else:
        _print_result(prompts, result)
    if any(c.error for c in result.completions):
        raise typer.Exit(code=1)


def _result_record(serving: ServingConfig, engine, result) -> dict:
    return {
        "config": serving.model_dump(mode="json"),
        "config_hash": serving.config_hash,
        "device": str(engine.device),
        "kernel": engine.kernel,
        "completions": [
            {**{k: v for k, v in c.__dict__.items() if k not in ("token_ids", "token_times_ms")},
             "finish_reason": c.finish_reason.value, "num_generated_tokens": c.num_generated_tokens,
             "tpot_ms": c.tpot_ms, "token_ids": list(c.token_ids), "token_times_ms": list(c.token_times_ms)}
            for c in result.completions
        ],
        "timings": {**result.timings.__dict__, "total_ms": result.timings.total_ms},
        "memory": result.memory.as_dict(),
    }


def _print_result(prompts: list[str], result) -> None:
    for prompt, c in zip(prompts, result.completions):
        typer.secho(f"> {prompt}", bold=True)
        if c.error:
            typer.secho(f"  error: {c.error}", fg=typer.colors.RED)
            continue
        typer.echo(f"  {c.text!r}")
        tpot = f"{c.tpot_ms:.1f}" if c.tpot_ms is not None else "-"
        typer.echo(f"  [{c.finish_reason.value}] prompt {c.num_prompt_tokens} tok, generated {c.num_generated_tokens} tok, "
                   f"TTFT {c.ttft_ms:.1f} ms, TPOT {tpot} ms, E2E {c.e2e_ms:.1f} ms")
    t, m = result.timings, result.memory
    typer.echo(f"batch: prefill {t.prefill_ms:.1f} ms, decode {t.decode_ms:.1f} ms over {len(t.num_rows_per_step)} steps; "
               f"weights {m.weight_bytes / 1e6:.1f} MB, KV cache {m.kv_cache_bytes / 1e6:.2f} MB "
               f"(allocated {m.kv_cache_allocated_bytes / 1e6:.2f} MB), peak working {m.peak_working_bytes / 1e6:.1f} MB")


@app.command()
def worker(
    config: ConfigOption,
    name: Annotated[str | None, typer.Option(help="consumer name; reuse it after a crash to take back its entries")] = None,
) -> None:
    """Serve one config from its Redis streams until stopped (the gpu-worker service)."""
    from servelab.engine.loader import ModelLoadError
    from servelab.runtime import connect
    from servelab.serving import run_worker

    serving = _load_config(config)
    settings = Settings(worker_name=name) if name else Settings()
    runtime = connect(settings)
    try:
        run_worker(serving, runtime)
    except ModelLoadError as exc:
        _fail(str(exc))
    finally:
        runtime.close()


@app.command()
def quantize(config: ConfigOption) -> None:
    """Quantise the config's base model to int4 (AWQ, or RTN with awq.method: rtn) once; later calls reuse it."""
    from servelab.engine.awq import quantize as quantize_model
    from servelab.engine.loader import ModelLoadError

    serving = _load_config(config)
    if serving.weights != "awq-int4":
        _fail(f"{config}: weights is {serving.weights!r}; quantize needs weights: awq-int4")
    try:
        record = quantize_model(serving, Settings(), progress=lambda m: typer.echo(m, err=True))
    except (ModelLoadError, ValueError) as exc:
        _fail(str(exc))
    verb = "reused" if record.is_reused else f"made in {record.quantize_s:.0f} s"
    calibration = (f"{record.num_calibration_samples} x {record.calibration_seq_len} tokens of "
                   f"{record.calibration_set}" if record.calibration_set else "no calibration (round to nearest)")
    typer.echo(f"{record.method} int{record.bits} g{record.group_size} checkpoint {verb}: {record.checkpoint} "
               f"({calibration})")


@app.command()
def quality(
    configs: Annotated[str, typer.Option(help="comma-separated serving configs; the first is the baseline")],
    samples: Annotated[int, typer.Option(help="LAMBADA passages, the same for every config")] = 100,
    seed: int = 0,
) -> None:
    """LAMBADA last-word accuracy and perplexity of each config through the serving engine, paired."""
    from servelab.engine.engine import Engine
    from servelab.engine.loader import ModelLoadError
    from servelab.lab.quality import accuracy_drop, evaluate_lambada, lambada_passages, perplexity_ratio

    serving = [_load_config(Path(p.strip())) for p in configs.split(",") if p.strip()]
    passages = lambada_passages(samples, seed=seed)
    results = []
    for config in serving:
        try:
            engine = Engine.from_config(config, Settings())
        except ModelLoadError as exc:
            _fail(str(exc))
        results.append(evaluate_lambada(engine, passages, batch_size=config.batching.max_batch_size))
        del engine
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


@app.command()
def migrate() -> None:
    """Create the database if needed and upgrade it to the newest schema (the compose `migrate` service)."""
    from servelab.runtime import connect

    connect(Settings(), migrate=True).close()
    typer.echo("database at the newest schema")


@app.command()
def up(
    configs: Annotated[str, typer.Option(help="comma-separated serving configs, one gpu-worker each")]
    = "configs/smollm2.yaml",
    port: Annotated[int, typer.Option(help="the API's port on 127.0.0.1")] = 8000,
) -> None:
    """Start the local stack in the background: Redis and PostgreSQL (embedded unless URLs are set), the
    schema, the api, the jobs-worker, beat and a gpu-worker per config. `servelab down` stops it."""
    from servelab.runtime import connect
    from servelab.stack import StackError, start_stack

    paths = [Path(p.strip()) for p in configs.split(",") if p.strip()]
    for path in paths:
        _load_config(path)
    settings = Settings()
    runtime = connect(settings)
    runtime.close()
    env = {"SERVELAB_REDIS_URL": runtime.urls.redis_url, "SERVELAB_DATABASE_URL": runtime.urls.database_url,
           "SERVELAB_KEY_PREFIX": settings.key_prefix, "SERVELAB_CACHE_DIR": str(Path(settings.cache_dir).resolve()),
           "SERVELAB_STATE_DIR": str(Path(settings.state_dir).resolve())}
    try:
        processes = start_stack(settings, env=env, config_paths=paths, api_port=port)
    except StackError as exc:
        _fail(str(exc))
    for p in processes:
        typer.echo(f"{p.name:<24} pid {p.pid:<8} log {p.log}")
    typer.echo(f"API: http://127.0.0.1:{port}/v1 (OpenAI-compatible; model = a config name)")


@app.command()
def down() -> None:
    """Stop the local stack (`servelab up`) and the embedded Redis and PostgreSQL of this state folder."""
    from servelab.embedded import stop_embedded
    from servelab.stack import stop_stack

    settings = Settings()
    for process in stop_stack(settings):
        typer.echo(f"stopped {process.name} (pid {process.pid})")
    for server in stop_embedded(settings):
        typer.echo(f"stopped embedded {server.kind} (pid {server.pid})")


@app.command()
def run(
    config: ConfigOption,
    workload: Annotated[Path, typer.Option("--workload", "-w", help="workload YAML, e.g. workloads/smoke.yaml")],
) -> None:
    """Serve a workload with one config through a real worker and the queue; store and print the run."""
    from servelab.lab.runner import RunError, run_workload, start_worker, warm_up
    from servelab.lab.workload import WorkloadError, load_workload
    from servelab.runtime import connect

    serving = _load_config(config)
    try:
        loaded = load_workload(workload)
    except WorkloadError as exc:
        _fail(str(exc))
    runtime = connect(Settings())
    try:
        with start_worker(serving, config, runtime) as started:
            warm_up(started, serving, loaded)
            outcome = run_workload(workload=loaded, config=serving, worker=started,
                                   progress=lambda m: typer.echo(m, err=True))
    except RunError as exc:
        _fail(str(exc))
    finally:
        runtime.close()
    typer.echo(f"run {outcome.run_id}: {serving.name} on {loaded.name} ({loaded.fingerprint}), "
               f"kernel {outcome.kernel}")
    typer.echo(_format_summary(outcome.summary))


def _format_summary(summary) -> str:
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
    lines.append(f"  cost: {summary.cost_per_request:.6f} per request, {summary.cost_per_1k_output_tokens:.6f} "
                 "per 1k output tokens (SERVELAB_PRICE_PER_HOUR)")
    return "\n".join(lines)


@app.command(name="compare")
def compare_plan(
    plan: Annotated[Path, typer.Argument(help="comparison plan YAML, e.g. plans/precision.yaml")],
) -> None:
    """Run a plan's baseline and candidates, judge each candidate, print and store the verdicts."""
    from servelab.lab.compare import PlanError, format_verdicts, load_plan, run_plan
    from servelab.lab.runner import RunError
    from servelab.runtime import connect

    try:
        loaded = load_plan(plan)
    except PlanError as exc:
        _fail(str(exc))
    runtime = connect(Settings())
    try:
        result = run_plan(loaded, runtime, progress=lambda m: typer.echo(m, err=True))
    except RunError as exc:
        _fail(str(exc))
    finally:
        runtime.close()
    typer.echo(f"comparison {result.comparison_id} ({loaded.spec.name}, workload {loaded.workload.name})")
    typer.echo(format_verdicts(result.verdicts))


@bench_app.command("engine")
def bench_engine(
    configs: Annotated[str, typer.Option(help="comma-separated serving config files")] = "configs/fp32.yaml",
    batch_sizes: Annotated[str, typer.Option(help="comma-separated batch sizes")] = "1,4,16,32",
    prompt_tokens: int = 64,
    new_tokens: int = 32,
    rounds: Annotated[int, typer.Option(help="interleaved rounds; medians are printed")] = 3,
    threads: Annotated[int | None, typer.Option(help="torch threads (default: the config's, else torch's)")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """This engine vs transformers' generate, tokens/s and ratio per batch size, beside the roofline."""
    import torch

    from servelab.engine.engine import Engine
    from servelab.engine.loader import ModelLoadError
    from servelab.lab.bench import bench_engines, format_engine_table
    from servelab.hardware import measure_bandwidth_gbs

    serving = [_load_config(Path(p.strip())) for p in configs.split(",") if p.strip()]
    sizes = _parse_ints(batch_sizes, "--batch-sizes")
    settings = Settings(num_threads=threads) if threads else Settings()
    try:
        engines = [Engine.from_config(c.model_copy(update={"num_threads": threads or c.num_threads}), settings)
                   for c in serving]
    except ModelLoadError as exc:
        _fail(str(exc))
    bandwidth = measure_bandwidth_gbs(engines[0].device)
    rows = bench_engines(engines, batch_sizes=sizes, num_prompt_tokens=prompt_tokens, num_new_tokens=new_tokens,
                         num_rounds=rounds, bandwidth_gbs=bandwidth,
                         progress=lambda m: typer.echo(m, err=True))
    if as_json:
        typer.echo(json.dumps({"bandwidth_gbs": bandwidth, "threads": torch.get_num_threads(),
                               "rows": [r.as_dict() for r in rows]}, indent=2))
    else:
        typer.echo(format_engine_table(rows, bandwidth_gbs=bandwidth,
                                       kernels={e.config.name: e.kernel for e in engines}))


@bench_app.command("steps")
def bench_steps_command(
    config: ConfigOption = Path("configs/fp32.yaml"),
    batch_sizes: Annotated[str, typer.Option(help="comma-separated batch sizes")] = "1,16,64",
    prompt_tokens: int = 64,
    new_tokens: int = 32,
    rounds: Annotated[int, typer.Option(help="interleaved rounds; medians are printed")] = 3,
    threads: Annotated[int, typer.Option(help="torch threads for every step")] = 1,
) -> None:
    """Each step of the engine's speed work on one config, side by side: tokens/s, gain, roofline."""
    from servelab.engine.engine import Engine
    from servelab.engine.linear import LinearKernelError
    from servelab.engine.loader import ModelLoadError
    from servelab.lab.bench import STEPS, bench_steps, format_steps_table
    from servelab.hardware import measure_bandwidth_gbs

    serving = _load_config(config)
    sizes = _parse_ints(batch_sizes, "--batch-sizes")
    settings = Settings(num_threads=threads)
    engines, skipped = {}, []
    for step, overrides in STEPS:
        try:
            engines[step] = Engine.from_config(serving.model_copy(update={**overrides, "num_threads": threads}), settings)
        except LinearKernelError as exc:
            skipped.append(f"{step}: not measured here: {exc}")
        except ModelLoadError as exc:
            _fail(str(exc))
    bandwidth = measure_bandwidth_gbs(next(iter(engines.values())).device)
    rows = bench_steps(engines, batch_sizes=sizes, num_prompt_tokens=prompt_tokens, num_new_tokens=new_tokens,
                       num_rounds=rounds, bandwidth_gbs=bandwidth, progress=lambda m: typer.echo(m, err=True))
    header = (f"config {serving.name} ({serving.weights}), threads {engine_threads()}, memory bandwidth (measured) "
              f"{bandwidth:.1f} GB/s, {prompt_tokens} prompt + {new_tokens} new tokens, median of {rounds} rounds")
    typer.echo(format_steps_table(rows, header=header))
    typer.echo("\n".join(f"kernel of {step!r}: {engine.kernel}" for step, engine in engines.items()))
    for line in skipped:
        typer.echo(line)


@bench_app.command("queue")
def bench_queue(
    configs: Annotated[list[Path], typer.Option("--config", "-c", help="serving config YAML; repeat to compare "
                                                "configs side by side (ratios to the first)")] = [Path("configs/fp32.yaml")],
    requests: Annotated[int, typer.Option(help="requests in the burst")] = 32,
    prompt_tokens: int = 32,
    new_tokens: int = 16,
    rounds: Annotated[int, typer.Option(help="in-process / queue pairs, back to back")] = 2,
    threads: Annotated[int | None, typer.Option(help="torch threads (default: the config's)")] = None,
) -> None:
    """The same burst served by the engine in-process and through the full queue path; the ratios."""
    import threading
    import uuid

    from servelab.engine.engine import Engine
    from servelab.engine.loader import ModelLoadError
    from servelab.lab.bench import (bench_requests, format_queue_comparison, format_queue_table, time_in_process,
                                    time_queue_path)
    from servelab.queue.batcher import BatchPolicy
    from servelab.queue.streams import RequestStreams
    from servelab.runtime import connect
    from servelab.serving import FaultPolicy, ServingWorker

    serving = [_load_config(c) for c in configs]
    if threads:
        serving = [c.model_copy(update={"num_threads": threads}) for c in serving]
    settings = Settings()
    runtime = connect(settings)
    workers, serving_threads = [], []
    for config in serving:
        try:
            engine = Engine.from_config(config, settings)
        except ModelLoadError as exc:
            _fail(str(exc))
        streams = RequestStreams(runtime.redis, prefix=settings.key_prefix, config_name=f"bench-{uuid.uuid4().hex[:8]}")
        worker = ServingWorker(engine=engine, streams=streams, sessions=runtime.sessions, name="bench",
                               policy=BatchPolicy.from_config(config.batching), faults=FaultPolicy.from_settings(settings))
        workers.append(worker)
        serving_threads.append(threading.Thread(target=worker.run, daemon=True))
        serving_threads[-1].start()
    burst = bench_requests(workers[0].engine, requests, prompt_tokens, new_tokens)
    for worker in workers:
        time_in_process(worker.engine, burst[:2], worker.engine.config.batching.max_batch_size)  # warm-up
    pairs: list[list] = [[] for _ in workers]
    for round_idx in range(rounds):
        for worker, config_pairs in zip(workers, pairs):  # NOTE: configs interleaved, round after round
            typer.echo(f"round {round_idx + 1}/{rounds}: {worker.engine.config.name}", err=True)
            config_pairs.append((time_in_process(worker.engine, burst, worker.engine.config.batching.max_batch_size),
                                 time_queue_path(worker, burst)))
    for worker, thread in zip(workers, serving_threads):
        worker.stop.set()
        thread.join(timeout=30)
    runtime.close()
    for config, worker, config_pairs in zip(serving, workers, pairs):
        typer.echo(f"config {config.name} ({config.weights}, {worker.engine.kernel}), max_batch_size "
                   f"{config.batching.max_batch_size}, max_wait_ms {config.batching.max_wait_ms}, threads "
                   f"{engine_threads()}; burst of {requests} requests, {prompt_tokens} prompt + {new_tokens} new tokens each")
        typer.echo(format_queue_table(config_pairs))
    if len(workers) > 1:
        typer.echo(format_queue_comparison([c.name for c in serving], pairs))


def engine_threads() -> int:
    import torch

    return torch.get_num_threads()


@app.command()
def dashboard(
    port: Annotated[int, typer.Option(help="port to serve the dashboard on")] = 8501,
    address: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
) -> None:
    """Serve the dashboard (Streamlit; reads Postgres and Redis only) until stopped."""
    import os
    import sys

    app_path = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"
    if not app_path.is_file():
        _fail(f"{app_path}: the dashboard app is missing (run from a source checkout)")
    # NOTE: exec, so Ctrl-C and the service manager's signals reach Streamlit itself.
    os.execv(sys.executable, [sys.executable, "-m", "streamlit", "run", str(app_path), "--server.headless", "true",
                              "--server.port", str(port), "--server.address", address,
                              "--browser.gatherUsageStats", "false"])


@app.command()
def sweep(
    configs: Annotated[str, typer.Option(help="comma-separated serving config files; the first is the baseline")]
    = "configs/fp32.yaml,configs/bf16.yaml",
    batch_sizes: Annotated[str, typer.Option(help="comma-separated batch sizes")] = "1,2,4,8,16,32",
    prompt_tokens: int = 64,
    new_tokens: int = 32,
    rounds: Annotated[int, typer.Option(help="interleaved rounds; medians are printed")] = 2,
    threads: Annotated[int | None, typer.Option(help="torch threads (default: the config's, else torch's)")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    store: Annotated[bool, typer.Option(help="store the sweep in PostgreSQL for the dashboard")] = True,
) -> None:
    """Decode speed against batch size per config, beside the bandwidth and compute rooflines."""
    from servelab.engine.engine import Engine
    from servelab.engine.loader import ModelLoadError
    from servelab.lab.sweep import format_sweep_table, sweep_report

    serving = [_load_config(Path(p.strip())) for p in configs.split(",") if p.strip()]
    sizes = _parse_ints(batch_sizes, "--batch-sizes")
    if not serving:
        _fail(f"--configs names no config file, got {configs!r}")
    if len({c.name for c in serving}) != len(serving):
        _fail(f"--configs: config names must differ, got {[c.name for c in serving]}")
    if new_tokens < 2 or prompt_tokens < 1 or rounds < 1:
        _fail("--new-tokens must be at least 2, --prompt-tokens and --rounds at least 1")
    settings = Settings(num_threads=threads) if threads else Settings()
    try:
        engines = [Engine.from_config(c.model_copy(update={"num_threads": threads or c.num_threads}), settings)
                   for c in serving]
    except ModelLoadError as exc:
        _fail(str(exc))
    report = sweep_report(engines, batch_sizes=sizes, num_prompt_tokens=prompt_tokens, num_new_tokens=new_tokens,
                          num_rounds=rounds, progress=lambda m: typer.echo(m, err=True))
    typer.echo(json.dumps(report.as_dict(), indent=2) if as_json else format_sweep_table(report))
    if store:
        typer.echo(f"stored as sweep {_store_sweep(report)} (the dashboard's Sweep page)", err=True)


def _store_sweep(report) -> str:
    from servelab.hardware import describe_hardware
    from servelab.runtime import connect
    from servelab.store.db import session_scope
    from servelab.store.runs import save_sweep

    runtime = connect(Settings())
    try:
        with session_scope(runtime.sessions) as session:
            return save_sweep(session, report=report.as_dict(), hardware=describe_hardware().as_dict())
    finally:
        runtime.close()


# --- the control plane: keys, the api and jobs-worker processes, and batch files through the API ---

keys_app = typer.Typer(no_args_is_help=True, help="API keys: one tenant per key, stored hashed.")
app.add_typer(keys_app, name="keys")


@keys_app.command("create")
def keys_create(tenant: Annotated[str, typer.Option(help="the tenant the key acts for")]) -> None:
    """Create a key and print it; only its hash is stored, so it is shown this once."""
    from servelab.runtime import connect
    from servelab.store.db import session_scope
    from servelab.store.keys import create_key

    if not tenant.strip():
        _fail("--tenant must not be empty")
    runtime = connect(Settings())
    try:
        with session_scope(runtime.sessions) as session:
            key = create_key(session, tenant=tenant.strip())
    finally:
        runtime.close()
    typer.echo(key)


@app.command("api")
def api_server(host: str = "127.0.0.1", port: int = 8000, workers: int = 1) -> None:
    """Run the API (FastAPI under uvicorn); it never loads torch."""
    import uvicorn

    # NOTE: named by string, not imported: the core never imports the process packages.
    uvicorn.run("api.app:build", factory=True, host=host, port=port, workers=workers)


def _run_module(*args: str) -> None:
    import subprocess
    import sys

    raise typer.Exit(code=subprocess.call([sys.executable, "-m", *args]))


@app.command("jobs-worker")
def jobs_worker(concurrency: int = 2) -> None:
    """Run the Celery jobs-worker (batch ingest, finalisation, cancel, expiry, reaper)."""
    _run_module("worker.jobs", "worker", f"--concurrency={concurrency}", "--loglevel=INFO")


@app.command("beat")
def beat() -> None:
    """Run Celery beat: it sweeps batch jobs every jobs_poll_s and reaps lost stream entries."""
    _run_module("worker.jobs", "beat", "--loglevel=INFO")


def _api_client(api_url: str | None, api_key: str | None):
    import httpx

    from servelab.settings import ServiceSettings

    settings = ServiceSettings()
    key = api_key or settings.api_key
    if not key:
        _fail("no API key: pass --api-key or set SERVELAB_API_KEY (make one with `servelab keys create`)")
    return httpx.Client(base_url=(api_url or settings.api_url).rstrip("/"), timeout=120,
                        headers={"Authorization": f"Bearer {key}"})


def _checked(response) -> dict:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        _fail(f"{response.request.method} {response.request.url.path}: {response.status_code}: {message}")
    return response.json()


def _with_model(path: Path, config: str | None) -> tuple[bytes, str, int]:
    """The file with every parseable line's body.model set to config -> (content, endpoint, number of lines)."""
    out, endpoint, num_lines = [], None, 0
    with path.open("rb") as lines:
        for raw in lines:
            if not raw.strip():
                continue
            num_lines += 1
            try:
                record = json.loads(raw)
                endpoint = endpoint or record.get("url")
                if config and isinstance(record.get("body"), dict):
                    record["body"]["model"] = config
                    raw = json.dumps(record).encode() + b"\n"
            except (ValueError, AttributeError):
                pass  # NOTE: sent as it is: the server refuses it with a reason in the error file
            out.append(raw if raw.endswith(b"\n") else raw + b"\n")
    return b"".join(out), endpoint or "/v1/chat/completions", num_lines


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(help="a JSONL batch file (OpenAI batch format)")],
    config: Annotated[str | None, typer.Option("--config", "-c", help="serving config name for every line")] = None,
    window: Annotated[str, typer.Option(help="completion window, e.g. 24h")] = "24h",
    no_wait: Annotated[bool, typer.Option("--no-wait", help="print the batch id and return at once")] = False,
    api_url: Annotated[str | None, typer.Option(help="default: SERVELAB_API_URL")] = None,
    api_key: Annotated[str | None, typer.Option(help="default: SERVELAB_API_KEY")] = None,
) -> None:
    """Upload a batch file, create the batch, and show its progress until it ends."""
    import time

    if not file.is_file():
        _fail(f"{file}: no such file")
    content, endpoint, num_lines = _with_model(file, config)
    with _api_client(api_url, api_key) as client:
        uploaded = _checked(client.post("/v1/files", data={"purpose": "batch"},
                                        files={"file": (file.name, content, "application/jsonl")}))
        batch = _checked(client.post("/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": endpoint,
                                                          "completion_window": window}))
        typer.echo(batch["id"])
        if no_wait:
            return
        with typer.progressbar(length=num_lines, label=batch["id"], file=None) as bar:
            done = 0
            while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
                time.sleep(1.0)
                batch = _checked(client.get(f"/v1/batches/{batch['id']}"))
                counts = batch["request_counts"]
                bar.update(counts["completed"] + counts["failed"] - done)
                done = counts["completed"] + counts["failed"]
    counts = batch["request_counts"]
    typer.echo(f"{batch['status']}: {counts['completed']} completed, {counts['failed']} failed of {counts['total']}")
    if batch["status"] != "completed":
        raise typer.Exit(code=1)


@app.command()
def results(
    batch_id: Annotated[str, typer.Argument(help="batch_...")],
    output: Annotated[Path, typer.Option("--output", "-o", help="where the output JSONL goes")] = Path("out.jsonl"),
    errors: Annotated[Path | None, typer.Option(help="where the error JSONL goes (default: not written)")] = None,
    api_url: Annotated[str | None, typer.Option(help="default: SERVELAB_API_URL")] = None,
    api_key: Annotated[str | None, typer.Option(help="default: SERVELAB_API_KEY")] = None,
) -> None:
    """Download a batch's output file (and error file)."""
    with _api_client(api_url, api_key) as client:
        batch = _checked(client.get(f"/v1/batches/{batch_id}"))
        if batch["status"] not in ("completed", "expired", "cancelled"):
            _fail(f"batch {batch_id} is {batch['status']}: no files yet")
        for file_id, path in ((batch["output_file_id"], output), (batch["error_file_id"], errors)):
            if path is None:
                continue
            content = b"" if file_id is None else client.get(f"/v1/files/{file_id}/content").content
            path.write_bytes(content)
            typer.echo(f"{path}: {len(content.splitlines())} lines")


if __name__ == "__main__":
    app()
