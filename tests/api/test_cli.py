"""The `servelab keys create`, `submit` and `results` commands against a running API, jobs-worker and worker."""

from __future__ import annotations

import json

import httpx
from sqlalchemy import select, update
from typer.testing import CliRunner

from servelab.cli import app
from servelab.store import keys
from servelab.store.db import session_scope
from servelab.store.models import ApiKeyRow, FileRow
from tests.jobs.conftest import line


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


def test_submit_waits_for_the_batch_and_results_downloads_its_output(served_api, jobs_worker, tmp_path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([line(f"s{i}", "whatever") for i in range(12)] + ["{oops"]) + "\n")
    options = ["--api-url", served_api.removesuffix("/v1"), "--api-key", jobs_worker.key("acme")]
    submitted = CliRunner().invoke(app, ["submit", str(source), "--config", jobs_worker.model, *options])
    assert submitted.exit_code == 0, submitted.output
    batch_id = submitted.output.splitlines()[0]
    assert "completed: 12 completed, 1 failed of 13" in submitted.output
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    fetched = CliRunner().invoke(app, ["results", batch_id, "-o", str(out), "--errors", str(errors), *options])
    assert fetched.exit_code == 0, fetched.output
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == sorted(f"s{i}" for i in range(12))
    assert [json.loads(x)["error"]["code"] for x in errors.read_text().splitlines()] == ["invalid_json"]
    # a file this key may no longer read: the command fails with the API's message and writes no error body
    batch = httpx.get(f"{served_api}/batches/{batch_id}",
                      headers={"Authorization": f"Bearer {jobs_worker.key('acme')}"}).json()
    with session_scope(jobs_worker.runtime.sessions) as session:
        session.execute(update(FileRow).where(FileRow.id == batch["output_file_id"]).values(tenant="someone-else"))
    gone = tmp_path / "gone.jsonl"
    failed = CliRunner().invoke(app, ["results", batch_id, "-o", str(gone), *options])
    assert failed.exit_code == 2 and "404" in failed.stderr and not gone.exists()


def test_submit_no_wait_returns_the_batch_id_at_once(served_api, jobs_worker, tmp_path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(line("a", jobs_worker.model) + "\n")
    options = ["--api-url", served_api.removesuffix("/v1"), "--api-key", jobs_worker.key("acme")]
    submitted = CliRunner().invoke(app, ["submit", str(source), "--no-wait", *options])
    assert submitted.exit_code == 0 and submitted.output.strip().startswith("batch_")


def test_a_wrong_key_is_one_clear_line_and_exit_code_2(served_api, tmp_path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(line("a", "fp32") + "\n")
    result = CliRunner().invoke(app, ["submit", str(source), "--api-url", served_api.removesuffix("/v1"),
                                      "--api-key", "sl-wrong"])
    assert result.exit_code == 2 and "401" in result.output and "not valid" in result.output
