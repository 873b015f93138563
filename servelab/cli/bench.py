"""The `bench` group: engine against transformers, the speed steps, in-process against the queue,
interactive calls behind a bulk job per admission policy, the API's submission rate, batch-file ingest, and the
KV cache's benches (prefix caching, chunked prefill: servelab/cli/cache_bench.py, registered here).

Knows these commands' options and what they print. Does not know how anything is timed or started:
servelab/lab/bench.py does. torch and the engine are imported inside the commands.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated

import typer

from servelab.cli.cache_bench import bench_chunked, bench_kv_dtype, bench_prefix
from servelab.cli.options import (ConfigOption, ThreadsOption, config_paths, connected, fail, load_config, load_engines,
                                  parse_ints, progress, service_settings, settings)

app = typer.Typer(no_args_is_help=True, help="Benchmarks that print ratios measured side by side.")


def engine_threads() -> int:
    import torch

    return torch.get_num_threads()


@app.command("engine")
def bench_engine(
    configs: Annotated[str, typer.Option(help="comma-separated serving config files")] = "configs/fp32.yaml",
    batch_sizes: Annotated[str, typer.Option(help="comma-separated batch sizes")] = "1,4,16,32",
    prompt_tokens: int = 64,
    new_tokens: int = 32,
    rounds: Annotated[int, typer.Option(help="interleaved rounds; medians are printed")] = 3,
    threads: ThreadsOption = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """This engine vs transformers' generate, tokens/s and ratio per batch size, beside the roofline."""
    serving = [load_config(path) for path in config_paths(configs)]

    import torch

    from servelab.lab.bench import bench_engines, format_engine_table
    from servelab.hardware import measure_bandwidth_gbs

    sizes = parse_ints(batch_sizes, "--batch-sizes")
    engines = load_engines(serving, threads)
    bandwidth = measure_bandwidth_gbs(engines[0].device)
    rows = bench_engines(engines, batch_sizes=sizes, num_prompt_tokens=prompt_tokens, num_new_tokens=new_tokens,
                         num_rounds=rounds, bandwidth_gbs=bandwidth, progress=progress)
    if as_json:
        typer.echo(json.dumps({"bandwidth_gbs": bandwidth, "threads": torch.get_num_threads(),
                               "rows": [r.as_dict() for r in rows]}, indent=2))
    else:
        typer.echo(format_engine_table(rows, bandwidth_gbs=bandwidth,
                                       kernels={e.config.name: e.kernel for e in engines}))


@app.command("steps")
def bench_steps_command(
    config: ConfigOption = Path("configs/fp32.yaml"),
    batch_sizes: Annotated[str, typer.Option(help="comma-separated batch sizes")] = "1,16,64",
    prompt_tokens: int = 64,
    new_tokens: int = 32,
    rounds: Annotated[int, typer.Option(help="interleaved rounds; medians are printed")] = 3,
    threads: Annotated[int, typer.Option(min=1, max=256, help="torch threads for every step")] = 1,
) -> None:
    """Each step of the engine's speed work on one config, side by side: tokens/s, gain, roofline."""
    serving = load_config(config)

    from servelab.engine.engine import Engine
    from servelab.engine.linear import LinearKernelError
    from servelab.engine.loader import ModelLoadError
    from servelab.lab.bench import STEPS, bench_steps, format_steps_table
    from servelab.hardware import measure_bandwidth_gbs

    sizes = parse_ints(batch_sizes, "--batch-sizes")
    with_threads = settings().model_copy(update={"num_threads": threads})
    # NOTE: every row decodes from the same step: the batch is prefilled whole (no chunks, so no row starts early
    # and none decodes the tail alone) and its identical prompts are each computed (no prefix shared)
    serving = serving.model_copy(update={
        "batching": serving.batching.model_copy(update={"max_prefill_tokens": max(sizes) * (prompt_tokens + 1)}),
        "kv_cache": serving.kv_cache.model_copy(update={"prefix_caching": False})})
    engines, skipped = {}, []
    for step, overrides in STEPS:
        try:
            engines[step] = Engine.from_config(serving.model_copy(update={**overrides, "num_threads": threads}),
                                               with_threads)
        except LinearKernelError as exc:
            skipped.append(f"{step}: not measured here: {exc}")
        except ModelLoadError as exc:
            fail(str(exc))
    bandwidth = measure_bandwidth_gbs(next(iter(engines.values())).device)
    rows = bench_steps(engines, batch_sizes=sizes, num_prompt_tokens=prompt_tokens, num_new_tokens=new_tokens,
                       num_rounds=rounds, bandwidth_gbs=bandwidth, progress=progress)
    header = (f"config {serving.name} ({serving.weights}), threads {engine_threads()}, memory bandwidth (measured) "
              f"{bandwidth:.1f} GB/s, {prompt_tokens} prompt + {new_tokens} new tokens, median of {rounds} rounds")
    typer.echo(format_steps_table(rows, header=header))
    typer.echo("\n".join(f"kernel of {step!r}: {engine.kernel}" for step, engine in engines.items()))
    for line in skipped:
        typer.echo(line)


