"""/metrics across api processes: real uvicorn processes sharing a metrics folder report the true total, and
`servelab api` starts its processes on an emptied folder. Submissions go to a config no worker serves: they
queue, which is all these tests count."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from servelab.runtime import connect
from servelab.settings import ServiceSettings
from servelab.store import keys
from servelab.store.db import session_scope
from tests.api.conftest import _free_port
from tests.conftest import REPO
from tests.jobs.conftest import service_env, service_settings_for

ACCEPTED = re.compile(r'^servelab:submissions_total\{endpoint="/v1/requests",model_name="fp32",outcome="accepted"\} '
                      r'(\S+)$', re.M)


@pytest.fixture
def api_settings(service_settings, tmp_path: Path) -> ServiceSettings:
    # NOTE: room for every submission the tests below may send (up to 420): none of them must meet the queue's limit
    return service_settings_for(service_settings, metrics_dir=tmp_path / "metrics", max_queued_requests=500)


@pytest.fixture
def key(api_settings: ServiceSettings) -> str:
    runtime = connect(api_settings, migrate=False)
    try:
        with session_scope(runtime.sessions) as session:
            return keys.create_key(session, tenant="metrics")
    finally:
        runtime.close()


@contextmanager
def started(argv: list[str], settings: ServiceSettings, port: int) -> Iterator[str]:
    """A process serving the api on port (configured through SERVELAB_* variables only); -> its base URL."""
    process = subprocess.Popen([sys.executable, *argv], cwd=REPO, env=service_env(settings))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, f"{argv} exited"
            assert time.monotonic() < deadline, f"{argv} did not start"
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def uvicorn_process(settings: ServiceSettings):
    port = _free_port()
    return started(["-m", "uvicorn", "--factory", "api.app:build", "--host", "127.0.0.1", "--port", str(port),
                    "--log-level", "warning"], settings, port)


def submit(url: str, key: str, n: int) -> None:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
        for i in range(n):
            answer = client.post("/v1/requests", json={"config": "fp32", "prompt": f"hi {i}",
                                                       "sampling": {"max_new_tokens": 1}})
            assert answer.status_code == 202, answer.text


def submit_apart(url: str, key: str, n: int) -> None:
    """n submissions, each over its own connection, eight at a time: the processes behind the port share them."""
    def post(i: int) -> None:
        answer = httpx.post(f"{url}/v1/requests", headers={"Authorization": f"Bearer {key}", "Connection": "close"},
                            json={"config": "fp32", "prompt": f"hi {i}", "sampling": {"max_new_tokens": 1}},
                            timeout=30)
        assert answer.status_code == 202, answer.text

    with ThreadPoolExecutor(8) as clients:
        list(clients.map(post, range(n)))


def accepted_by_process(metrics_dir: Path) -> dict[str, float]:
    """Accepted submissions as each process wrote them to its own file (pid -> count), files with any."""
    from prometheus_client.mmap_dict import MmapedDict

    counts = {}
    for path in metrics_dir.glob("counter_*.db"):
        values = MmapedDict.read_all_values_from_file(str(path))
        total = sum(value for key, value, *_ in values if json.loads(key)[1] == "servelab:submissions_total"
                    and json.loads(key)[2].get("outcome") == "accepted")
        if total:
            counts[path.stem.removeprefix("counter_")] = total
    return counts


def accepted(url: str) -> float:
    match = ACCEPTED.search(httpx.get(f"{url}/metrics", timeout=30).text)
    return float(match.group(1)) if match else 0.0


def test_two_api_processes_sharing_the_metrics_folder_each_report_the_true_total(api_settings, key) -> None:
    from servelab.telemetry import prepare_files_dir

    prepare_files_dir(api_settings.metrics_dir)
    with uvicorn_process(api_settings) as first, uvicorn_process(api_settings) as second:
        submit(first, key, 7)
        submit(second, key, 5)
        assert (accepted(first), accepted(second)) == (12, 12)  # alone, each would say 7 and 5
    with uvicorn_process(api_settings) as third:  # the first two exited: what they counted still counts
        submit(third, key, 1)
        assert accepted(third) == 13


def test_servelab_api_with_two_processes_counts_every_submission_once_and_none_of_an_earlier_run(
        api_settings, key) -> None:
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    api_settings.metrics_dir.mkdir(parents=True)
    earlier = MmapedDict(str(api_settings.metrics_dir / "counter_999999.db"))  # a process of an earlier run
    labels = {"model_name": "fp32", "endpoint": "/v1/requests", "outcome": "accepted"}
    earlier.write_value(mmap_key("servelab:submissions", "servelab:submissions_total", list(labels),
                                 list(labels.values()), "earlier"), 100.0, 0.0)
    earlier.close()
    port = _free_port()
    with started(["-m", "servelab.cli", "api", "--port", str(port), "--workers", "2"], api_settings, port) as url:
        num_sent = 0
        while len(by_process := accepted_by_process(api_settings.metrics_dir)) < 2:
            # NOTE: the kernel hands connections to either process; more of them until both have served some
            assert num_sent < 400, f"one process took every connection: {by_process}"
            submit_apart(url, key, 20)
            num_sent += 20
        assert sum(by_process.values()) == num_sent
        assert accepted(url) == num_sent  # not 100 more: the earlier run's counts were emptied before the start
