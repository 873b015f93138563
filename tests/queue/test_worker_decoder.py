"""What a worker records about the decoder serving its model: where transformers' forward serves it, the worker's
registered hardware (stored with every run it serves), the run's settings and `servelab status` say why and what it
costs. On the real PostgreSQL, through the worker's own registration."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import select
from typer.testing import CliRunner

from servelab.cli import app
from servelab.engine.engine import Engine
from servelab.serving.process import register
from servelab.store import queries
from servelab.store import requests as store
from servelab.store.db import session_factory, session_scope
from servelab.store.models import WorkerRow
from servelab.store.run_settings import describe_settings
from tests.conftest import service_env
from tests.engine.conftest import make_config, tiny_gpt2_folder  # noqa: F401 (fixtures)


def test_a_transformers_served_model_is_recorded_with_the_reason_and_the_cost(tiny_gpt2_folder: Path, settings,
                                                                              session) -> None:
    engine = Engine.from_config(make_config(str(tiny_gpt2_folder), num_threads=1), settings)
    name = f"test-{uuid.uuid4().hex[:8]}"
    register(session, name=name, engine=engine, bandwidth_gbs=1.0)

    hardware = session.scalar(select(WorkerRow.hardware).where(WorkerRow.name == name))
    assert hardware["decoder"] == "transformers" and hardware["kernel"].startswith("transformers decoder")
    assert "architecture 'gpt2'" in hardware["decoder_reason"] and "no paged KV cache" in hardware["decoder_reason"]
    shown = describe_settings(engine.config.model_dump(mode="json"), hardware)  # as a run stores config and hardware
    assert shown["decoder"].startswith("auto: transformers' forward served it (")
    assert "architecture 'gpt2'" in shown["decoder"] and "no prefix caching" in shown["decoder"]
    assert shown["cache block size"].startswith("not paged") and shown["prefix caching"].startswith("off")
    worker = next(w for w in queries.workers(session, now=datetime.now(UTC)) if w.name == name)
    assert worker.decoder_reason == hardware["decoder_reason"] and worker.kernel == hardware["kernel"]


def test_status_shows_why_transformers_forward_serves_a_worker(tiny_gpt2_folder: Path, settings, engine,
                                                               service_settings) -> None:
    model = Engine.from_config(make_config(str(tiny_gpt2_folder), num_threads=1), settings)
    name = f"test-{uuid.uuid4().hex[:8]}"
    sessions = session_factory(engine)
    with session_scope(sessions) as session:
        register(session, name=name, engine=model, bandwidth_gbs=1.0)
    env = service_env(service_settings)
    try:
        result = CliRunner().invoke(app, ["status"], env=env)
    finally:
        with session_scope(sessions) as session:
            store.unregister_worker(session, name=name)
    lines = result.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(name))
    assert lines[at + 1].strip().startswith("transformers decoder, dense float32"), lines[at:at + 3]
    assert lines[at + 2].strip().startswith("transformers' forward serves it: servelab's decoder does not cover "
                                            "this model: architecture 'gpt2'"), lines[at:at + 3]
