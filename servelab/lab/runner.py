"""A run: one config on one workload, served by a real worker process through the real queue, stored.

Knows how to start a gpu-worker process for the config (one per config, warmed up, shared by its
repeats), replay the workload's arrival
schedule from client threads, wait for every request, and store the run with its config, hardware,
software, every request it sent and the aggregates. Does not judge: servelab/lab/compare.py does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import select

from servelab.config import ServingConfig
from servelab.hardware import software_versions
from servelab.lab import runsets
from servelab.analysis.metrics import RunSummary, summarise_run
from servelab.analysis.workload import Workload, WorkloadItem
from servelab.queue.streams import RequestStreams, wait_done
from servelab.queue.submit import submit_request
from servelab.runtime import Runtime
from servelab.store import runs as store
from servelab.store.db import session_scope
from servelab.store.models import StreamKind, WorkerRow

REPO = Path(__file__).resolve().parents[2]
WORKER_START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 3600.0
LIVE_WORKER_S = 20.0  # a worker whose heartbeat is this recent is live (workers beat every 5 s)


class RunError(RuntimeError):
    """A run that could not be carried out; the message says which step and why."""


@dataclass(frozen=True)
class RunOutcome:
    run_id: str
    summary: RunSummary
    request_ids: tuple[str, ...]
    worker_name: str
    kernel: str


def spawn_worker(config_path: Path, env: dict[str, str], log: BinaryIO) -> subprocess.Popen:
    """`python -m worker.gpu CONFIG` with this environment, its output (stdout and stderr) into the log."""
    return subprocess.Popen([sys.executable, "-m", "worker.gpu", str(config_path)], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)


class WorkerProcess:
    """A `python -m worker.gpu CONFIG` process pointed at this runtime's Redis, Postgres and key prefix."""

    def __init__(self, config_path: Path, runtime: Runtime, name: str) -> None:
        self.config_path, self.runtime, self.name = config_path, runtime, name
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(runtime.settings.state_dir) / "logs" / f"{name}.log"

    def __enter__(self) -> WorkerProcess:
        self.launch()
        self.wait_registered()
        return self

    def launch(self) -> None:
        """Start the process without waiting for it (start_workers starts several at once, then waits)."""
        s = self.runtime.settings
        env = {**os.environ, "SERVELAB_REDIS_URL": self.runtime.urls.redis_url,
               "SERVELAB_DATABASE_URL": self.runtime.urls.database_url, "SERVELAB_KEY_PREFIX": s.key_prefix,
               "SERVELAB_CACHE_DIR": str(Path(s.cache_dir).resolve()), "SERVELAB_WORKER_NAME": self.name}
        if s.num_threads:
            env["SERVELAB_NUM_THREADS"] = str(s.num_threads)
        # NOTE: the worker's output (its log, libraries' progress bars) goes to its own file, never to this
        # process's stdout (the lab commands' data, --json) or to the console a user reads the verdict on
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = spawn_worker(self.config_path.resolve(), env, log)

    def wait_registered(self) -> None:
        """Until the worker has loaded its model and registered (its hardware row), or a RunError."""
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RunError(f"worker for {self.config_path} exited with code {self.proc.returncode} while starting; "
                               f"its output: {self.log_path}{self._last_lines()}")
            if self.hardware() is not None:
                return
            time.sleep(0.2)
        raise RunError(f"worker for {self.config_path} did not start within {WORKER_START_TIMEOUT_S:.0f} s; "
                       f"its output: {self.log_path}{self._last_lines()}")

    def _last_lines(self, count: int = 5) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-count:]
        except OSError:
            return ""
        return "".join(f"\n  {line}" for line in lines)

    def hardware(self) -> dict | None:
        with session_scope(self.runtime.sessions) as session:
            return session.scalar(select(WorkerRow.hardware).where(WorkerRow.name == self.name))

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()  # NOTE: SIGTERM: the worker finishes the batch in hand, then exits
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_together(stack: ExitStack, workers: Sequence[WorkerProcess]) -> None:
    """Launch every worker, then wait for each to register; each is stopped when the stack closes, whichever
    start fails. NOTE: their imports overlap; on a CPU they load and measure one at a time (measured_alone)."""
    for worker in workers:
        stack.push(worker)
        worker.launch()
    for worker in workers:
        worker.wait_registered()


