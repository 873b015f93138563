"""Migrations on a real PostgreSQL: up, down, up again, and models that agree with them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect, text
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from servelab.store import files
from servelab.store.db import make_engine
from servelab.store.migrate import MIGRATIONS_DIR, alembic_config, current, downgrade, upgrade
from servelab.store.models import Base

# NOTE: what the models declare; the migrations must create exactly this, and drop all of it again.
TABLES = set(Base.metadata.tables)
ENUM_TYPES = {t.name for table in Base.metadata.tables.values() for c in table.columns
              if isinstance(t := c.type, sa.Enum)}


def _schema(url: URL) -> tuple[set[str], set[str]]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            tables = set(inspect(conn).get_table_names()) - {"alembic_version"}
            enums = set(conn.scalars(text("SELECT typname FROM pg_type WHERE typtype = 'e'")))
        return tables, enums
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade_round_trip(
    fresh_database_url: URL, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the migrations are found from any working directory
    head = ScriptDirectory.from_config(alembic_config(fresh_database_url)).get_current_head()

    upgrade(fresh_database_url)
    assert current(fresh_database_url) == head
    assert _schema(fresh_database_url) == (TABLES, ENUM_TYPES)

    downgrade(fresh_database_url, "base")
    assert current(fresh_database_url) is None
    assert _schema(fresh_database_url) == (set(), set()), "downgrade must drop every table and enum type"

    upgrade(fresh_database_url)
    assert current(fresh_database_url) == head
    assert _schema(fresh_database_url) == (TABLES, ENUM_TYPES)


def test_models_and_migrations_agree(engine: Engine) -> None:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
        diff = compare_metadata(context, Base.metadata)
    assert diff == [], f"models and migrations differ; write a migration for: {diff}"


def test_revisions_form_one_line_and_are_named_by_date_and_slug(database_url: URL) -> None:
    scripts = ScriptDirectory.from_config(alembic_config(database_url))
    assert len(scripts.get_heads()) == 1, f"more than one head: {scripts.get_heads()}; merge them"
    for path in (MIGRATIONS_DIR / "versions").glob("*.py"):
        assert re.fullmatch(r"\d{4}_\d{2}_\d{2}_\w+_[a-z0-9_]+\.py", path.name), f"badly named: {path.name}"


def test_files_are_cut_into_parts_on_the_way_up_and_joined_again_on_the_way_down(
    fresh_database_url: URL, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    before_parts = ScriptDirectory.from_config(alembic_config(fresh_database_url)).get_revision("0009").down_revision
    upgrade(fresh_database_url, before_parts)
    contents = {"file-big": bytes(range(256)) * 10_000, "file-small": b'{"a": 1}\n', "file-empty": b""}
    engine = make_engine(fresh_database_url)
    try:
        with engine.begin() as conn:
            for file_id, content in contents.items():
                conn.execute(text("INSERT INTO files (id, tenant, purpose, filename, num_bytes, content) "
                                  "VALUES (:id, 'acme', 'batch', 'in.jsonl', :n, :content)"),
                             {"id": file_id, "n": len(content), "content": content})
        upgrade(fresh_database_url)
        with Session(engine) as session:
            assert {i: files.read_content(session, file_id=i, tenant="acme") for i in contents} == contents
            parts = dict(session.execute(text("SELECT file_id, count(*) FROM file_parts GROUP BY file_id")).all())
        assert parts == {"file-big": 3, "file-small": 1}  # 2.56 MB in parts of 1 MiB; nothing for an empty file
        downgrade(fresh_database_url, before_parts)
        with engine.connect() as conn:
            assert dict(conn.execute(text("SELECT id, content FROM files")).all()) == contents
    finally:
        engine.dispose()


def test_results_and_batches_stored_before_prefix_caching_read_as_nothing_cached_and_nothing_looked_up(
    fresh_database_url: URL, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Migration 0012: old rows read 0 (a hit rate of no look-ups is n/a, not 0 %); down drops the columns only."""
    monkeypatch.chdir(tmp_path)
    upgrade(fresh_database_url, "0011")
    engine = make_engine(fresh_database_url)
    try:
        with engine.begin() as conn:
            request_id = conn.scalar(text("INSERT INTO requests (serving_config_name, stream, prompt) "
                                          "VALUES ('fp32', 'interactive', 'hi') RETURNING id"))
            conn.execute(text("INSERT INTO results (request_id, text, num_prompt_tokens, num_generated_tokens, "
                              "token_ids) VALUES (:id, 'yo', 2, 1, '{7}')"), {"id": request_id})
            conn.execute(text("INSERT INTO batches (id, worker_name, serving_config_name, config_hash, num_requests, "
                              "num_rows_per_step, prefill_ms, decode_ms, num_prefill_tokens, num_decode_tokens, "
                              "device, weight_bytes, kv_cache_bytes, kv_cache_allocated_bytes, peak_working_bytes, "
                              "peak_process_bytes, started_at, finished_at) VALUES (gen_random_uuid(), 'w', 'fp32', "
                              "'h', 1, '{1}', 1, 1, 2, 1, 'cpu', 1, 1, 1, 1, 1, now(), now())"))
        upgrade(fresh_database_url)
        with engine.connect() as conn:
            assert conn.scalar(text("SELECT num_cached_tokens FROM results")) == 0
            assert tuple(conn.execute(text(
                "SELECT num_prefix_query_tokens, num_prefix_hit_tokens, kv_block_size, kv_blocks_shared, "
                "kv_blocks_private FROM batches")).one()) == (0, 0, 0, 0, 0)
        downgrade(fresh_database_url, "0011")
        with engine.connect() as conn:
            columns = {c["name"] for table in ("results", "batches") for c in inspect(conn).get_columns(table)}
            assert not columns & {"num_cached_tokens", "num_prefix_query_tokens", "num_prefix_hit_tokens",
                                  "kv_block_size", "kv_blocks_shared", "kv_blocks_private"}
            assert conn.scalar(text("SELECT count(*) FROM results")) == 1, "the rows stay"
    finally:
        engine.dispose()
