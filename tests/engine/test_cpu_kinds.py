"""The engine's kernel tests as an AVX2-only CPU runs them, on whatever CPU runs the suite.

torch (ATEN_CPU_CAPABILITY) and oneDNN (ONEDNN_MAX_CPU_ISA) can be capped below the CPU's instruction set,
and servelab's kernel choice follows torch's cap: so an AVX-512 machine runs the decoder tests once more
as an AVX2 + FMA machine would (oneDNN refusing bf16, servelab's AVX2 build, 'auto' measured there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from servelab.engine.kernels import ISAS, isa_reason

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(isa_reason(ISAS[0]) is not None, reason="this CPU runs as AVX2 (or less) already: "
                                                            "the suite itself is the AVX2 run")
def test_decoder_tests_pass_with_the_cpu_capped_at_avx2() -> None:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    probe = ("from servelab.engine.kernels import best_isa; from servelab.engine.linear import onednn_reason; "
             "import torch; print(best_isa().name, onednn_reason(torch.device('cpu'), torch.bfloat16) is not None)")
    seen = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert seen.stdout.split() == ["avx2", "True"], seen.stdout + seen.stderr  # the cap took hold
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                          "tests/engine/test_decoder.py"], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "servelab-avx512: torch runs at AVX2 here" in run.stdout  # skipped with its reason, not run
