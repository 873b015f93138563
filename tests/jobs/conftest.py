"""A whole control plane for the tests: a tiny-model GPU worker in a thread, registered like a real one,
ServiceSettings and a Runtime on the tests' PostgreSQL and Redis, and (on request) the real jobs-worker
and beat processes, sweeping every few hundred milliseconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from servelab.engine.engine import Engine
from servelab.scheduler.policy import BatchPolicy
from servelab.runtime import Runtime, connect
from servelab.serving import FaultPolicy
from servelab.settings import ServiceSettings
from servelab.store import keys
from servelab.store import requests as request_store
from servelab.store.batch_jobs import ACTIVE
from servelab.store.db import session_scope
from servelab.store.models import BatchJobRow, BatchStatus
from tests.conftest import new_key_prefix, redis_for, settings_for
from tests.queue.conftest import Served, make_served, serving_workers  # noqa: F401 (fixtures)
from tests.engine.conftest import (  # noqa: F401 (fixtures)
    bundled_folder,
    make_config,
    settings,
    tiny_engine,
    tiny_folder,
)

REPO = Path(__file__).resolve().parents[2]
LIMITS = dict(max_prompt_chars=2_000, max_request_bytes=64_000, max_file_bytes=2_000_000, max_batch_lines=5_000,
              max_queued_requests=50, max_job_in_flight=200, max_wait_s=60.0, jobs_poll_s=0.3)


@dataclass
class Stack:
    settings: ServiceSettings
    runtime: Runtime
    served: Served | None = None
    extra: dict = field(default_factory=dict)

    @property
    def model(self) -> str:
        assert self.served is not None, "this stack has no worker"
        return self.served.streams.config_name

    def key(self, tenant: str) -> str:
        with session_scope(self.runtime.sessions) as session:
            return keys.create_key(session, tenant=tenant)


def register(served: Served, tiny_engine) -> None:
    """What run_worker does before serving: save the config served, under the streams' name, and register."""
    config = tiny_engine.config.model_copy(update={"name": served.streams.config_name})
    with session_scope(served.sessions) as session:
        request_store.save_serving_config(session, config=config)
        request_store.register_worker(session, name=served.worker.name, serving_config_name=config.name,
                                      config_hash=config.config_hash, hardware={}, software={})


def service_settings_for(service_settings, **overrides) -> ServiceSettings:
    return ServiceSettings(**{**service_settings.model_dump(), "configs_dir": REPO / "configs", **LIMITS,
                              **overrides})


@contextmanager
def stacks(service_settings, make_served, model) -> Iterator:
    """-> make(with_worker=, policy=, faults=, **overrides): a Stack, its worker (on `model`) started; at the end every
    batch job left active is failed and every runtime closed."""
    runtimes: list[Runtime] = []

    def make(*, with_worker: bool = True, policy: BatchPolicy | None = None, faults: FaultPolicy | None = None,
             **overrides) -> Stack:
        service = service_settings_for(service_settings, **overrides)
        runtime = connect(service, migrate=False)
        runtimes.append(runtime)
        served = None
        if with_worker:
            served = make_served(policy or BatchPolicy(max_batch_size=32, max_wait_ms=5, max_batch_tokens=100_000),
                                 faults or FaultPolicy(renew_every_s=0.2))
            register(served, model)
            served.start()
        return Stack(service, runtime, served)

    yield make
    for runtime in runtimes:
        fail_active_jobs(runtime.sessions)
        runtime.close()


def fail_active_jobs(sessions, *, tenant: str | None = None) -> None:
    """Every batch job left active (of `tenant`, else of anyone) failed. The database is the whole test session's:
    a job left running would be read by the next feed in the process, beside that test's own jobs."""
    where = [BatchJobRow.status.in_(ACTIVE)] + ([BatchJobRow.tenant == tenant] if tenant is not None else [])
    with session_scope(sessions) as session:
        session.execute(update(BatchJobRow).where(*where).values(status=BatchStatus.FAILED))


@pytest.fixture
def make_stack(service_settings, make_served, tiny_engine) -> Iterator:  # noqa: F811
    with stacks(service_settings, make_served, tiny_engine) as make:
        yield make


@pytest.fixture
def stack(make_stack) -> Stack:
    return make_stack()


