"""`servelab bench ingest`: every phase measured and checked, in a throwaway database that is gone afterwards."""

from __future__ import annotations

import re

import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from servelab.cli import app
from tests.conftest import ADMIN_URL, REDIS_URL, REPO, service_env


def test_bench_ingest_prints_every_phase_and_leaves_nothing_behind(service_settings) -> None:
    env = service_env(service_settings)
    result = CliRunner().invoke(app, ["bench", "ingest", "--config", str(REPO / "configs" / "fp32.yaml"), "--lines",
                                      "400", "--slice", "150", "--bad-every", "9"], env=env)
    assert result.exit_code == 0, result.output
    assert "400 lines (44 bad)" in result.stdout and "slices of 150 lines" in result.stdout
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[2:]}
    assert list(rows) == ["upload", "ingest", "finalise", "download"]
    assert all(float(row[1].replace(",", "")) > 0 and row[-1] == "MiB" for row in rows.values())
    database = re.search(r"database (servelab_bench_ingest_\w+) \(dropped\)", result.stdout).group(1)
    admin = create_engine(make_url(ADMIN_URL))
    with admin.connect() as conn:
        assert not conn.scalar(text("SELECT count(*) FROM pg_database WHERE datname = :name"), {"name": database})
    admin.dispose()
    client = redis.Redis.from_url(REDIS_URL)
    assert not list(client.scan_iter(f"{service_settings.key_prefix}:bench-ingest-*"))
    client.close()
    refused = CliRunner().invoke(app, ["bench", "ingest", "--bad-every", "1"], env=env)
    assert refused.exit_code == 2 and "--bad-every 1 makes every line bad" in refused.output
