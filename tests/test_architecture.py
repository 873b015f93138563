"""The folder list is the architecture: who may import whom, checked on the source's import statements."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROCESS_PACKAGES = ("api", "worker", "dashboard")
# NOTE: policy modules take time as an argument and import no I/O or tensor library.
PURE_MODULES = ("servelab/config.py", "servelab/engine/memory.py", "servelab/engine/requests.py",
                "servelab/engine/outputs.py", "servelab/queue/batcher.py", "servelab/lab/verdict.py",
                "servelab/lab/metrics.py", "servelab/lab/stats.py", "servelab/lab/workload.py",
                "servelab/lab/roofline.py")
HEAVY = ("torch", "transformers", "redis", "sqlalchemy", "celery", "gptqmodel")


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def python_files(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("path", python_files("servelab"), ids=lambda p: str(p.relative_to(REPO)))
def test_core_never_imports_process_packages(path: Path) -> None:
    assert not imported_roots(path) & set(PROCESS_PACKAGES), path


@pytest.mark.parametrize("package", PROCESS_PACKAGES)
def test_process_packages_never_import_each_other(package: str) -> None:
    others = set(PROCESS_PACKAGES) - {package}
    for path in python_files(package):
        assert not imported_roots(path) & others, path


@pytest.mark.parametrize("package", ["api", "dashboard"])
def test_api_and_dashboard_never_import_torch(package: str) -> None:
    for path in python_files(package):
        assert not imported_roots(path) & {"torch", "transformers", "gptqmodel"}, path


@pytest.mark.parametrize("module", PURE_MODULES)
def test_policy_modules_import_no_io_or_tensor_library(module: str) -> None:
    assert not imported_roots(REPO / module) & set(HEAVY), module


def test_no_grab_bag_modules() -> None:
    names = {p.stem for folder in ("servelab", *PROCESS_PACKAGES) for p in python_files(folder)}
    assert not names & {"utils", "helpers", "common", "manager", "misc"}