@pytest.fixture(scope="module")
def module_stack(database_url, engine, tiny_folder, settings, tmp_path_factory) -> Iterator[Stack]:  # noqa: F811
    """One stack, its worker running, for a module's tests that each send and read back only their own requests,
    files and jobs: its setup, and the processes a module starts beside it, are paid once per module, not per
    test. Its worker decodes on an engine of its own, so the session's tiny engine stays free for the module's
    other tests (a worker of their own, a reference decoding)."""
    key_prefix = new_key_prefix()
    model = Engine.from_config(make_config(str(tiny_folder)), settings)
    with redis_for(key_prefix) as client, serving_workers(model, engine, client, key_prefix) as make_served, \
            stacks(settings_for(database_url, key_prefix, tmp_path_factory.mktemp("state")), make_served,
                   model) as make:
        yield make()


def service_env(service: ServiceSettings) -> dict[str, str]:
    """The settings as the SERVELAB_* variables a process entry point reads."""
    values = {f"SERVELAB_{k.upper()}": str(v) for k, v in service.model_dump().items() if v is not None}
    return {**os.environ, **values}


@contextmanager
def control_plane(stack: Stack) -> Iterator[Stack]:
    """The real jobs-worker and beat processes (python -m worker.jobs worker / beat) for this stack.

    NOTE: processes, not Celery's in-thread test worker: after one in-thread worker had run in a process, a
    later one sometimes received no tasks (Celery caches broker connections per process).
    """
    env = service_env(stack.settings)
    stack.settings.state_dir.mkdir(parents=True, exist_ok=True)
    processes = [subprocess.Popen([sys.executable, "-m", "worker.jobs", *argv], cwd=REPO, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for argv in (["worker", "--pool=threads", "--concurrency=2", "--loglevel=WARNING"],
                              ["beat", "--loglevel=WARNING"])]
    try:
        yield stack
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
def jobs_worker(stack: Stack) -> Iterator[Stack]:
    with control_plane(stack):
        yield stack


def wait_until(predicate, *, timeout_s: float = 240.0, every_s: float = 0.2, state=None):
    """Poll until predicate() is truthy; on timeout, say what state() shows (the job, the queue)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"not true within {timeout_s} s; {state() if state else ''}")


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def line(custom_id: str | None, model: str, *, prompt: str = "once upon", max_tokens: int = 3,
         url: str = COMPLETIONS) -> str:
    """A batch line; completions by default: short prompts keep the tiny model's prefill cheap."""
    import json

    body = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": prompt}]} if url == CHAT else {"prompt": prompt})
    record = {"method": "POST", "url": url, "body": body}
    if custom_id is not None:
        record["custom_id"] = custom_id
    return json.dumps(record)


def mixed_file(model: str, num_lines: int) -> tuple[bytes, set[str], dict[int, str]]:
    """A file of num_lines lines, about one in 50 bad -> (content, good custom_ids, {line_no: expected code})."""
    lines, good, bad = [], set(), {}
    kinds = ["invalid_json", "invalid_line", "duplicate_custom_id", "model_not_found", "invalid_request",
             "prompt_too_large"]
    for i in range(1, num_lines + 1):
        if i % 50 == 0:
            kind = kinds[(i // 50) % len(kinds)]
            bad[i] = kind
            lines.append({
                "invalid_json": '{"custom_id": "broken-%d", "method": "POST", ' % i,
                "invalid_line": line(None, model),  # missing custom_id
                "duplicate_custom_id": line("req-1", model),
                "model_not_found": line(f"req-{i}", "no-such-model"),
                "invalid_request": line(f"req-{i}", model, max_tokens=-4),
                "prompt_too_large": line(f"req-{i}", model, prompt="x" * 5_000),
            }[kind])
        else:
            good.add(f"req-{i}")
            lines.append(line(f"req-{i}", model, prompt=f"story {i}"))
    return ("\n".join(lines) + "\n").encode(), good, bad


def make_job(stack, content: bytes, *, tenant: str = "acme", window: timedelta = timedelta(hours=24),
             endpoint: str = COMPLETIONS):
    from datetime import UTC, datetime

    from servelab.store import batch_jobs as jobs
    from servelab.store import files

    with session_scope(stack.runtime.sessions) as session:
        f = files.create_file(session, tenant=tenant, purpose="batch", filename="in.jsonl", content=content)
        return jobs.create_job(session, tenant=tenant, endpoint=endpoint, input_file_id=f.id,
                               completion_window="24h", metadata=None, expires_at=datetime.now(UTC) + window)