@app.command("queue")
def bench_queue(
    configs: Annotated[list[Path], typer.Option("--config", "-c", help="serving config YAML; repeat to compare "
                                                "configs side by side (ratios to the first)")] = [Path("configs/fp32.yaml")],
    requests: Annotated[int, typer.Option(min=1, help="requests in the burst")] = 32,
    prompt_tokens: Annotated[int, typer.Option(min=1)] = 32,
    new_tokens: Annotated[int, typer.Option(min=1)] = 16,
    rounds: Annotated[int, typer.Option(min=1, help="in-process / queue pairs, back to back")] = 2,
    stream: Annotated[str, typer.Option(help="the stream the burst waits in: bulk (a backlog; rows publish only "
                                             "their end) or interactive (every row's text published per step)")] = "bulk",
    threads: Annotated[int | None, typer.Option(min=1, max=256, help="torch threads (default: the config's)")] = None,
) -> None:
    """The same burst served by the engine in-process and through the full queue path (a worker process); the ratios."""
    serving = [load_config(c) for c in configs]
    kind = _stream_kind(stream)

    from servelab.engine.loader import ModelLoadError
    from servelab.lab.bench import format_queue_comparison, format_queue_table, start_queue_bench, time_queue_rounds
    from servelab.lab.runner import RunError

    if threads:
        serving = [c.model_copy(update={"num_threads": threads}) for c in serving]
    with connected() as runtime, ExitStack() as started:
        try:
            benches = [started.enter_context(start_queue_bench(config, runtime)) for config in serving]
        except (ModelLoadError, RunError) as exc:
            fail(str(exc))
        pairs = time_queue_rounds(benches, runtime, num_requests=requests, num_prompt_tokens=prompt_tokens,
                                  num_new_tokens=new_tokens, num_rounds=rounds, kind=kind, progress=progress)
    for config, bench, config_pairs in zip(serving, benches, pairs):
        typer.echo(f"config {config.name} ({config.weights}, {bench.engine.kernel}), max_batch_size "
                   f"{config.batching.max_batch_size}, max_wait_ms {config.batching.max_wait_ms}, threads "
                   f"{engine_threads()}; burst of {requests} {kind.value} requests, {prompt_tokens} prompt + "
                   f"{new_tokens} new tokens each")
        typer.echo(format_queue_table(config_pairs))
    if len(benches) > 1:
        typer.echo(format_queue_comparison([c.name for c in serving], pairs))


@app.command("workers")
def bench_workers(
    config: ConfigOption = Path("configs/fp32.yaml"),
    workers: Annotated[str, typer.Option(help="comma-separated worker counts, each serving the same burst")] = "1,2",
    requests: Annotated[int, typer.Option(min=1, help="requests in the burst")] = 64,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="about this many prompt tokens per request")] = 32,
    new_tokens: Annotated[int, typer.Option(min=1, help="tokens each request makes (EOS ignored)")] = 32,
    rounds: Annotated[int, typer.Option(min=1, help="rounds; the counts alternate ascending / descending")] = 2,
    threads: Annotated[int, typer.Option(min=1, max=256, help="torch threads per worker process")] = 1,
) -> None:
    """Scale-out: one config served by 1, 2, ... worker processes on the same streams; total tokens/s against the
    first count, how the requests were shared, and how many ran more than once (must be 0)."""
    serving = load_config(config).model_copy(update={"num_threads": threads})
    counts = parse_ints(workers, "--workers")

    from servelab.lab.runner import RunError
    from servelab.lab.scaling import bench_scale_out, format_scale_table

    with connected() as runtime:
        try:
            rows = bench_scale_out(serving, runtime, worker_counts=counts, num_requests=requests,
                                   num_prompt_tokens=prompt_tokens, num_new_tokens=new_tokens, num_rounds=rounds,
                                   progress=progress)
        except RunError as exc:
            fail(str(exc))
    typer.echo(f"config {serving.name} ({serving.weights}), max_batch_size {serving.batching.max_batch_size}, "
               f"policy {serving.batching.policy}, {threads} thread(s) per worker; burst of {requests} bulk requests, "
               f"about {prompt_tokens} prompt + {new_tokens} new tokens each; {rounds} round(s)")
    typer.echo(format_scale_table(rows))
    if any(r.outcome.num_run_twice for r in rows):
        raise typer.Exit(code=1)


