"""Engines for the engine tests: a tiny randomly initialised Llama (fast) and the real bundled model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from servelab.config import ServingConfig
from servelab.engine.engine import Engine
from servelab.engine.kernels import load_blocked_kernel
from servelab.engine.loader import resolve_model_folder
from servelab.settings import Settings

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def settings() -> Settings:
    # NOTE: the converted bundled model is cached in the repo's .cache, shared across test runs.
    return Settings(cache_dir=REPO / ".cache")


def with_built_kernels(cache_dir: Path) -> Path:
    """cache_dir with the suite's compiled kernels linked in (REPO/.cache's builds, this CPU's best built there
    first): a test that needs a cache of its own (its measured choices, its quantised checkpoints) reads the
    same build instead of compiling its own, about 50 s each."""
    shared = REPO / ".cache" / "kernels"
    load_blocked_kernel(REPO / ".cache")
    (cache_dir / "kernels").mkdir(parents=True, exist_ok=True)
    for built in shared.iterdir() if shared.is_dir() else ():
        link = cache_dir / "kernels" / built.name
        if built.is_dir() and built.name != "choices" and not link.exists():
            link.symlink_to(built, target_is_directory=True)
    return cache_dir


@pytest.fixture(scope="session")
def bundled_folder(settings: Settings) -> str:
    return resolve_model_folder("bundled:smollm2-135m-instruct", settings)


def save_tiny_llama(folder: Path, tokenizer_folder: str, *, hidden_size: int = 64,
                    intermediate_size: int = 128) -> Path:
    """A 2-layer Llama with random weights and the bundled tokenizer (its 49,152-token vocabulary)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2,  # NOTE: spread-out logits, so greedy picks are not float-noise ties
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, bundled_folder: str) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), bundled_folder)


def make_config(model: str, **overrides) -> ServingConfig:
    data = {"name": "test", "model": model, "weights": "fp32", "device": "cpu",
            "decoding": {"max_new_tokens": 64, "max_context_tokens": 256}}
    return ServingConfig.from_dict({**data, **overrides})


@pytest.fixture(scope="session")
def tiny_engine(tiny_folder: Path, settings: Settings) -> Engine:
    return Engine.from_config(make_config(str(tiny_folder)), settings)


@pytest.fixture(scope="session")
def bundled_engine(settings: Settings) -> Engine:
    return Engine.from_config(make_config("bundled:smollm2-135m-instruct"), settings)


@pytest.fixture(scope="session")
def tiny_transformers_engine(tiny_folder: Path, settings: Settings) -> Engine:
    """The same tiny model served through transformers' forward and dynamic cache."""
    return Engine.from_config(make_config(str(tiny_folder), decoder="transformers"), settings)


@pytest.fixture(params=["servelab", "transformers"])
def either_engine(request, tiny_engine: Engine, tiny_transformers_engine: Engine) -> Engine:
    """Each decoder in turn: both must serve identically."""
    return tiny_engine if request.param == "servelab" else tiny_transformers_engine
