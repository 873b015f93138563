"""`servelab up` / `down`: the local stack's processes start, answer, and stop, exactly the ones started."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx

from servelab.settings import Settings
from servelab.stack import _is_alive, read_stack, start_stack, stop_stack
from tests.engine.conftest import bundled_folder, settings, tiny_folder  # noqa: F401 (fixtures)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_stack_starts_answers_and_stops_what_it_started(tmp_path: Path, tiny_folder: Path,
                                                            service_settings) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(f"name: tiny\nmodel: {tiny_folder}\ndevice: cpu\nnum_threads: 1\n")
    settings = Settings(state_dir=tmp_path / "state", key_prefix=service_settings.key_prefix)
    env = {"SERVELAB_REDIS_URL": service_settings.redis_url, "SERVELAB_DATABASE_URL": service_settings.database_url,
           "SERVELAB_KEY_PREFIX": service_settings.key_prefix, "SERVELAB_CELERY_PREFIX": f"{service_settings.key_prefix}:c",
           "SERVELAB_STATE_DIR": str(tmp_path / "state")}
    port = free_port()
    try:
        started = start_stack(settings, env=env, config_paths=[config], api_port=port)
        assert [p.name for p in started] == ["api", "jobs-worker", "beat", "gpu-worker-tiny"]
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
        assert start_stack(settings, env=env, config_paths=[config], api_port=port) == started  # up twice: reused
    finally:
        stopped = stop_stack(settings)
    assert {p.pid for p in stopped} == {p.pid for p in started}
    assert not any(_is_alive(p.pid) for p in started)
    assert read_stack(settings) == []
