"""The API on the jobs tests' stack: an in-process client, and the real api process on a free port."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from tests.conftest import REPO
from tests.jobs.conftest import (  # noqa: F401 (fixtures)
    Stack,
    bundled_folder,
    control_plane,
    jobs_worker,
    make_served,
    make_stack,
    module_stack,
    service_env,
    settings,
    stack,
    tiny_engine,
    tiny_folder,
)


def client_for(stack: Stack, key: str | None = None) -> TestClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return TestClient(create_app(stack.runtime, stack.settings), headers=headers, raise_server_exceptions=False)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def api_process(stack: Stack, started: list[subprocess.Popen] | None = None) -> Iterator[str]:
    """The real api process (uvicorn --factory api.app:build) on a free port, configured only through SERVELAB_*
    variables; -> its base URL (the process is appended to `started`, for a test that kills it).

    NOTE: a subprocess, so the test goes through the real entry point and its Settings.
    """
    port = _free_port()
    env = service_env(stack.settings)
    process = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "api.app:build", "--host", "127.0.0.1",
                                "--port", str(port), "--log-level", "warning"], cwd=REPO, env=env)
    if started is not None:
        started.append(process)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, "the api process exited"
            assert time.monotonic() < deadline, "the api process did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(timeout=15)


@pytest.fixture
def served_api(jobs_worker: Stack) -> Iterator[str]:
    """The real api process beside an in-thread GPU worker and jobs-worker; -> its base URL."""
    with api_process(jobs_worker) as url:
        yield url


@pytest.fixture(scope="module")
def module_api(module_stack: Stack) -> Iterator[str]:  # noqa: F811
    """The real api process beside the module's stack, for the whole module; -> its base URL."""
    with api_process(module_stack) as url:
        yield url


@pytest.fixture(scope="module")
def module_served_api(module_stack: Stack) -> Iterator[str]:  # noqa: F811
    """The real api, jobs-worker and beat processes beside the module's stack, for the whole module; -> the api's
    base URL."""
    with control_plane(module_stack), api_process(module_stack) as url:
        yield url