def _stream_kind(name: str):
    from servelab.request import StreamKind

    try:
        return StreamKind(name)
    except ValueError:
        fail(f"--stream {name} is not a stream; choose bulk or interactive")


@app.command("hol")
def bench_head_of_line(
    config: ConfigOption = Path("configs/fp32.yaml"),
    policies: Annotated[str, typer.Option(help="comma-separated admission policies, ratios to the first")] = "window,continuous",
    bulk: Annotated[int, typer.Option(min=1, help="requests in the bulk job")] = 48,
    bulk_prompt_tokens: Annotated[int, typer.Option(min=1)] = 64,
    bulk_tokens: Annotated[int, typer.Option(min=1, help="new tokens per bulk request")] = 200,
    calls: Annotated[int, typer.Option(min=1, help="interactive calls, alone and during the bulk job")] = 8,
    call_tokens: Annotated[int, typer.Option(min=1, help="new tokens per interactive call")] = 8,
    interval: Annotated[float, typer.Option(min=0.0, help="seconds between interactive calls during the bulk job")] = 2.0,
    rounds: Annotated[int, typer.Option(min=1, help="rounds, policies interleaved; medians are printed")] = 1,
    threads: ThreadsOption = None,
) -> None:
    """Head of line: interactive end-to-end time alone and while a bulk job runs, per admission policy,
    through the real queue; one engine, only the policy differs."""
    serving = load_config(config)

    from servelab.lab.hol import HolWorkload, format_head_of_line, run_head_of_line, time_join_cost
    from servelab.scheduler.policy import BatchPolicy

    names = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in ("window", "continuous")]
    if not names or unknown:
        fail(f"--policies: {', '.join(unknown) or 'none given'} is not a policy; use window and/or continuous")
    if bulk_tokens > serving.decoding.max_new_tokens or call_tokens > serving.decoding.max_new_tokens:
        fail(f"--bulk-tokens {bulk_tokens} / --call-tokens {call_tokens}: above the config's "
             f"decoding.max_new_tokens ({serving.decoding.max_new_tokens})")
    engine = load_engines([serving], threads)[0]
    shape, per_element = engine.loaded.shape, engine.kv_bytes_per_element
    by_policy = {name: BatchPolicy.from_config(serving.batching.model_copy(update={"policy": name}), shape,
                                               bytes_per_element=per_element) for name in names}
    workload = HolWorkload(bulk, bulk_prompt_tokens, bulk_tokens, calls, call_tokens, interval)
    with connected() as runtime:
        rounds_by_policy = run_head_of_line(engine, runtime, by_policy, workload, num_rounds=rounds, progress=progress)
    join = time_join_cost(engine, num_rows=min(serving.batching.max_batch_size, bulk), num_prompt_tokens=bulk_prompt_tokens)
    b = serving.batching
    typer.echo(f"config {serving.name} ({serving.weights}, {engine.kernel}), max_batch_size {b.max_batch_size}, "
               f"max_wait_ms {b.max_wait_ms}, threads {engine_threads()}; bulk job {bulk} x ({bulk_prompt_tokens} "
               f"prompt + {bulk_tokens} new tokens), {calls} interactive calls of {call_tokens} tokens, "
               f"every {interval:g} s during it; {rounds} round(s)")
    typer.echo(format_head_of_line(rounds_by_policy))
    typer.echo(f"a newcomer's prefill ({join.num_prompt_tokens} tokens) adds {join.prefill_ms:.1f} ms to the step of "
               f"{join.num_rows} running rows it joins (a plain step: {join.step_ms:.1f} ms), so the running rows' token "
               f"after a join takes x{join.tpot_factor:.2f} a plain one; a step of 1 row: {join.alone_step_ms:.1f} ms, "
               f"so sharing a full batch costs a call x{join.step_ms / join.alone_step_ms:.2f} per token at least "
               f"(medians of 7 rounds)")


