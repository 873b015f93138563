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
