"""Convert the project's transformers folder into a peer's format, once, cached by source.

Run under the peer's own venv: `python -m bench.peers.convert --peer ct2 --precision float32 --source DIR`.
Prints the path the adapter loads on its last line. Each result lives in .cache/peers/models/<peer>-<label>/
with SOURCE.json holding the key (the source folder's path and files, the peer, the label, the recipe);
a different key converts again. Work happens in a .partial folder renamed into place when complete, so
an interrupted conversion is never taken for a finished one. Standard library at import: the converters
are called as their own commands, except llama.cpp's quantiser, which is called through llama_cpp.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.peers.peers import CACHE, PEERS

RECIPE = 1  # bump when a conversion command changes, so caches made by the old one are redone
LLAMA_CPP_SRC = CACHE / "src" / "llama.cpp"  # setup.sh extracts llama.cpp's Python tools here
LLAMA_FTYPE_MOSTLY_Q4_0 = 2  # llama.h: enum llama_ftype


def source_key(source: Path, peer: str, label: str) -> dict:
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in source.iterdir() if p.is_file())
    digest = hashlib.sha256(json.dumps([str(source.resolve()), files]).encode()).hexdigest()
    return {"source": str(source.resolve()), "source_digest": digest, "peer": peer, "label": label, "recipe": RECIPE}


def ensure_converted(peer: str, label: str, source: Path) -> Path:
    """The converted model's path (a folder, or llama.cpp's .gguf file), converting if the cache is stale."""
    target = PEERS[peer].model_dir(label)
    key = source_key(source, peer, label)
    if _cached_key(target) != key:
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        started = time.perf_counter()
        CONVERTERS[peer](label, source, partial)
        (partial / "SOURCE.json").write_text(json.dumps({**key, "seconds": time.perf_counter() - started}))
        shutil.rmtree(target, ignore_errors=True)
        os.rename(partial, target)
    return target / "model.gguf" if peer == "llamacpp" else target


def _cached_key(target: Path) -> dict | None:
    try:
        data = json.loads((target / "SOURCE.json").read_text())
    except (OSError, ValueError):
        return None
    data.pop("seconds", None)
    return data


def _ct2(label: str, source: Path, out: Path) -> None:
    _run([str(Path(sys.executable).parent / "ct2-transformers-converter"), "--model", str(source),
          "--output_dir", str(out), "--quantization", label, "--force"])


def _ortgenai(label: str, source: Path, out: Path) -> None:
    _run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(out),
          "-p", label, "-e", "cpu", "-c", str(out / "builder-cache")])
    shutil.rmtree(out / "builder-cache", ignore_errors=True)


def _llamacpp(label: str, source: Path, out: Path) -> None:
    if label in ("f32", "bf16"):
        env = {**os.environ, "PYTHONPATH": str(LLAMA_CPP_SRC / "gguf-py")}
        _run([sys.executable, str(LLAMA_CPP_SRC / "convert_hf_to_gguf.py"), str(source),
              "--outfile", str(out / "model.gguf"), "--outtype", label], env=env)
        return
    if label != "q4_0":
        raise ValueError(f"no llama.cpp recipe for {label!r}")
    import llama_cpp

    full = ensure_converted("llamacpp", "f32", source)  # quantise from full precision, as llama.cpp advises
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPE_MOSTLY_Q4_0
    params.nthread = 1
    status = llama_cpp.llama_model_quantize(str(full).encode(), str(out / "model.gguf").encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize returned {status}")


CONVERTERS = {"ct2": _ct2, "ortgenai": _ortgenai, "llamacpp": _llamacpp}


def _run(command: list[str], env: dict[str, str] | None = None) -> None:
    print("+", " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, env=env, stdout=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", required=True, choices=sorted(CONVERTERS))
    parser.add_argument("--precision", required=True, help="the peer's own label, e.g. float32, q4_0, int4")
    parser.add_argument("--source", required=True, type=Path, help="the transformers folder to convert")
    args = parser.parse_args(argv)
    print(ensure_converted(args.peer, args.precision, args.source))


if __name__ == "__main__":
    main()
