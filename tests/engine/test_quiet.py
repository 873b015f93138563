"""What a worker prints when it loads the engine and gptqmodel: none of the libraries' import-time noise (torchao's
`Failed to load`, torch's `_pytree` deprecation, gptqmodel's banner, GIL advice and ENV lines)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

NOISE = ("Loading weights", "Failed to load", "_pytree", "GPT-QModel", "GIL is enabled", "Auto setting", "register_constant")


def test_loading_the_engine_and_gptqmodel_prints_no_library_noise(tiny_folder) -> None:
    script = ("import servelab.engine.engine\n"
              "from servelab.engine.loader import load_dense_model\n"
              "from servelab.config import ServingConfig\n"
              "from servelab.settings import Settings\n"
              f"load_dense_model(ServingConfig(name='q', model='{tiny_folder}'), Settings(cache_dir='{REPO / '.cache'}'))\n"
              "from servelab.engine.awq.gptq_cpu import import_gptqmodel\n"
              "import_gptqmodel()\n"
              "print('loaded')\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    printed = done.stdout + done.stderr
    assert "loaded" in done.stdout
    assert not [n for n in NOISE if n in printed], printed
