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
    from servelab.engine.requests import ChatMessage, GenerationRequest, SamplingParams

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
def down() -> None:
    """Stop the embedded Redis and PostgreSQL this folder's state dir started."""
    from servelab.embedded import stop_embedded

    for server in stop_embedded(Settings()):
        typer.echo(f"stopped embedded {server.kind} (pid {server.pid})")


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
    from servelab.lab.hardware import measure_bandwidth_gbs

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
        typer.echo(format_engine_table(rows, bandwidth_gbs=bandwidth))


@bench_app.command("queue")
def bench_queue(
    config: ConfigOption = Path("configs/fp32.yaml"),
    requests: Annotated[int, typer.Option(help="requests in the burst")] = 32,
    prompt_tokens: int = 32,
    new_tokens: int = 16,
    rounds: Annotated[int, typer.Option(help="in-process / queue pairs, back to back")] = 2,
    threads: Annotated[int | None, typer.Option(help="torch threads (default: the config's)")] = None,
) -> None:
    """The same burst served by the engine in-process and through the full queue path; the ratio."""
    import threading
    import uuid

    from servelab.engine.engine import Engine
    from servelab.lab.bench import bench_requests, format_queue_table, time_in_process, time_queue_path
    from servelab.queue.batcher import BatchPolicy
    from servelab.queue.streams import RequestStreams
    from servelab.runtime import connect
    from servelab.serving import FaultPolicy, ServingWorker

    serving = _load_config(config)
    if threads:
        serving = serving.model_copy(update={"num_threads": threads})
    settings = Settings()
    runtime = connect(settings)
    engine = Engine.from_config(serving, settings)
    streams = RequestStreams(runtime.redis, prefix=settings.key_prefix, config_name=f"bench-{uuid.uuid4().hex[:8]}")
    worker = ServingWorker(engine=engine, streams=streams, sessions=runtime.sessions, name="bench",
                           policy=BatchPolicy.from_config(serving.batching), faults=FaultPolicy.from_settings(settings))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    burst = bench_requests(engine, requests, prompt_tokens, new_tokens)
    time_in_process(engine, burst[:2], serving.batching.max_batch_size)  # warm-up
    pairs = []
    for round_idx in range(rounds):
        typer.echo(f"round {round_idx + 1}/{rounds}", err=True)
        pairs.append((time_in_process(engine, burst, serving.batching.max_batch_size), time_queue_path(worker, burst)))
    worker.stop.set()
    thread.join(timeout=30)
    runtime.close()
    typer.echo(f"config {serving.name} ({serving.weights}), max_batch_size {serving.batching.max_batch_size}, "
               f"max_wait_ms {serving.batching.max_wait_ms}, threads {engine_threads()}; burst of {requests} requests, "
               f"{prompt_tokens} prompt + {new_tokens} new tokens each")
    typer.echo(format_queue_table(pairs))


def engine_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    app()
