"""`servelab bench api`: POST /v1/requests at a front end's rate: submissions/s, p50 and p99 from api processes
this bench starts, from this checkout and (where given) a baseline checkout, side by side in one run.

Knows how to start `servelab api` from a checkout, configured by SERVELAB_* variables only, against this
machine's servers: a key prefix of its own (no worker reads its streams: the submissions only queue), a
tenant and key of its own, and a queue limit the run cannot reach; and how to remove what a run made
afterwards (the tenant's rows, key and counter, the prefix's Redis keys, a baseline's scratch database: a
baseline's schema lacks this checkout's migrations, so it gets a database of its own). Does not print.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from sqlalchemy.engine import make_url

from servelab.lab.load import Load, LoadResult, run_load
from servelab.runtime import Runtime
from servelab.store import keys
from servelab.store.db import drop_database, ensure_database, make_engine, session_factory, session_scope

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
PROMPT = "Write one sentence about the sea."


@dataclass(frozen=True)
class ApiUnderTest:
    """An api to start: a checkout's code, with a number of processes behind its port."""

    label: str
    checkout: Path
    num_processes: int
    is_baseline: bool = False


@dataclass(frozen=True)
class ApiBenchRow:
    api: ApiUnderTest
    results: tuple[LoadResult, ...]  # one per round

    @property
    def submissions_per_s(self) -> float:
        return statistics.median(r.requests_per_s for r in self.results)

    @property
    def p50_ms(self) -> float:
        return statistics.median(r.percentile_ms(50) for r in self.results)

    @property
    def p99_ms(self) -> float:
        return statistics.median(r.percentile_ms(99) for r in self.results)

    @property
    def num_errors(self) -> int:
        return sum(r.num_errors for r in self.results)

    @property
    def first_error(self) -> str | None:
        return next((r.first_error for r in self.results if r.first_error), None)


@dataclass(frozen=True)
class Shape:
    """The load: how many connections in how many client processes send how many submissions of which model."""

    model: str
    num_clients: int
    num_requests: int
    num_load_processes: int
    num_warmup: int


@dataclass(frozen=True)
class _Running:
    api: ApiUnderTest
    url: str
    key: str


def submission_load(url: str, key: str, shape: Shape, *, num_requests: int | None = None) -> Load:
    body = json.dumps({"config": shape.model, "prompt": PROMPT, "sampling": {"max_new_tokens": 1}}).encode()
    headers = (("Authorization", f"Bearer {key}"), ("Content-Type", "application/json"))
    return Load(url, "POST", "/v1/requests", body, headers, shape.num_clients,
                shape.num_requests if num_requests is None else num_requests, shape.num_load_processes)


def ceiling_load(url: str, shape: Shape) -> Load:
    """The same clients against GET /healthz: what the load generator (and the server's bare framework) reach."""
    return Load(url, "GET", "/healthz", b"", (), shape.num_clients, shape.num_requests, shape.num_load_processes)


def run_api_bench(runtime: Runtime, apis: list[ApiUnderTest], shape: Shape, *, num_rounds: int,
                  progress: Callable[[str], None]) -> tuple[list[ApiBenchRow], LoadResult]:
    """Start every api, then run the load against each in turn, round after round (so drift on a shared machine
    falls on all alike); -> a row per api, and the load generator against the last api's /healthz."""
    bench_id = uuid.uuid4().hex[:8]
    prefix = f"{runtime.settings.key_prefix}-bench-{bench_id}"
    with ExitStack() as stack:
        stack.callback(_delete_redis_keys, runtime, prefix)
        running = [stack.enter_context(_api(runtime, api, shape, prefix=prefix, bench_id=bench_id, progress=progress))
                   for api in apis]
        results: dict[int, list[LoadResult]] = {i: [] for i in range(len(running))}
        for round_no in range(1, num_rounds + 1):
            for i, r in enumerate(running):
                progress(f"round {round_no}/{num_rounds}: {r.api.label}, {r.api.num_processes} process(es)")
                run_load(submission_load(r.url, r.key, shape, num_requests=shape.num_warmup))
                results[i].append(run_load(submission_load(r.url, r.key, shape)))
        progress("the load generator against GET /healthz")
        ceiling = run_load(ceiling_load(running[-1].url, shape))
    return [ApiBenchRow(r.api, tuple(results[i])) for i, r in enumerate(running)], ceiling


def drive(url: str, key: str, shape: Shape, *, num_rounds: int) -> tuple[ApiBenchRow, LoadResult]:
    """The load against an api already running (the local stack): nothing started, nothing removed."""
    api = ApiUnderTest(url, Path("."), 0)
    results = []
    for _ in range(num_rounds):
        run_load(submission_load(url, key, shape, num_requests=shape.num_warmup))
        results.append(run_load(submission_load(url, key, shape)))
    return ApiBenchRow(api, tuple(results)), run_load(ceiling_load(url, shape))


@contextmanager
def _api(runtime: Runtime, api: ApiUnderTest, shape: Shape, *, prefix: str, bench_id: str,
         progress: Callable[[str], None]) -> Iterator[_Running]:
    """The api started from its checkout, with a tenant of the bench's own; everything removed afterwards."""
    database_url = runtime.urls.database_url
    if api.is_baseline:
        database_url = make_url(database_url).set(database=f"servelab_bench_baseline_{bench_id}").render_as_string(
            hide_password=False)
        ensure_database(database_url)
    tenant = f"bench-{bench_id}"
    port = _free_port()
    env = {**os.environ, "SERVELAB_DATABASE_URL": database_url, "SERVELAB_REDIS_URL": runtime.urls.redis_url,
           "SERVELAB_KEY_PREFIX": prefix, "SERVELAB_API_WORKERS": str(api.num_processes),
           "SERVELAB_MAX_QUEUED_REQUESTS": str(10 * (shape.num_requests + shape.num_warmup) + 1_000),
           "SERVELAB_STATE_DIR": str(Path(runtime.settings.state_dir).resolve())}
    log = Path(runtime.settings.state_dir) / "logs" / f"bench-api-{bench_id}-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    progress(f"starting the api of {api.checkout} ({api.num_processes} process(es)) on port {port}; log {log}")
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "servelab.cli", "api", "--host", "127.0.0.1", "--port", str(port),
             "--workers", str(api.num_processes)], cwd=api.checkout, env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
    engine = make_engine(database_url)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until_up(process, url, log)
        with session_scope(session_factory(engine)) as session:
            key = keys.create_key(session, tenant=tenant)
        yield _Running(api, url, key)
    finally:
        _stop(process)
        if api.is_baseline:
            engine.dispose()
            drop_database(database_url)
        else:
            with session_scope(session_factory(engine)) as session:
                keys.delete_tenant(session, tenant=tenant)
            engine.dispose()


def _wait_until_up(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-2_000:]
            raise RuntimeError(f"the api exited while starting (status {process.returncode}); {log} ends:\n{tail}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the api did not answer {url}/healthz within {START_TIMEOUT_S:.0f} s")


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the api's process group (its worker processes too), SIGKILL if it lingers."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _delete_redis_keys(runtime: Runtime, prefix: str) -> None:
    found = list(runtime.redis.scan_iter(match=f"{prefix}:*", count=1_000))
    for i in range(0, len(found), 1_000):
        runtime.redis.delete(*found[i:i + 1_000])
