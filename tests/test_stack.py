"""`servelab up` / `status` / `down`: the local stack's processes start, answer, start again when one dies, show
what runs, and stop: exactly the ones started, never a process that later took a recorded pid."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from servelab.cli import app
from servelab.settings import Settings
from servelab.cores import CoreSplitError, format_cores, split_cores, worker_cores
from servelab.stack import StackError, StackProcess, _start_ticks, _write_stack, is_running, read_stack, start_stack, stop_stack
from tests.conftest import service_env
from tests.engine.conftest import bundled_folder, settings, tiny_folder  # noqa: F401 (fixtures)

NAMES = ["api", "jobs-worker", "beat", "gpu-worker-tiny"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stack_env(service_settings) -> dict[str, str]:
    """The test's environment (service_env: its state folder is tmp_path/state) with Celery's keys under its prefix."""
    return service_env(service_settings, SERVELAB_CELERY_PREFIX=f"{service_settings.key_prefix}:c")


def tiny_config(tmp_path: Path, tiny_folder: Path) -> Path:
    config = tmp_path / "tiny.yaml"
    config.write_text(f"name: tiny\nmodel: {tiny_folder}\ndevice: cpu\n")
    return config


def test_the_stack_starts_answers_and_stops_what_it_started(tmp_path: Path, tiny_folder: Path,
                                                            service_settings, redis_client) -> None:
    config = tiny_config(tmp_path, tiny_folder)
    settings = Settings(state_dir=tmp_path / "state", key_prefix=service_settings.key_prefix)
    env = stack_env(service_settings)
    port = free_port()
    try:
        started = start_stack(settings, env=env, config_paths=[config], api_port=port)
        assert [c.process.name for c in started] == NAMES and {c.action for c in started} == {"started"}
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
        worker = next(c.process for c in started if c.process.name.startswith("gpu-worker"))
        cores = tuple(sorted(os.sched_getaffinity(0)))
        kept = cores[:1] if len(cores) > 1 else ()  # a core for the api, jobs-worker and beat where one is spare
        assert worker.cpus == cores[len(kept):] and os.sched_getaffinity(worker.pid) == set(worker.cpus)
        for other in (c.process for c in started if c.process is not worker):
            assert other.cpus == (kept or None) and os.sched_getaffinity(other.pid) == set(kept or cores)
        again = start_stack(settings, env=env, config_paths=[config], api_port=port)  # up twice: reused
        assert [c.process for c in again] == [c.process for c in started] and {c.action for c in again} == {"running"}
    finally:
        stopped = stop_stack(settings)
    assert {p.pid for p in stopped} == {c.process.pid for c in started}
    assert not any(is_running(c.process) for c in started)
    assert read_stack(settings) == []


def _status(env: dict[str, str]) -> tuple[int, dict]:
    result = CliRunner().invoke(app, ["status", "--json"], env=env)
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


def _wait_for_live_worker(env: dict[str, str], service: str, *, timeout_s: float = 600.0) -> dict:
    # NOTE: a generous limit: a first start on a busy machine may wait for a kernel build in the shared cache
    deadline = time.monotonic() + timeout_s
    while True:
        code, report = _status(env)
        live = [w for w in report["workers"] if w["service"] == service and w["is_live"]]
        if code == 0 and live:
            return report
        assert time.monotonic() < deadline, f"no live {service} within {timeout_s:.0f} s: {report['problems']}"
        time.sleep(1.0)


def test_up_after_the_gpu_worker_was_killed_starts_it_again_and_status_says_so(
        tmp_path: Path, tiny_folder: Path, service_settings, redis_client) -> None:
    config = tiny_config(tmp_path, tiny_folder)
    env = stack_env(service_settings)
    up = ["up", "--configs", str(config), "--port", str(free_port())]
    runner = CliRunner()
    try:
        first = runner.invoke(app, up, env=env)
        assert first.exit_code == 0, first.output
        if len(os.sched_getaffinity(0)) > 1:  # a core kept for the api, jobs-worker and beat, and said so
            assert "kept for the stack's own processes" in first.stdout, first.stdout
        report = _wait_for_live_worker(env, "gpu-worker-tiny")
        assert [p["name"] for p in report["processes"]] == NAMES and all(p["is_running"] for p in report["processes"])
        assert report["processes"][0]["answers"] is True and report["servers"][0]["answers"] is True
        assert "tiny" in report["queue_depths"]
        pids = {p["name"]: p["pid"] for p in report["processes"]}

        os.kill(pids["gpu-worker-tiny"], signal.SIGKILL)  # the worker this test started, by its recorded pid
        deadline = time.monotonic() + 30
        while (down := _status(env))[0] == 0:
            assert time.monotonic() < deadline, "status still says all is up after the worker was killed"
            time.sleep(0.2)
        assert any("gpu-worker-tiny" in p and "not running" in p for p in down[1]["problems"]), down[1]["problems"]

        second = runner.invoke(app, up, env=env)
        assert second.exit_code == 0, second.output
        assert "restarted" in next(line for line in second.stdout.splitlines() if line.startswith("gpu-worker-tiny"))
        report = _wait_for_live_worker(env, "gpu-worker-tiny")
        now = {p["name"]: p["pid"] for p in report["processes"]}
        assert now["gpu-worker-tiny"] != pids["gpu-worker-tiny"]
        assert {n: now[n] for n in NAMES[:3]} == {n: pids[n] for n in NAMES[:3]}, "what ran was kept"
        text = runner.invoke(app, ["status"], env=env)
        assert text.exit_code == 0 and "gpu-worker-tiny" in text.stdout and "live" in text.stdout
    finally:
        down_ = runner.invoke(app, ["down"], env=env)
    assert down_.exit_code == 0, down_.output
    assert all(f"stopped {name}" in down_.stdout for name in NAMES)


def _sleeper() -> subprocess.Popen:
    # NOTE: a session of its own, as the stack's processes have: killpg on its pid reaches only it
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)


def test_a_recorded_pid_that_another_process_now_has_is_never_signalled(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path / "state")
    settings.state_dir.mkdir()
    stranger = _sleeper()
    try:
        ticks = _start_ticks(stranger.pid)
        assert ticks is not None
        # the record says this pid is a worker that started earlier: the pid has been reused since
        _write_stack(settings, [StackProcess("gpu-worker-x", stranger.pid, "x.log", ("-m", "worker.gpu"), ticks - 1)])
        assert not is_running(read_stack(settings)[0])
        assert stop_stack(settings) == []
        time.sleep(0.5)
        assert stranger.poll() is None, "stop_stack killed a process it did not start"

        ours = StackProcess("gpu-worker-x", stranger.pid, "x.log", ("-m", "worker.gpu"), ticks)
        _write_stack(settings, [ours])
        assert is_running(ours) and stop_stack(settings) == [ours]
        assert stranger.wait(timeout=30) == -signal.SIGTERM
    finally:
        if stranger.poll() is None:
            stranger.kill()
            stranger.wait()


def test_a_new_gpu_worker_never_lands_on_the_cores_the_running_stack_is_pinned_to(tmp_path: Path) -> None:
    """The api, jobs-worker and beat run pinned to core 0 (sleepers recorded as them); a worker to start with no core
    kept spare (SERVELAB_STACK_CORES=0) would share it: refused, naming the way out, before anything starts."""
    cores = sorted(os.sched_getaffinity(0))
    settings = Settings(state_dir=tmp_path / "state", stack_cores=0)
    settings.state_dir.mkdir()
    sleepers = [_sleeper() for _ in range(3)]
    try:
        _write_stack(settings, [StackProcess(name, p.pid, f"{name}.log", ("-m", "x"), _start_ticks(p.pid), None,
                                             (cores[0],)) for name, p in zip(("api", "jobs-worker", "beat"), sleepers)])
        config = tmp_path / "w.yaml"
        config.write_text("name: w\nmodel: bundled:smollm2-135m-instruct\ndevice: cpu\n")
        with pytest.raises(StackError, match=rf"pinned to core\(s\) {cores[0]}, which a gpu-worker to start "
                                             r"\(gpu-worker-w\) would share: `servelab down`"):
            start_stack(settings, env={}, config_paths=[config], api_port=free_port())
        assert [p.name for p in read_stack(settings)] == ["api", "jobs-worker", "beat"]  # nothing started
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def test_status_with_nothing_running_exits_1_and_starts_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = {"SERVELAB_STATE_DIR": str(state), "SERVELAB_REDIS_URL": None, "SERVELAB_DATABASE_URL": None}
    result = CliRunner().invoke(app, ["status", "--json"], env=env)
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert not report["is_up"] and any("nothing runs here" in p for p in report["problems"])
    assert [s["answers"] for s in report["servers"]] == [False, False]
    assert not (state / "redis").exists() and not (state / "pg").exists(), "status must not start a server"


def test_gpu_workers_split_the_free_cores_and_never_share_one_unless_asked() -> None:
    assert worker_cores(["a", "b"], [0, 1, 2, 3, 4]) == {"a": (0, 1, 2), "b": (3, 4)}
    assert worker_cores(["a", "b"], [2, 3]) == {"a": (2,), "b": (3,)}
    assert worker_cores([], []) == {}
    with pytest.raises(CoreSplitError, match=r"3 gpu-worker\(s\) to start \(a, b, c\) and 2 free core\(s\) \(0-1\).*--share-cores"):
        worker_cores(["a", "b", "c"], [0, 1])
    assert format_cores((5, 0, 1, 2)) == "0-2,5" and format_cores(()) == ""


def test_up_keeps_a_core_for_the_stacks_own_processes_where_the_workers_leave_one_spare() -> None:
    others = ["api", "jobs-worker", "beat"]
    assert split_cores(["w"], others, [0, 1], None) == {"w": (1,), "api": (0,), "jobs-worker": (0,), "beat": (0,)}
    assert split_cores(["a", "b"], others, [0, 1, 2, 3, 4], None) == {"a": (1, 2), "b": (3, 4), **dict.fromkeys(
        others, (0,))}
    assert split_cores(["a", "b"], others, [0, 1], None) == {"a": (0,), "b": (1,)}  # none spare: nothing kept
    assert split_cores(["w"], others, [0, 1, 2, 3], 2) == {"w": (2, 3), **dict.fromkeys(others, (0, 1))}
    assert split_cores(["w"], others, [0, 1], 0) == {"w": (0, 1)}  # 0: the workers take every core
    assert split_cores([], others, [0, 1], None) == {}  # no worker to start: nothing is pinned
    with pytest.raises(CoreSplitError, match=r"SERVELAB_STACK_CORES is 2, but 2 free core\(s\) \(0-1\) and 1 gpu-worker"
                                         r"\(s\) to start leave 1 spare: set it to at most 1"):
        split_cores(["w"], others, [0, 1], 2)


def test_up_share_measures_a_worker_alone_and_beside_a_busy_one(tmp_path: Path, tiny_folder: Path,
                                                                   service_settings, redis_client, capsys) -> None:
    """bench/up_share.py against a real stack of two pinned gpu-workers: it prints A's speed each way, their ratio
    and one ratio per round (the figures are docs/performance.md's; here only that it measures what it says)."""
    from bench import up_share

    configs = []
    for name in ("share-a", "share-b"):
        configs.append(tmp_path / f"{name}.yaml")
        configs[-1].write_text(f"name: {name}\nmodel: {tiny_folder}\ndevice: cpu\n")
    settings = Settings(state_dir=tmp_path / "state", key_prefix=service_settings.key_prefix)
    env = {**stack_env(service_settings), "SERVELAB_CONFIGS_DIR": str(tmp_path)}
    port = free_port()
    try:
        start_stack(settings, env=env, config_paths=configs, api_port=port,
                    share_cores=len(os.sched_getaffinity(0)) < 2)  # pinned where there is a core each
        made = CliRunner().invoke(app, ["keys", "create", "--tenant", "share"], env=env)
        assert made.exit_code == 0, made.output
        up_share.main(["--url", f"http://127.0.0.1:{port}", "--key", made.output.strip(), "--models", "share-a,share-b",
                       "--requests", "2", "--new-tokens", "4", "--rounds", "2"])
    finally:
        stop_stack(settings)
    out = capsys.readouterr().out
    assert "2 requests x 4 tokens per burst, 2 rounds" in out
    summary = next(line for line in out.splitlines() if line.startswith("share-a alone:"))
    alone, beside, ratio = (float(v) for v in re.findall(
        r"([\d.]+) tok/s; beside a busy share-b: ([\d.]+) tok/s \(x([\d.]+)\)", summary)[0])
    assert alone > 0 and beside > 0 and abs(ratio - beside / alone) < 0.01
    rounds = next(line for line in out.splitlines() if line.startswith("per round, together / alone:"))
    assert rounds.count("x") == 2


@pytest.mark.parametrize("argv, message", [
    (["--models", "a", "--key", "k"], "name two served configs"),
    (["--models", "a,b", "--key", "k", "--rounds", "0"], "must be at least 1"),
])
def test_up_share_names_the_bad_option(argv: list[str], message: str, capsys) -> None:
    from bench import up_share

    with pytest.raises(SystemExit) as ended:
        up_share.main(argv)
    assert ended.value.code == 2 and message in capsys.readouterr().err
