"""A serving config's model with random weights of the real shape, for timing kernels where the model's files are
not at hand (a lent machine with more cores, say): a Llama built from a folder that holds only its config.json and
tokenizer, in the config's precision; `weights: awq-int4` gets every decoder layer's projections as AWQ gemm-layout
int4 layers (random codes, zero points and fp16 scales, the config's group size), which servelab's int4 kernel lays
out as it does a real checkpoint's. Only speed is meaningful on it: the kernels' work does not depend on the values,
the text does.

Not for quality figures, and never a stand-in for the bundled model in a test of what the model says.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from servelab.config import ServingConfig
from servelab.engine.awq.load import serving_dtype
from servelab.engine.loader import DTYPES, LoadedModel, model_shape

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class RandomAwqLinear(torch.nn.Module):
    """An int4 layer in AWQ's gemm layout: qweight (K, N / 8) and qzeros (K / group, N / 8) int32, eight 4-bit
    codes to a word, scales (K / group, N) fp16. Dequantised weights are about N(0, 0.02), like the dense init."""

    def __init__(self, in_features: int, out_features: int, group_size: int, generator: torch.Generator) -> None:
        super().__init__()
        self.in_features, self.out_features, self.bits = in_features, out_features, 4

        def words(rows: int) -> torch.Tensor:  # eight random 4-bit codes in each int32
            return torch.randint(-2**31, 2**31, (rows, out_features // 8), generator=generator,
                                 dtype=torch.int64).to(torch.int32)

        self.register_buffer("qweight", words(in_features))
        self.register_buffer("qzeros", words(in_features // group_size))
        # NOTE: codes minus zero points spread over about +-8 (sd ~6.5); 0.003 puts the weights near the dense init
        self.register_buffer("scales", torch.full((in_features // group_size, out_features), 0.003, dtype=torch.float16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("RandomAwqLinear only carries AWQ tensors for servelab's int4 kernel, which replaces it")


@torch.inference_mode()
def random_loaded(config: ServingConfig, folder: Path, seed: int = 0) -> LoadedModel:
    """config's precision on a model of folder's shape (its config.json and tokenizer), random weights, on the CPU."""
    started = time.perf_counter()
    hf_config = AutoConfig.from_pretrained(folder)
    int4 = config.weights == "awq-int4"
    dtype = serving_dtype(torch.device("cpu")) if int4 else DTYPES[config.weights]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa").eval()
    if int4:
        group = config.awq.group_size
        generator = torch.Generator().manual_seed(seed)
        for layer in model.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name in PROJECTIONS:
                    if isinstance(linear := getattr(parent, name, None), torch.nn.Linear):
                        setattr(parent, name, RandomAwqLinear(linear.in_features, linear.out_features, group, generator))
    return LoadedModel(model=model, tokenizer=AutoTokenizer.from_pretrained(folder), device=torch.device("cpu"),
                       dtype=dtype, folder=str(folder), shape=model_shape(hf_config),
                       load_s=time.perf_counter() - started)
