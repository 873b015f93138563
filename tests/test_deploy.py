"""docker-compose.yml and the Dockerfile against the code: every service has a target, every command exists.

Docker cannot run on these machines; this checks what can be checked here: the compose file parses,
each built service names a Dockerfile target, and each image's command names a module, file or
servelab command that exists and starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
DOCKERFILE = (REPO / "Dockerfile").read_text()
STAGES = re.split(r"^(?=FROM )", DOCKERFILE, flags=re.M)
# target name -> its CMD (JSON form); stages without a CMD (the shared base) are left out
TARGETS = {m.group(1): c.group(1) for stage in STAGES if (m := re.match(r"FROM \S+ AS (\S+)", stage))
           and (c := re.search(r"^CMD (\[.*\])", stage, flags=re.M))}
BUILT = {name: svc["build"]["target"] for name, svc in COMPOSE["services"].items() if "build" in svc}
PROCESSES = {"redis", "postgres", "migrate", "api", "gpu-worker", "jobs-worker", "beat", "dashboard"}


def test_compose_runs_every_process_of_the_design() -> None:
    assert PROCESSES <= set(COMPOSE["services"])
    assert COMPOSE["services"]["postgres"]["healthcheck"] and "--appendonly" in COMPOSE["services"]["redis"]["command"]


@pytest.mark.parametrize("service", sorted(BUILT))
def test_every_built_service_has_a_dockerfile_target_with_a_command(service: str) -> None:
    assert BUILT[service] in TARGETS, f"{service}: no 'FROM ... AS {BUILT[service]}' with a CMD in the Dockerfile"


@pytest.mark.parametrize("service", sorted(set(BUILT) - {"migrate"}))
def test_services_wait_for_the_migration(service: str) -> None:
    depends = COMPOSE["services"][service]["depends_on"]
    assert depends["migrate"]["condition"] == "service_completed_successfully"


def test_gpu_worker_reserves_one_gpu() -> None:
    devices = COMPOSE["services"]["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_each_image_command_exists_here(target: str) -> None:
    command = yaml.safe_load(TARGETS[target])
    if command[0] == "sh":
        command = command[2].split()
    if command[0].startswith("python"):
        assert command[1] == "-m" and importlib.util.find_spec(command[2]), command
    elif command[0] == "servelab":
        result = subprocess.run([sys.executable, "-m", "servelab.cli", command[1], "--help"], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
    elif command[0] == "uvicorn":
        module, attr = command[2].split(":")
        assert callable(getattr(importlib.import_module(module), attr))
    elif command[0] == "streamlit":
        assert (REPO / command[2]).is_file()
    else:
        raise AssertionError(f"unknown command {command}")


def test_the_worker_entry_point_starts_and_checks_its_config() -> None:
    result = subprocess.run([sys.executable, "-m", "worker.gpu", "configs/nope.yaml"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "no such config file" in result.stderr


def test_light_images_carry_no_torch() -> None:
    code = "import sys, api.app, worker.jobs, servelab.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"