@app.command("stream")
def bench_stream(
    config: ConfigOption = Path("configs/fp32.yaml"),
    rows: Annotated[int, typer.Option(min=1, help="requests in the batch, all queued before it starts")] = 16,
    prompt_tokens: Annotated[int, typer.Option(min=1)] = 32,
    new_tokens: Annotated[int, typer.Option(min=1, help="new tokens per request (EOS ignored)")] = 128,
    rounds: Annotated[int, typer.Option(min=1, help="rounds, streamed and unstreamed interleaved")] = 3,
    threads: ThreadsOption = None,
) -> None:
    """What streaming costs: tokens/s of one batch through the queue with every row's text published per step
    and read by a relay per row, against the same batch with no row streamed."""
    serving = load_config(config)

    from servelab.lab.hol import run_stream_overhead

    if new_tokens > serving.decoding.max_new_tokens:
        fail(f"--new-tokens {new_tokens}: above the config's decoding.max_new_tokens ({serving.decoding.max_new_tokens})")
    if rows > serving.batching.max_batch_size:
        fail(f"--rows {rows}: above the config's batching.max_batch_size ({serving.batching.max_batch_size})")
    engine = load_engines([serving], threads)[0]
    with connected() as runtime:
        result = run_stream_overhead(engine, runtime, num_rows=rows, prompt_tokens=prompt_tokens,
                                     new_tokens=new_tokens, num_rounds=rounds, progress=progress)
    typer.echo(f"config {serving.name} ({serving.weights}, {engine.kernel}), threads {engine_threads()}; a batch of "
               f"{rows} x ({prompt_tokens} prompt + {new_tokens} new tokens) through the queue; {rounds} round(s)")
    typer.echo(f"{'round':<6} {'streamed tok/s':>14} {'unstreamed tok/s':>16} {'ratio':>7}")
    for i, (s, u) in enumerate(zip(result.streamed_tokens_per_s, result.unstreamed_tokens_per_s), start=1):
        typer.echo(f"{i:<6} {s:>14.1f} {u:>16.1f} {s / u:>7.3f}")
    typer.echo(f"every row streamed against none: x{result.ratio:.3f} tokens/s (median of the rounds' ratios; "
               f"goal: within 5 %, x0.95 or more)")
    typer.echo(f"publishing a step (text of {rows} rows + their cancel flags, one round trip): "
               f"{result.publish_ms_per_step:.2f} ms per step of {result.step_ms:.1f} ms "
               f"({100 * result.publish_ms_per_step / result.step_ms:.2f} % of the loop)")


@app.command("api")
def bench_api(
    processes: Annotated[str, typer.Option(help="comma-separated api process counts to run this checkout with")]
    = "1,2",
    baseline: Annotated[Path | None, typer.Option(help="another checkout (e.g. a worktree of main) run the same "
                                                  "way first, in a scratch database of its own")] = None,
    clients: Annotated[int, typer.Option(min=1, help="concurrent keep-alive connections")] = 32,
    requests: Annotated[int, typer.Option(min=1, help="submissions per measured run")] = 1_000,
    load_processes: Annotated[int, typer.Option(min=1, help="client processes the connections are spread over")]
    = 2,
    warmup: Annotated[int, typer.Option(min=0, help="submissions before each measured run, not counted")] = 200,
    rounds: Annotated[int, typer.Option(min=1, help="runs per api, the apis interleaved; medians are printed")] = 1,
    model: Annotated[str, typer.Option(help="the serving config the submissions name")] = "fp32",
    url: Annotated[str | None, typer.Option(help="drive this running api instead (e.g. the local stack's "
                                            "http://127.0.0.1:8000); starts and removes nothing")] = None,
    key: Annotated[str | None, typer.Option(help="with --url: the API key (default SERVELAB_API_KEY)")] = None,
) -> None:
    """POST /v1/requests at a front end's rate: submissions/s, p50 and p99 per api (this checkout with each
    --processes count, and --baseline), then the load generator's own rate against GET /healthz."""
    from servelab.cli.options import service_settings
    from servelab.lab.submit_bench import ApiUnderTest, Shape, drive, run_api_bench

    if load_processes > clients:
        fail(f"--load-processes {load_processes}: more than --clients {clients}; each drives a connection at least")
    shape = Shape(model, clients, requests, load_processes, warmup)
    if url is not None:
        api_key = key or service_settings().api_key
        if not api_key:
            fail("--url needs an API key: --key, or SERVELAB_API_KEY (`servelab keys create --tenant bench`)")
        row, ceiling = drive(url.rstrip("/"), api_key, shape, num_rounds=rounds)
        rows = [row]
    else:
        if baseline is not None and not (baseline / "api" / "app.py").is_file():
            fail(f"--baseline {baseline}: not a servelab checkout (no api/app.py)")
        counts = parse_ints(processes, "--processes")
        here = Path(__file__).resolve().parents[2]
        apis = [*(ApiUnderTest(f"baseline {baseline}", baseline.resolve(), n, is_baseline=True)
                  for n in counts if baseline is not None),
                *(ApiUnderTest("this checkout", here, n) for n in counts)]
        with connected() as runtime:
            try:
                rows, ceiling = run_api_bench(runtime, apis, shape, num_rounds=rounds, progress=progress)
            except RuntimeError as exc:
                fail(str(exc))
    typer.echo(f"POST /v1/requests (model {model}, 1 token each): {clients} keep-alive connections in "
               f"{load_processes} client process(es), {requests} submissions per run after {warmup} unmeasured, "
               f"{rounds} round(s), median of rounds; {os.cpu_count()} cores")
    typer.echo(f"{'api':<44} {'processes':>9} {'submissions/s':>13} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}")
    first = rows[0].submissions_per_s
    for row in rows:
        label = row.api.label if len(row.api.label) <= 44 else row.api.label[:20] + "..." + row.api.label[-21:]
        ratio = f"  x{row.submissions_per_s / first:.1f}" if first > 0 and row is not rows[0] else ""
        typer.echo(f"{label:<44} {row.api.num_processes or '-':>9} {row.submissions_per_s:>13.0f} "
                   f"{row.p50_ms:>8.1f} {row.p99_ms:>8.1f} {row.num_errors:>7}{ratio}")
    for row in rows:
        if row.first_error:
            typer.echo(f"first error of {row.api.label}: {row.first_error}")
    typer.echo(f"the load generator against GET /healthz of the last api: {ceiling.requests_per_s:.0f} requests/s "
               f"(p50 {ceiling.percentile_ms(50):.1f} ms, {ceiling.num_errors} errors): its ceiling is at least this")


