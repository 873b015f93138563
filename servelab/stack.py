"""The local stack: the service processes of docker-compose.yml, started on this machine in the background.

Knows how to start the api, jobs-worker, beat and one gpu-worker per config as detached processes with
logs under the state folder, record their pids, wait until the API answers, and stop exactly the
processes it started. Does not know what they do; the embedded servers are servelab/embedded.py's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from servelab.settings import Settings

REPO = Path(__file__).resolve().parents[1]
STOP_TIMEOUT_S = 30.0


class StackError(RuntimeError):
    """A stack process that did not start; the message names it and its log."""


@dataclass(frozen=True)
class StackProcess:
    name: str
    pid: int
    log: str


def _record_path(settings: Settings) -> Path:
    return Path(settings.state_dir) / "stack.json"


def read_stack(settings: Settings) -> list[StackProcess]:
    path = _record_path(settings)
    if not path.is_file():
        return []
    return [StackProcess(**p) for p in json.loads(path.read_text())]


def start_stack(settings: Settings, *, env: dict[str, str], config_paths: list[Path], api_port: int) -> list[StackProcess]:
    """Start the api, jobs-worker, beat and a gpu-worker per config; returns what runs (started or already up)."""
    running = [p for p in read_stack(settings) if _is_alive(p.pid)]
    if running:
        return running
    logs = Path(settings.state_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    commands = {
        "api": ["-m", "servelab.cli", "api", "--port", str(api_port)],
        "jobs-worker": ["-m", "worker.jobs", "worker", "--concurrency=2", "--loglevel=INFO"],
        "beat": ["-m", "worker.jobs", "beat", "--loglevel=INFO"],
        **{f"gpu-worker-{path.stem}": ["-m", "worker.gpu", str(path.resolve())] for path in config_paths},
    }
    started = [_spawn(name, args, env, logs) for name, args in commands.items()]
    _record_path(settings).write_text(json.dumps([asdict(p) for p in started], indent=2))
    _wait_for_api(f"http://127.0.0.1:{api_port}/healthz", started[0])
    return started


def _spawn(name: str, args: list[str], env: dict[str, str], logs: Path) -> StackProcess:
    log = logs / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env={**os.environ, **env}, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return StackProcess(name, proc.pid, str(log))


def _wait_for_api(url: str, api: StackProcess, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _is_alive(api.pid):
            raise StackError(f"the api exited while starting; see {api.log}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise StackError(f"the api did not answer {url} within {timeout_s:.0f} s; see {api.log}")


def stop_stack(settings: Settings) -> list[StackProcess]:
    """SIGTERM every recorded process (workers finish their batch), then SIGKILL what is left."""
    processes = [p for p in read_stack(settings) if _is_alive(p.pid)]
    for p in processes:
        os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(_is_alive(p.pid) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in processes:
        if _is_alive(p.pid):
            os.killpg(p.pid, signal.SIGKILL)
    _record_path(settings).unlink(missing_ok=True)
    return processes


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # NOTE: a stopped child nobody reaped is a zombie: it answers kill(0) but is gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True