def replay(workload: Workload, *, runtime: Runtime, streams: RequestStreams) -> list[tuple[str, int, float | None]]:
    """Send every item on the workload's schedule and wait for all; -> (request id, item index, offset ms)."""
    spec = workload.spec
    start = time.monotonic()

    def send(item: WorkloadItem) -> tuple[str, int, float | None]:
        if item.offset_s is not None:
            time.sleep(max(0.0, start + item.offset_s - time.monotonic()))
        request_id = submit_request(
            sessions=runtime.sessions, streams=streams, prompt=item.prompt,
            kind=StreamKind.BULK if item.is_bulk else StreamKind.INTERACTIVE,
            messages=list(item.messages) if item.messages else None, sampling=item.sampling(spec),
        )
        if not wait_done(runtime.redis, prefix=streams.prefix, request_id=request_id, timeout_s=REQUEST_TIMEOUT_S):
            raise RunError(f"request {request_id} (workload item {item.index}) did not finish in time")
        return request_id, item.index, None if item.offset_s is None else item.offset_s * 1e3

    num_threads = spec.arrival.num_clients if spec.arrival.process == "closed" else len(workload.items)
    # NOTE: open-loop: one thread per request, so a slow server never delays the next arrival.
    with ThreadPoolExecutor(max_workers=max(1, min(num_threads, 512))) as pool:
        return list(pool.map(send, workload.items))


def start_worker(config: ServingConfig, config_path: Path, runtime: Runtime) -> WorkerProcess:
    """A fresh worker process for the config; use it as a context manager (it stops on exit).

    NOTE: a run measures its own worker only: another live worker on the config's streams would take
    part of the workload, so the run is refused rather than measured wrong.
    """
    with session_scope(runtime.sessions) as session:
        live = session.scalars(select(WorkerRow.name).where(
            WorkerRow.serving_config_name == config.name,
            WorkerRow.heartbeat_at > datetime.now(UTC) - timedelta(seconds=LIVE_WORKER_S))).all()
    if live:
        raise RunError(f"worker {live[0]} already serves config {config.name!r}: a run must own its config's "
                       "streams; stop that worker (servelab down) or give the run's config another name")
    return WorkerProcess(config_path, runtime, f"lab-{config.name}-{uuid.uuid4().hex[:8]}")


def warm_up(worker: WorkerProcess, config: ServingConfig, workload: Workload) -> None:
    """One request first, so the measured runs do not pay for lazy initialisation in the worker."""
    streams = RequestStreams(worker.runtime.redis, prefix=worker.runtime.settings.key_prefix, config_name=config.name)
    item = workload.items[0]
    request_id = submit_request(sessions=worker.runtime.sessions, streams=streams, prompt=item.prompt,
                                messages=list(item.messages) if item.messages else None,
                                sampling=replace(item.sampling(workload.spec), max_new_tokens=2))
    if not wait_done(worker.runtime.redis, prefix=streams.prefix, request_id=request_id, timeout_s=REQUEST_TIMEOUT_S):
        raise RunError(f"the warm-up request to {config.name} did not finish")


def run_workload(*, workload: Workload, config: ServingConfig, worker: WorkerProcess, plan_name: str | None = None,
                 repeat_index: int = 0, progress=lambda message: None) -> RunOutcome:
    """Replay the workload against a started worker for this config, then store and return the run."""
    runtime = worker.runtime
    streams = RequestStreams(runtime.redis, prefix=runtime.settings.key_prefix, config_name=config.name)
    progress(f"replaying {workload.name} ({len(workload.items)} requests, {workload.spec.arrival.process})")
    started_at = datetime.now(UTC)
    sent = replay(workload, runtime=runtime, streams=streams)
    finished_at = datetime.now(UTC)
    request_ids = [rid for rid, _, _ in sent]
    hardware = worker.hardware()
    with session_scope(runtime.sessions) as session:
        summary = summarise_run(runsets.request_samples(session, request_ids=request_ids),
                                runsets.batch_samples(session, request_ids=request_ids),
                                slo=workload.spec.slo, price_per_hour=runtime.settings.price_per_hour,
                                kv_pool_blocks=(hardware or {}).get("kv_pool_blocks"))
        run_id = store.record_run(
            session, config=config.model_dump(mode="json"), config_hash=config.config_hash,
            workload_name=workload.name, workload_fingerprint=workload.fingerprint,
            workload=workload.spec.model_dump(mode="json"), hardware=hardware, software=software_versions(),
            worker_name=worker.name, started_at=started_at, finished_at=finished_at,
            summary=summary.as_dict(), sent=sent, plan_name=plan_name, repeat_index=repeat_index,
        )
    return RunOutcome(run_id, summary, tuple(request_ids), worker.name, hardware.get("kernel", "unknown"))
