"""The long-running processes and the local stack: worker, migrate, up, down, dashboard, api, jobs-worker, beat.

Knows how each process is started from the command line. Does not know what the processes do inside:
the worker loop, the stack's process table, the API and Celery live in their own modules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from servelab.cli.options import (ConfigOption, config_paths, connected, fail, load_config, service_settings,
                                  settings)


def worker(
    config: ConfigOption,
    name: Annotated[str | None, typer.Option(help="consumer name; reuse it after a crash to take back its entries")] = None,
) -> None:
    """Serve one config from its Redis streams until stopped (the gpu-worker service)."""
    serving = load_config(config)

    from servelab.engine.loader import ModelLoadError
    from servelab.serving import run_worker

    named = settings().model_copy(update={"worker_name": name}) if name else settings()
    with connected(named) as runtime:
        try:
            run_worker(serving, runtime)
        except ModelLoadError as exc:
            fail(str(exc))


def migrate() -> None:
    """Create the database if needed and upgrade it to the newest schema (the compose `migrate` service)."""
    with connected():
        pass  # NOTE: connecting creates the database and upgrades it
    typer.echo("database at the newest schema")


def up(
    configs: Annotated[str, typer.Option(help="comma-separated serving configs, one gpu-worker each")]
    = "configs/smollm2.yaml",
    port: Annotated[int, typer.Option(help="the API's port on 127.0.0.1")] = 8000,
    api_workers: Annotated[int | None, typer.Option(min=1, max=64, help="api processes behind the port (default: "
                                                    "SERVELAB_API_WORKERS, 1)")] = None,
    share_cores: Annotated[bool, typer.Option("--share-cores", help="let the gpu-workers share every core (default: "
                                              "each pinned to its own share of the cores)")] = False,
) -> None:
    """Start the local stack in the background, or start again what of it died.

    Redis and PostgreSQL (embedded unless SERVELAB_REDIS_URL / SERVELAB_DATABASE_URL are set), the schema, the
    api (--api-workers processes on one port), the jobs-worker, beat and a gpu-worker per config. The gpu-workers
    started split the cores running ones do not hold, each pinned to its share (its threads default to it), so two
    never share a core unless --share-cores. What runs is kept; a process that died is started again.
    `servelab status` shows it (with each worker's cores), `servelab down` stops it.
    """
    from servelab.cores import format_cores
    from servelab.stack import StackError, start_stack

    paths = config_paths(configs)
    pinned = {f"gpu-worker-{path.stem}": load_config(path).num_threads for path in paths}
    with connected() as runtime:
        urls, where = runtime.urls, runtime.settings
    env = {"SERVELAB_REDIS_URL": urls.redis_url, "SERVELAB_DATABASE_URL": urls.database_url,
           "SERVELAB_KEY_PREFIX": where.key_prefix, "SERVELAB_CACHE_DIR": str(Path(where.cache_dir).resolve()),
           "SERVELAB_STATE_DIR": str(Path(where.state_dir).resolve())}
    try:
        changes = start_stack(where, env=env, config_paths=paths, api_port=port,
                              api_workers=api_workers or service_settings().api_workers, share_cores=share_cores)
    except StackError as exc:
        fail(str(exc))
    for change in changes:
        p = change.process
        was = f" (pid {change.was.pid} had died)" if change.action == "restarted" else ""
        cores = f" cores {format_cores(p.cpus)}" if p.cpus else ""
        typer.echo(f"{p.name:<24} pid {p.pid:<8} {change.action:<10} log {p.log}{was}{cores}"
                   f"{_threads(pinned[p.name], p.cpus) if p.name in pinned else ''}")
    kept_for_stack = sorted({c for ch in changes if not ch.process.name.startswith("gpu-worker") and ch.action != "running"
                             for c in ch.process.cpus or ()})
    if kept_for_stack:
        typer.echo(f"cores {format_cores(kept_for_stack)} kept for the stack's own processes (api, jobs-worker, beat; "
                   "SERVELAB_STACK_CORES sets how many, 0 gives the workers every core)")
    api = next((c.process for c in changes if c.process.name == "api"), None)
    if api is not None and api.health_url:
        typer.echo(f"API: {api.health_url.removesuffix('/healthz')}/v1 (OpenAI-compatible; model = a config name)")


def _threads(pinned: int | None, cpus: tuple[int, ...] | None) -> str:
    """How a gpu-worker's compute team uses its cores, as its start line says it (servelab/serving/process.py)."""
    if pinned:
        return f", {pinned} thread(s) (its config's num_threads)"
    # NOTE: SERVELAB_NUM_THREADS, where set, pins it instead; a CPU quota (cgroup) can lower it further
    if cpus and len(cpus) == 1:
        return ", 1 thread: its share is one core"
    return (f", {len(cpus) if cpus else 'a thread per core'}{' threads' if cpus else ''}: every core of its share, "
            "fewer while other processes take them")


def down() -> None:
    """Stop the local stack (`servelab up`) and the embedded Redis and PostgreSQL of this state folder."""
    from servelab.embedded import stop_embedded
    from servelab.stack import stop_stack

    for process in stop_stack(settings()):
        typer.echo(f"stopped {process.name} (pid {process.pid})")
    for server in stop_embedded(settings()):
        typer.echo(f"stopped embedded {server.kind} (pid {server.pid})")


def dashboard(
    port: Annotated[int, typer.Option(help="port to serve the dashboard on")] = 8501,
    address: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
) -> None:
    """Serve the dashboard (Streamlit; reads Postgres and Redis only) on 127.0.0.1 until stopped.

    It has no login and shows every tenant's data: keep it on 127.0.0.1 (an SSH tunnel to reach it) unless a
    proxy with a login stands in front.
    """
    import os
    import sys

    app_path = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"
    if not app_path.is_file():
        fail(f"{app_path}: the dashboard app is missing (run from a source checkout)")
    # NOTE: exec, so Ctrl-C and the service manager's signals reach Streamlit itself.
    os.execv(sys.executable, [sys.executable, "-m", "streamlit", "run", str(app_path), "--server.headless", "true",
                              "--server.port", str(port), "--server.address", address,
                              "--browser.gatherUsageStats", "false"])


def api(
    host: str = "127.0.0.1",
    port: int = 8000,
    workers: Annotated[int | None, typer.Option(min=1, max=64, help="api processes behind the port (default: "
                                                "SERVELAB_API_WORKERS, 1)")] = None,
    access_log: Annotated[bool | None, typer.Option("--access-log/--no-access-log", help="a log line per request "
                                                    "(default: SERVELAB_API_ACCESS_LOG, off)")] = None,
) -> None:
    """Run the API (FastAPI under uvicorn; several processes share the port); it never loads torch."""
    import uvicorn

    service = service_settings()
    workers = workers or service.api_workers
    _share_metrics(port, workers)
    # NOTE: named by string, not imported: the core never imports the process packages. uvicorn's supervisor
    # starts the processes (each accepts on the one socket) and starts again one that dies. The access log is
    # off by default: at a front end's rate it costs about a third of a submission's CPU and 100 MB an hour.
    uvicorn.run("api.app:build", factory=True, host=host, port=port, workers=workers,
                access_log=service.api_access_log if access_log is None else access_log)


def _share_metrics(port: int, workers: int) -> None:
    """Several api processes count into one folder (SERVELAB_METRICS_DIR, or one under the state folder per
    port), emptied here, before any of them starts, so each scrape sums this run's processes only."""
    import os

    from servelab.telemetry import prepare_files_dir

    chosen = service_settings().metrics_dir
    if chosen is None and workers == 1:
        return  # NOTE: one process counts in memory
    folder = prepare_files_dir(chosen or Path(service_settings().state_dir) / f"metrics-api-{port}")
    os.environ["SERVELAB_METRICS_DIR"] = str(folder)  # NOTE: how the processes uvicorn starts read their Settings


def _run_module(*args: str) -> None:
    import subprocess
    import sys

    raise typer.Exit(code=subprocess.call([sys.executable, "-m", *args]))


def jobs_worker(concurrency: int = 2) -> None:
    """Run the Celery jobs-worker (batch ingest, finalisation, cancel, expiry, reaper)."""
    _run_module("worker.jobs", "worker", f"--concurrency={concurrency}", "--loglevel=INFO")


def beat() -> None:
    """Run Celery beat: it sweeps batch jobs every jobs_poll_s and reaps lost stream entries."""
    # NOTE: remote control on, so that `servelab health beat` (celery inspect ping) reaches it
    _run_module("worker.jobs", "beat", "--loglevel=INFO", "--enable-remote-control")
