"""What runs: `status` (the local stack, the servers, the workers, the queues) and `health` (one service,
as docker-compose's health checks ask).

Knows how each is printed and the exit codes: 0 up, 1 something down, 2 bad input. Does not know how the
stack is read (servelab/stack.py) or how Celery answers a ping (worker.jobs, run as a process).
"""

from __future__ import annotations

import json
import socket
from datetime import UTC, datetime
from enum import Enum
from typing import Annotated

import typer

from servelab.cli.options import service_settings

WORKER_CHECK_TIMEOUT_S = 5.0


def status(as_json: Annotated[bool, typer.Option("--json", help="print the status as JSON")] = False) -> None:
    """Show what runs; exit 1 when something is down.

    The local stack's processes (alive or not), Redis and PostgreSQL, the workers with their configs, last
    heartbeat and kernels (and why, where transformers' forward serves a model), the queues' depth per stream.
    Starts nothing. Exit status 0 when all is up, 1 when not.
    """
    from servelab.stack import stack_status

    where = service_settings()
    report = stack_status(where, now=datetime.now(UTC), live_s=where.worker_live_s)
    if as_json:
        typer.echo(json.dumps(report.as_dict(), indent=2))
    else:
        _print_status(report, where.state_dir)
    raise typer.Exit(0 if report.is_up else 1)


def _print_status(report, state_dir) -> None:
    from servelab.cores import format_cores

    typer.secho(f"local stack ({state_dir}/stack.json)", bold=True)
    if not report.processes:
        typer.echo("  none recorded")
    for s in report.processes:
        p = s.process
        state = "running" if s.is_running else "NOT RUNNING"
        extra = "" if s.answers is None else (f"  answers {p.health_url}" if s.answers else "  DOES NOT ANSWER")
        cores = f"  cores {format_cores(p.cpus)}" if p.cpus else ""
        typer.echo(f"  {p.name:<24} pid {p.pid:<8} {state:<12}{extra}{cores}  log {p.log}")
    typer.secho("servers", bold=True)
    for s in report.servers:
        where = f"embedded, pid {s.pid}" if s.is_embedded else ("set by URL" if s.url else "none")
        state = "answers" if s.answers else f"DOWN: {s.error}"
        typer.echo(f"  {s.kind:<9} {s.url or '-'}  ({where})  {state}")
    typer.secho("workers", bold=True)
    if not report.workers:
        typer.echo("  none registered")
    for w in report.workers:
        typer.echo(f"  {w.name:<28} {w.serving_config_name} ({w.config_hash[:12]}) on {w.device}, last heartbeat "
                   f"{w.seconds_since_heartbeat:.0f} s ago: {'live' if w.is_live else 'not live'}"
                   + (f"  [{w.service}]" if w.service else ""))
        if w.kernel:
            typer.echo(f"    {w.kernel}")
        if w.decoder_reason:
            typer.secho(f"    transformers' forward serves it: {w.decoder_reason}", fg=typer.colors.YELLOW)
    typer.secho("queues (entries not yet acknowledged)", bold=True)
    if not report.queue_depths:
        typer.echo("  no streams")
    for name, depth in sorted(report.queue_depths.items()):
        typer.echo(f"  {name:<24} " + "  ".join(f"{kind} {n}" for kind, n in sorted(depth.items())))
    for problem in report.problems:
        typer.secho(f"down: {problem}", fg=typer.colors.RED, err=True)


class Service(str, Enum):
    api = "api"
    dashboard = "dashboard"
    worker = "worker"
    jobs_worker = "jobs-worker"
    beat = "beat"


DEFAULT_URLS = {Service.api: "http://127.0.0.1:8000/healthz", Service.dashboard: "http://127.0.0.1:8501/_stcore/health"}


def health(
    service: Annotated[Service, typer.Argument(help="which service of this host to check")],
    url: Annotated[str | None, typer.Option(help="api / dashboard: the URL to GET (default: this host's)")] = None,
    max_age_s: Annotated[float | None, typer.Option(help="worker: the oldest heartbeat that is healthy "
                                                         "(default: SERVELAB_WORKER_LIVE_S)")] = None,
    node: Annotated[str | None, typer.Option(help="jobs-worker / beat: the Celery node name "
                                                  "(default: celery@HOST / celerybeat@HOST)")] = None,
    timeout: Annotated[float, typer.Option(min=0.1, help="api / dashboard / jobs-worker / beat: seconds to wait for "
                                                         "the answer (the GET, Celery's ping)")] = WORKER_CHECK_TIMEOUT_S,
) -> None:
    """Check one service of this host, as a container health check does: exit 0 healthy, 1 not.

    api and dashboard: their health URL answers 200. worker: this host's gpu-worker (SERVELAB_WORKER_NAME, or
    any named HOST-PID) beat in PostgreSQL within the limit. jobs-worker and beat: they answer Celery's ping.
    """
    checks = {Service.api: _http, Service.dashboard: _http, Service.worker: _worker,
              Service.jobs_worker: _celery, Service.beat: _celery}
    healthy, message = checks[service](service, url=url, max_age_s=max_age_s, node=node, timeout_s=timeout)
    typer.echo(f"{service.value}: {message}", err=not healthy)
    raise typer.Exit(0 if healthy else 1)


def _http(service: Service, *, url: str | None, timeout_s: float, **_) -> tuple[bool, str]:
    import httpx

    target = url or DEFAULT_URLS[service]
    try:
        code = httpx.get(target, timeout=timeout_s).status_code
    except httpx.HTTPError as exc:
        return False, f"{target} does not answer ({type(exc).__name__})"
    return code == 200, f"{target} answered {code}"


def _worker(service: Service, *, max_age_s: float | None, **_) -> tuple[bool, str]:
    from servelab.stack import stack_status

    where = service_settings()
    limit = max_age_s if max_age_s is not None else where.worker_live_s
    report = stack_status(where, now=datetime.now(UTC), live_s=limit)
    database = next(s for s in report.servers if s.kind == "postgres")
    if not database.answers:
        return False, f"PostgreSQL: {database.error}"
    prefix = f"{socket.gethostname()}-"
    is_mine = (lambda name: name == where.worker_name) if where.worker_name else (lambda name: name.startswith(prefix))
    mine = [w for w in report.workers if is_mine(w.name)]
    if not mine:
        return False, f"no worker of this host ({where.worker_name or prefix + '<pid>'}) has registered"
    newest = min(mine, key=lambda w: w.seconds_since_heartbeat)
    verdict = newest.seconds_since_heartbeat <= limit
    return verdict, f"{newest.name} beat {newest.seconds_since_heartbeat:.0f} s ago (limit {limit:.0f} s)"


def _celery(service: Service, *, node: str | None, timeout_s: float, **_) -> tuple[bool, str]:
    import subprocess
    import sys

    name = node or f"{'celery' if service is Service.jobs_worker else 'celerybeat'}@{socket.gethostname()}"
    # NOTE: through worker.jobs, named by string (the core never imports the process packages): it binds
    # Celery to this deployment's broker and key prefix as the services themselves do.
    try:
        result = subprocess.run([sys.executable, "-m", "worker.jobs", "inspect", "ping", "--destination", name,
                                 "--timeout", str(timeout_s)], capture_output=True, text=True,
                                timeout=60 + timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"{name}: the ping did not return within {60 + timeout_s:.0f} s"
    if result.returncode == 0:
        return True, f"{name} answers"
    lines = (result.stderr or result.stdout).strip().splitlines()
    return False, f"{name} does not answer: {lines[-1] if lines else 'exit ' + str(result.returncode)}"
