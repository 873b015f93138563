"""What the runner measures itself, in the project venv: the model folder, the prompt, the machine.

Knows where the bundled model's transformers folder and servelab's AWQ checkpoint are, how to build
the shared prompt ids from servelab's own bench filler (checked to survive decode + encode, since
servelab takes text), and the machine's memory bandwidth and matmul peaks per compute dtype, through
servelab's lab helpers. Does not start engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODEL = "smollm2-135m-instruct"
PEAK_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class MachineFacts:
    cpu: str
    threads: int
    bandwidth_gbs: float
    peak_flops_per_s: dict[str, float]  # compute dtype -> measured matmul FLOP/s at `threads` threads


def bundled_folder() -> Path:
    from servelab.engine.loader import ensure_bundled_folder
    from servelab.settings import Settings

    return ensure_bundled_folder(MODEL, Settings().model_cache_dir).resolve()


def awq_checkpoint(config_path: Path) -> Path:
    """Where servelab keeps the AWQ int4 checkpoint of this config (made by `servelab quantize`)."""
    from servelab.config import ServingConfig
    from servelab.engine.awq import awq_checkpoint_dir
    from servelab.settings import Settings

    return awq_checkpoint_dir(ServingConfig.from_yaml(config_path), Settings()).resolve()


def prompt_ids(folder: Path, num_tokens: int) -> list[int]:
    from transformers import AutoTokenizer

    from servelab.lab.bench import FILLER

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.encode(FILLER * (1 + num_tokens // 20), add_special_tokens=False)[:num_tokens]
    if tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) != ids:
        raise ValueError(f"a {num_tokens}-token prompt does not survive decode + encode; try another length")
    return ids


def measure_machine(threads: int) -> MachineFacts:
    import torch

    from servelab.engine.loader import DTYPES
    from servelab.hardware import describe_hardware, measure_bandwidth_gbs
    from servelab.lab.sweep import measure_peak_flops

    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    return MachineFacts(
        cpu=describe_hardware().cpu, threads=threads, bandwidth_gbs=measure_bandwidth_gbs(cpu),
        peak_flops_per_s={name: measure_peak_flops(cpu, DTYPES[name]) for name in PEAK_DTYPES},
    )
