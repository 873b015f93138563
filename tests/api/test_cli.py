"""The `servelab keys`, `submit`, `results` and `health` commands against a running API, jobs-worker, beat and
worker."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import httpx
from sqlalchemy import select, update
from typer.testing import CliRunner

from servelab.cli import app
from servelab.store import keys
from servelab.store import requests as request_store
from servelab.store.db import session_scope
from servelab.store.models import ApiKeyRow, FileRow, WorkerRow
from tests.api.conftest import _free_port, api_process
from tests.conftest import REPO
from tests.jobs.conftest import line, service_env


def test_keys_create_prints_a_key_that_is_stored_only_hashed(stack) -> None:
    env = {"SERVELAB_DATABASE_URL": stack.settings.database_url, "SERVELAB_REDIS_URL": stack.settings.redis_url}
    result = CliRunner().invoke(app, ["keys", "create", "--tenant", "initech"], env=env)
    assert result.exit_code == 0, result.output
    key = result.output.strip()
    with session_scope(stack.runtime.sessions) as session:
        assert keys.tenant_of_key(session, key) == "initech"
        assert session.scalar(select(ApiKeyRow.key_hash).where(ApiKeyRow.tenant == "initech")) \
            == keys.hash_key(key) != key


def test_keys_list_shows_keys_without_them_and_revoke_by_key_or_id_stops_them(stack) -> None:
    env = {"SERVELAB_DATABASE_URL": stack.settings.database_url, "SERVELAB_REDIS_URL": stack.settings.redis_url}
    first, second = (CliRunner().invoke(app, ["keys", "create", "--tenant", "hooli"], env=env).output.strip()
                     for _ in range(2))
    listed = CliRunner().invoke(app, ["keys", "list", "--tenant", "hooli", "--json"], env=env)
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.stdout)
    assert [r["hash"] for r in rows] == [keys.hash_key(first)[:12], keys.hash_key(second)[:12]]
    assert all(r["revoked_at"] is None for r in rows) and first not in listed.stdout and second not in listed.stdout
    assert CliRunner().invoke(app, ["keys", "revoke", first], env=env).exit_code == 0
    assert CliRunner().invoke(app, ["keys", "revoke", "--id", str(rows[1]["id"])], env=env).exit_code == 0
    with session_scope(stack.runtime.sessions) as session:
        assert keys.tenant_of_key(session, first) is None and keys.tenant_of_key(session, second) is None
    again = CliRunner().invoke(app, ["keys", "revoke", first], env=env)
    assert again.exit_code == 2 and "already revoked" in again.stderr
    both = CliRunner().invoke(app, ["keys", "revoke", first, "--id", "1"], env=env)
    assert both.exit_code == 2 and "not both" in both.stderr
    table = CliRunner().invoke(app, ["keys", "list", "--tenant", "hooli"], env=env).stdout
    assert table.count("hooli") == 2 and "revoked" in table.splitlines()[0]


def test_version_is_the_installed_package_s() -> None:
    from importlib.metadata import version

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"servelab {version('servelab')}"


def test_submit_waits_for_the_batch_and_results_downloads_its_output(module_served_api, module_stack, tmp_path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([line(f"s{i}", "whatever") for i in range(12)] + ["{oops"]) + "\n")
    options = ["--api-url", module_served_api.removesuffix("/v1"), "--api-key", module_stack.key("acme")]
    submitted = CliRunner().invoke(app, ["submit", str(source), "--config", module_stack.model, *options])
    assert submitted.exit_code == 0, submitted.output
    batch_id = submitted.output.splitlines()[0]
    # NOTE: no progress bar off a terminal: stdout is the batch id and the outcome, nothing else
    assert submitted.stdout.splitlines() == [batch_id, "completed: 12 completed, 1 failed of 13"]
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    fetched = CliRunner().invoke(app, ["results", batch_id, "-o", str(out), "--errors", str(errors), *options])
    assert fetched.exit_code == 0, fetched.output
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == sorted(f"s{i}" for i in range(12))
    assert [json.loads(x)["error"]["code"] for x in errors.read_text().splitlines()] == ["invalid_json"]
    # a file this key may no longer read: the command fails with the API's message and writes no error body
    batch = httpx.get(f"{module_served_api}/batches/{batch_id}",
                      headers={"Authorization": f"Bearer {module_stack.key('acme')}"}).json()
    with session_scope(module_stack.runtime.sessions) as session:
        session.execute(update(FileRow).where(FileRow.id == batch["output_file_id"]).values(tenant="someone-else"))
    gone = tmp_path / "gone.jsonl"
    failed = CliRunner().invoke(app, ["results", batch_id, "-o", str(gone), *options])
    assert failed.exit_code == 2 and "404" in failed.stderr and not gone.exists()


def test_submit_no_wait_returns_the_batch_id_at_once(module_served_api, module_stack, tmp_path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(line("a", module_stack.model) + "\n")
    options = ["--api-url", module_served_api.removesuffix("/v1"), "--api-key", module_stack.key("acme")]
    submitted = CliRunner().invoke(app, ["submit", str(source), "--no-wait", *options])
    assert submitted.exit_code == 0 and submitted.output.strip().startswith("batch_")


def test_a_wrong_key_is_one_clear_line_and_exit_code_2(module_served_api, tmp_path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(line("a", "fp32") + "\n")
    result = CliRunner().invoke(app, ["submit", str(source), "--api-url", module_served_api.removesuffix("/v1"),
                                      "--api-key", "sl-wrong"])
    assert result.exit_code == 2 and "401" in result.output and "not valid" in result.output


def _health(env: dict[str, str], *args: str):
    return CliRunner().invoke(app, ["health", *args], env=env)


def _servelab_env(stack) -> dict[str, str]:
    return {k: v for k, v in service_env(stack.settings).items() if k.startswith("SERVELAB_")}


def test_health_of_the_api_and_of_a_worker_follows_what_answers(make_stack, redis_client) -> None:
    stack = make_stack(with_worker=False)
    env = _servelab_env(stack)
    with api_process(stack) as url:
        up = _health(env, "api", "--url", url.removesuffix("/v1") + "/healthz")
        assert up.exit_code == 0 and "answered 200" in up.stdout, up.output
    gone = _health(env, "api", "--url", f"http://127.0.0.1:{_free_port()}/healthz")
    assert gone.exit_code == 1 and "does not answer" in gone.stderr, gone.output

    name = f"health-{stack.settings.key_prefix}"
    env = {**env, "SERVELAB_WORKER_NAME": name}
    assert "has registered" in _health(env, "worker").stderr
    with session_scope(stack.runtime.sessions) as session:
        request_store.register_worker(session, name=name, serving_config_name="tiny", config_hash="h", hardware={},
                                      software={})
    try:
        fresh = _health(env, "worker")
        assert fresh.exit_code == 0 and name in fresh.stdout, fresh.output
        with session_scope(stack.runtime.sessions) as session:
            session.execute(update(WorkerRow).where(WorkerRow.name == name)
                            .values(heartbeat_at=datetime.now(UTC) - timedelta(hours=1)))
        stale = _health(env, "worker")
        assert stale.exit_code == 1 and "beat 3600 s ago" in stale.stderr, stale.output
    finally:
        with session_scope(stack.runtime.sessions) as session:
            request_store.unregister_worker(session, name=name)


def test_health_of_the_jobs_worker_and_beat_is_their_answer_to_a_celery_ping(make_stack, redis_client) -> None:
    stack = make_stack(with_worker=False)
    env = _servelab_env(stack)
    host = socket.gethostname()
    prefix = stack.settings.key_prefix
    nodes = {"jobs-worker": f"jw-{prefix}@{host}", "beat": f"beat-{prefix}@{host}"}  # NOTE: names of this test's own
    # NOTE: no "nothing answers yet" check here: the stopped jobs-worker's below is that path (a ping that times out
    # costs its --timeout and a process start)
    stack.settings.state_dir.mkdir(parents=True, exist_ok=True)
    argvs = (["worker", "--pool=threads", "--concurrency=1", "--loglevel=WARNING", "-n", nodes["jobs-worker"]],
             ["beat", "--loglevel=WARNING", "--enable-remote-control", "-n", nodes["beat"]])
    processes = [subprocess.Popen([sys.executable, "-m", "worker.jobs", *argv], cwd=REPO, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env=service_env(stack.settings)) for argv in argvs]
    try:
        for service, node in nodes.items():
            deadline = time.monotonic() + 180
            while (result := _health(env, service, "--node", node, "--timeout", "1")).exit_code != 0:
                assert time.monotonic() < deadline, f"{service} never answered: {result.output}"
            assert "answers" in result.stdout
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
    stopped = _health(env, "jobs-worker", "--node", nodes["jobs-worker"], "--timeout", "1")
    assert stopped.exit_code == 1 and "does not answer" in stopped.stderr, stopped.output