@app.command("ingest")
def bench_ingest(
    config: ConfigOption = Path("configs/fp32.yaml"),
    lines: Annotated[int, typer.Option(min=1, help="lines in the batch file")] = 20_000,
    slice_lines: Annotated[int | None, typer.Option("--slice", min=1, help="lines per ingest slice (one "
                                                    "transaction); default: the jobs-worker's")] = None,
    bad_every: Annotated[int, typer.Option(min=0, help="every n-th line is bad, for one reason or another "
                                           "(0: none; at least 2)")] = 100,
    rounds: Annotated[int, typer.Option(min=1, help="rounds of the same file; medians are printed")] = 1,
) -> None:
    """Batch-file ingest on the local stack's servers (a throwaway database): lines/s, CPU per line and peak
    memory above idle for the upload, the ingest, the output file's writing and its download."""
    serving = load_config(config)
    if bad_every == 1:
        fail("--bad-every 1 makes every line bad; give 0 (none) or at least 2")

    from servelab.lab.ingest_bench import format_ingest_table, run_ingest_bench, throwaway_stack

    limits = _ingest_limits(slice_lines, lines)
    with throwaway_stack(settings()) as runtime:
        batch, by_round = run_ingest_bench(runtime, num_lines=lines, model=serving.name, configs_dir=config.parent,
                                           limits=limits, bad_every=bad_every, num_rounds=rounds, progress=progress)
        database = runtime.db.url.database
    typer.echo(f"{batch.num_lines} lines ({batch.num_bad_lines} bad), {batch.num_bytes / 1e6:.1f} MB, chat "
               f"completions for {serving.name}; slices of {limits.max_lines_per_step} lines; {rounds} round(s); "
               f"database {database} (dropped); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    typer.echo(format_ingest_table(by_round))


def _ingest_limits(slice_lines: int | None, num_lines: int):
    from servelab.jobs.ingest import IngestLimits

    limits = service_settings()
    # NOTE: no back-pressure: no GPU worker drains the queue in this bench, so every line may be in flight
    return IngestLimits(max_prompt_chars=limits.max_prompt_chars, max_job_in_flight=num_lines,
                        max_line_bytes=limits.max_request_bytes,
                        **({"max_lines_per_step": slice_lines} if slice_lines else {}))


# NOTE: the KV cache's benches live in a module of their own (this one is near 400 lines); listed after the others
app.command("prefix")(bench_prefix)
app.command("chunked")(bench_chunked)
app.command("kv-dtype")(bench_kv_dtype)
