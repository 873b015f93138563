"""The local stack: the service processes of docker-compose.yml, started on this machine in the background.

Knows how to start the api, jobs-worker, beat and one gpu-worker per config as detached processes with
logs under the state folder, record each one's pid, start time and command, pin each to the cores servelab/cores.py
splits between them (a gpu-worker to its own share, so two never run on one core unless asked), start again the ones that
died, stop exactly the processes it started (a recorded pid that now belongs to another process is left
alone), and read what runs: its processes, the servers, the workers' heartbeats and the queues' depths.
Does not know what the processes do; the embedded servers are servelab/embedded.py's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import redis
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import sessionmaker

from servelab.cores import CoreSplitError, format_cores, split_cores
from servelab.embedded import EmbeddedServer, recorded_servers
from servelab.queue.streams import stream_depths
from servelab.settings import Settings
from servelab.store import queries
from servelab.store.db import sqlalchemy_url

REPO = Path(__file__).resolve().parents[1]
STOP_TIMEOUT_S = 30.0
PEEK_TIMEOUT_S = 3.0


class StackError(RuntimeError):
    """A stack process that did not start; the message names it and its log."""


@dataclass(frozen=True)
class StackProcess:
    """One recorded process. args and start_ticks are missing in records written before servelab 0.1's restarts."""

    name: str
    pid: int
    log: str
    args: tuple[str, ...] = ()  # after the interpreter: how `up` starts it again
    start_ticks: int | None = None  # /proc start time: the pid is still this process only while it matches
    health_url: str | None = None  # the api's /healthz
    cpus: tuple[int, ...] | None = None  # its cores (CPU affinity): a gpu-worker's share, the stack's kept cores; None: all


@dataclass(frozen=True)
class StackChange:
    """What `up` did with one process: kept it running, started it, or started it again after it died."""

    process: StackProcess
    action: str  # "running", "started" or "restarted"
    was: StackProcess | None = None


def _record_path(settings: Settings) -> Path:
    return Path(settings.state_dir) / "stack.json"


def read_stack(settings: Settings) -> list[StackProcess]:
    path = _record_path(settings)
    if not path.is_file():
        return []
    return [StackProcess(**{**p, "args": tuple(p.get("args", ())),
                            "cpus": tuple(p["cpus"]) if p.get("cpus") is not None else None})
            for p in json.loads(path.read_text())]


def _write_stack(settings: Settings, processes: list[StackProcess]) -> None:
    tmp = _record_path(settings).with_suffix(".json.tmp")
    tmp.write_text(json.dumps([asdict(p) for p in processes], indent=2))
    tmp.replace(_record_path(settings))


def stack_commands(config_paths: list[Path], api_port: int, api_workers: int | None = None) -> dict[str, list[str]]:
    """Each process's name and arguments after the interpreter, in start order (the api first; api_workers None:
    as many processes as its SERVELAB_API_WORKERS says)."""
    workers = ["--workers", str(api_workers)] if api_workers is not None else []
    return {
        "api": ["-m", "servelab.cli", "api", "--port", str(api_port), *workers],
        "jobs-worker": ["-m", "worker.jobs", "worker", "--concurrency=2", "--loglevel=INFO"],
        # NOTE: remote control on, so that `servelab health beat` (celery inspect ping) can reach it.
        "beat": ["-m", "worker.jobs", "beat", "--loglevel=INFO", "--enable-remote-control"],
        **{f"gpu-worker-{path.stem}": ["-m", "worker.gpu", str(path.resolve())] for path in config_paths},
    }


