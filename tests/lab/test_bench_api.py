"""`servelab bench api` against the tests' servers: it starts the api processes it measures (a baseline checkout
in a scratch database of its own), prints a row per api with submissions/s, p50, p99 and errors, and leaves
nothing behind: no bench tenant's rows or keys, no Redis keys of its prefix, no scratch database."""

from __future__ import annotations

from sqlalchemy import create_engine, func, select, text
from typer.testing import CliRunner

from servelab.cli import app
from servelab.store.db import session_factory, session_scope
from servelab.store.models import ApiKeyRow, RequestRow
from tests.conftest import ADMIN_URL, REPO, service_env


def test_bench_api_prints_a_row_per_api_and_removes_what_it_made(service_settings, engine,
                                                                  redis_client) -> None:
    env = service_env(service_settings)
    result = CliRunner().invoke(app, ["bench", "api", "--baseline", str(REPO), "--processes", "1", "--requests", "40",
                                      "--warmup", "5", "--clients", "4", "--load-processes", "1"], env=env)
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith(("baseline", "this checkout"))]
    assert len(rows) == 2, result.stdout
    for row in rows:
        processes, per_s, p50, p99, errors = (row[:-1] if row[-1].startswith("x") else row)[-5:]  # NOTE: x ratio
        assert processes == "1" and float(per_s) > 0 and 0 < float(p50) <= float(p99) and errors == "0", row
    assert "GET /healthz" in result.stdout
    with session_scope(session_factory(engine)) as session:
        for table in (RequestRow, ApiKeyRow):
            assert session.scalar(select(func.count()).select_from(table).where(table.tenant.like("bench-%"))) == 0
    assert not list(redis_client.scan_iter(match=f"{service_settings.key_prefix}-bench-*"))
    admin = create_engine(ADMIN_URL)
    try:
        with admin.connect() as conn:
            scratch = conn.scalars(text("SELECT datname FROM pg_database WHERE datname LIKE 'servelab_bench_%'")).all()
    finally:
        admin.dispose()
    assert scratch == []
