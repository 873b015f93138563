"""Schema upgrades and downgrades through Alembic, run from code with an explicit URL.

Knows where the migration scripts are (migrations/ beside the package, whatever the working directory)
and hands Alembic the URL it is given. Does not know where the URL comes from: the process entry point
passes Settings' URL, or the one servelab/embedded.py resolved.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy.engine import URL

from servelab.store.db import make_engine, sqlalchemy_url

# NOTE: migrations/ lives at the repository root, next to alembic.ini; images must copy it with servelab/.
MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(url: str | URL) -> Config:
    assert MIGRATIONS_DIR.is_dir(), f"no migrations folder at {MIGRATIONS_DIR}"
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # NOTE: handed over as an attribute, not an ini option: ini values treat '%' as interpolation.
    config.attributes["url"] = sqlalchemy_url(url).render_as_string(hide_password=False)
    return config


def upgrade(url: str | URL, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str | URL, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def current(url: str | URL) -> str | None:
    """The database's revision, or None before the first migration."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