def start_stack(settings: Settings, *, env: dict[str, str], config_paths: list[Path],
                api_port: int, api_workers: int | None = None, share_cores: bool = False) -> list[StackChange]:
    """Make every process of the recorded stack and of this call run: those running are kept, those that died
    are started again (with this call's command where it names them, else the recorded one), new ones started.
    The gpu-workers started split the cores that running gpu-workers do not hold (servelab/cores.py), unless
    share_cores: then each may run on every core."""
    recorded = {p.name: p for p in read_stack(settings)}
    wanted = stack_commands(config_paths, api_port, api_workers)
    logs = Path(settings.state_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    names = [*wanted, *(n for n in recorded if n not in wanted)]
    kept = {n for n in names if n in recorded and is_running(recorded[n])}
    starting = [n for n in names if n.startswith("gpu-worker") and n not in kept
                and (wanted.get(n) or recorded[n].args)]
    held = {c for n in kept for c in (recorded[n].cpus or ()) if n.startswith("gpu-worker")}
    try:
        cores = {} if share_cores else split_cores(starting, [n for n in names if not n.startswith("gpu-worker")],
                                                   sorted(set(os.sched_getaffinity(0)) - held), settings.stack_cores)
    except CoreSplitError as exc:
        raise StackError(str(exc)) from None
    # NOTE: stack processes still running keep the cores they were pinned to: a new worker must not land on them
    stack_held = {c for n in kept if not n.startswith("gpu-worker") for c in (recorded[n].cpus or ())}
    crowded = sorted({c for n in starting for c in cores.get(n, ())} & stack_held)
    if crowded:
        raise StackError(f"the stack's own processes run pinned to core(s) {format_cores(crowded)}, which a gpu-worker "
                         f"to start ({', '.join(starting)}) would share: `servelab down`, then `servelab up` with "
                         "every config to split the cores again, or --share-cores")
    changes = []
    for name in names:
        old = recorded.get(name)
        if name in kept:
            changes.append(StackChange(old, "running"))
            continue
        args = wanted.get(name) or list(old.args)
        if not args:
            continue  # NOTE: a dead process recorded without its command (an older record): nothing to start
        health_url = f"http://127.0.0.1:{api_port}/healthz" if name == "api" else None
        # NOTE: a stack process started again where no worker starts goes back to the cores it was pinned to
        cpus = cores.get(name) or (old.cpus if old is not None and not name.startswith("gpu-worker")
                                   and not share_cores else None)
        changes.append(StackChange(_spawn(name, args, env, logs, health_url, cpus),
                                   "restarted" if old else "started", old))
    _write_stack(settings, [c.process for c in changes])
    api = next((c for c in changes if c.process.name == "api"), None)
    if api is not None and api.action != "running" and api.process.health_url:
        _wait_for_api(api.process.health_url, api.process)
    return changes


def _spawn(name: str, args: list[str], env: dict[str, str], logs: Path, health_url: str | None,
           cpus: tuple[int, ...] | None = None) -> StackProcess:
    log = logs / f"{name}.log"
    # NOTE: pinned before the interpreter starts, so every thread it makes (torch's pool) inherits the share
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env={**os.environ, **env}, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=pin)
    return StackProcess(name, proc.pid, str(log), tuple(args), _start_ticks(proc.pid), health_url, cpus)


