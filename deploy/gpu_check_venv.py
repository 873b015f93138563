"""`make gpu-check`'s throwaway venv on an air-gapped CUDA host: one that sees the host's own PyTorch, transformers and
Triton wherever they are installed, with the folder's wheels (`make gpu-wheels`) installed over them, offline.

`python -m venv --system-site-packages` alone sees only the base interpreter's packages. Where the host's `python3` is
itself a venv (an image that keeps PyTorch in /opt/.../.venv, say), the new venv would see none of them and the check
would stop at `import torch`. So the host interpreter's own site-packages folders are added to the new venv's path by
a .pth file, after the venv's own: the folder's wheels come first, the host's packages fill in the rest, and pip sees
them too (it resolves the folder's requirements against them and installs only what is missing).

Runs under the host's Python with its standard library alone. Does not know the check (servelab/lab/check_gpu.py) nor
which wheels the folder holds (deploy/gpu_wheels.py).
"""

from __future__ import annotations

import argparse
import shutil
import site
import subprocess
import sys
from pathlib import Path

PTH_NAME = "host-site-packages.pth"


def site_packages() -> list[str]:
    """The folders this interpreter imports installed packages from: its own site-packages (a venv's), and its base's
    where it sees them (a venv made with --system-site-packages), in its order."""
    folders = set(site.getsitepackages())
    return [path for path in sys.path if path in folders]


def make_venv(venv: Path) -> Path:
    """A fresh venv at `venv` over this interpreter's packages -> its interpreter. Made without pip of its own: the
    host's pip serves it (seen through the .pth, it installs into the venv it runs in), so a host Python without
    ensurepip (a distribution's, its venv module split off) still makes one."""
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    interpreter = venv / "bin" / "python"
    purelib = subprocess.run([str(interpreter), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / PTH_NAME).write_text("".join(f"{folder}\n" for folder in site_packages()))
    return interpreter


def has_pip() -> bool:
    # NOTE: asked of a child: looking pip up in this process (find_spec) makes setuptools' distutils shim stand
    # down for good (it leaves distutils to pip), and a later setuptools import in a test process then fails
    return subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0


def install(interpreter: Path, wheels: Path) -> None:
    """The folder's pins, from the folder alone (no index): what the host already has at a pinned version stays."""
    subprocess.run([str(interpreter), "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(wheels),
                    "-r", str(wheels / "requirements.txt")], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("venv", type=Path, help="where the throwaway venv goes (removed first)")
    parser.add_argument("wheels", type=Path, help="the folder `make gpu-wheels` made")
    args = parser.parse_args(argv)
    if not (args.wheels / "requirements.txt").is_file():
        print(f"{args.wheels}/requirements.txt is missing: make the folder with `make gpu-wheels` on a networked "
              "machine and carry it here", file=sys.stderr)
        return 2
    if not has_pip():
        print(f"this Python ({sys.executable}) has no pip to install the folder's wheels with (a venv made by uv, "
              f"say): add it with `{sys.executable} -m ensurepip`, then run this again", file=sys.stderr)
        return 2
    install(make_venv(args.venv), args.wheels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