def _wait_for_api(url: str, api: StackProcess, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not is_running(api):
            raise StackError(f"the api exited while starting; see {api.log}")
        if _answers(url):
            return
        time.sleep(0.5)
    raise StackError(f"the api did not answer {url} within {timeout_s:.0f} s; see {api.log}")


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def stop_stack(settings: Settings) -> list[StackProcess]:
    """SIGTERM every recorded process that is still the one started (workers finish their step), then SIGKILL
    what is left; a recorded pid that another process now has is never signalled."""
    processes = [p for p in read_stack(settings) if is_running(p)]
    for p in processes:
        os.killpg(p.pid, signal.SIGTERM)  # NOTE: started in a session of its own: its group is its pid
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(is_running(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in processes:
        if is_running(p):
            os.killpg(p.pid, signal.SIGKILL)
    _record_path(settings).unlink(missing_ok=True)
    return processes


def is_running(process: StackProcess) -> bool:
    """The recorded process still runs: its pid is alive, not a zombie, and started when it was recorded."""
    ticks = _start_ticks(process.pid)
    if ticks is None:
        return False
    return process.start_ticks is None or ticks == process.start_ticks


def _start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (/proc/<pid>/stat, field 22); None when no process
    has the pid or it is a zombie (exited, not yet reaped: gone for our purposes)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


# --- what runs: `servelab status` ---


@dataclass(frozen=True)
class ProcessStatus:
    process: StackProcess
    is_running: bool
    answers: bool | None = None  # the api's health URL; None for the others


@dataclass(frozen=True)
class ServerStatus:
    kind: str  # "redis" or "postgres"
    url: str | None  # password hidden; None when none is set or recorded
    is_embedded: bool
    pid: int | None
    answers: bool
    error: str | None = None


@dataclass(frozen=True)
class WorkerStatus:
    name: str
    serving_config_name: str
    config_hash: str
    device: str
    heartbeat_at: datetime
    seconds_since_heartbeat: float
    is_live: bool
    service: str | None  # the local stack's process it is, if any
    kernel: str | None = None  # the decoder and kernels serving its weights
    decoder_reason: str | None = None  # why transformers' forward serves its model, and the cost; None: servelab's


@dataclass(frozen=True)
class StackStatus:
    processes: tuple[ProcessStatus, ...]
    servers: tuple[ServerStatus, ...]
    workers: tuple[WorkerStatus, ...]
    queue_depths: dict[str, dict[str, int]] = field(default_factory=dict)  # config -> stream kind -> entries
    problems: tuple[str, ...] = ()

    @property
    def is_up(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "is_up": self.is_up, "problems": list(self.problems),
            "processes": [{**asdict(s.process), "is_running": s.is_running, "answers": s.answers}
                          for s in self.processes],
            "servers": [asdict(s) for s in self.servers],
            "workers": [{**asdict(w), "heartbeat_at": w.heartbeat_at.isoformat()} for w in self.workers],
            "queue_depths": self.queue_depths,
        }


def stack_status(settings: Settings, *, now: datetime, live_s: float) -> StackStatus:
    """What runs, read without starting or migrating anything: the local stack's processes, Redis and
    PostgreSQL (the URLs set, else the embedded servers recorded), the workers' heartbeats, the queues."""
    processes = tuple(_process_status(p) for p in read_stack(settings))
    embedded = recorded_servers(settings)
    redis_status, client = _peek_redis(_url(settings.redis_url, embedded.get("redis")), embedded.get("redis"))
    pg_status, engine = _peek_postgres(_url(settings.database_url, embedded.get("pg")), embedded.get("pg"))
    workers: tuple[WorkerStatus, ...] = ()
    depths: dict[str, dict[str, int]] = {}
    try:
        if engine is not None:
            workers = _workers(sessionmaker(bind=engine), processes, now=now, live_s=live_s)
        if client is not None:
            depths = stream_depths(client, prefix=settings.key_prefix,
                                   config_names=sorted({w.serving_config_name for w in workers}))
    finally:
        if client is not None:
            client.close()
        if engine is not None:
            engine.dispose()
    servers = (redis_status, pg_status)
    return StackStatus(processes, servers, workers, depths, _problems(processes, servers, workers))


def _process_status(process: StackProcess) -> ProcessStatus:
    running = is_running(process)
    answers = _answers(process.health_url) if running and process.health_url else None
    return ProcessStatus(process, running, answers)


def _url(configured: str | None, embedded: tuple[EmbeddedServer, bool] | None) -> str | None:
    """The URL set in Settings, else the recorded embedded server's while it runs."""
    if configured is not None:
        return configured
    return embedded[0].url if embedded is not None and embedded[1] else None


def _server(kind: str, url: str | None, embedded: tuple[EmbeddedServer, bool] | None, *, answers: bool,
            error: str | None = None) -> ServerStatus:
    server = embedded[0] if embedded is not None else None
    is_embedded = server is not None and url == server.url
    if url is None:
        variable = "SERVELAB_REDIS_URL" if kind == "redis" else "SERVELAB_DATABASE_URL"
        error = (f"the embedded {kind} (pid {server.pid}) is not running" if server is not None
                 else f"{variable} is not set and no embedded {kind} was started here")
    shown = make_url(url).render_as_string(hide_password=True) if url else None
    return ServerStatus(kind, shown, is_embedded, server.pid if is_embedded else None, answers, error)


def _peek_redis(url: str | None, embedded) -> tuple[ServerStatus, redis.Redis | None]:
    if url is None:
        return _server("redis", None, embedded, answers=False), None
    client = redis.Redis.from_url(url, socket_timeout=PEEK_TIMEOUT_S, socket_connect_timeout=PEEK_TIMEOUT_S)
    try:
        client.ping()
    except redis.RedisError as exc:
        client.close()
        return _server("redis", url, embedded, answers=False, error=f"{type(exc).__name__}: {exc}"), None
    return _server("redis", url, embedded, answers=True), client


def _peek_postgres(url: str | None, embedded) -> tuple[ServerStatus, Engine | None]:
    if url is None:
        return _server("postgres", None, embedded, answers=False), None
    engine = create_engine(sqlalchemy_url(url), connect_args={"connect_timeout": int(PEEK_TIMEOUT_S)})
    try:
        with engine.connect():
            pass
    except SQLAlchemyError as exc:
        engine.dispose()
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        return _server("postgres", url, embedded, answers=False, error=reason), None
    return _server("postgres", url, embedded, answers=True), engine


def _workers(sessions: sessionmaker, processes: tuple[ProcessStatus, ...], *, now: datetime,
             live_s: float) -> tuple[WorkerStatus, ...]:
    # NOTE: a worker's default name is <host>-<pid> (servelab.serving.default_worker_name), so a running
    # gpu-worker process is found by its pid; a dead one's row stays behind, not live and no one's.
    host = socket.gethostname()
    by_name = {f"{host}-{s.process.pid}": s.process.name for s in processes
               if s.is_running and s.process.name.startswith("gpu-worker")}
    try:
        with sessions() as session:
            rows = queries.workers(session, now=now)
    except SQLAlchemyError:
        return ()  # NOTE: a database without the schema yet: no worker has registered
    return tuple(WorkerStatus(w.name, w.serving_config_name, w.config_hash, w.device, w.heartbeat_at,
                              w.seconds_since_heartbeat, w.seconds_since_heartbeat <= live_s, by_name.get(w.name),
                              w.kernel, w.decoder_reason)
                 for w in rows)


def _problems(processes: tuple[ProcessStatus, ...], servers: tuple[ServerStatus, ...],
              workers: tuple[WorkerStatus, ...]) -> tuple[str, ...]:
    problems = [f"{s.kind}: {s.error or 'does not answer'}" for s in servers if not s.answers]
    for s in processes:
        p = s.process
        if not s.is_running:
            problems.append(f"{p.name} (pid {p.pid}) is not running: `servelab up` starts it again; log {p.log}")
        elif s.answers is False:
            problems.append(f"{p.name} (pid {p.pid}) does not answer {p.health_url}; log {p.log}")
    for w in workers:
        if w.service is not None and not w.is_live:
            problems.append(f"{w.service} (worker {w.name}) last beat {w.seconds_since_heartbeat:.0f} s ago")
    if not processes and not any(s.answers for s in servers):
        problems.append("nothing runs here: `servelab up` starts the local stack")
    return tuple(problems)
