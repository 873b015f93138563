"""Llamas of real shapes with random weights for `servelab check-gpu`, and their int4 twins in AWQ's layout.

Knows the shapes of Llama-3.2-1B and Llama-3.1-8B (and a tiny one for the CPU dry run), how to make such a model on a
device with transformers' own initialisation around the bundled tokenizer, and how to write its layer linears as
round-to-nearest int4 in AWQ's GEMM layout (a published checkpoint servelab's loader serves as it is) with the same
model holding their dequantised values beside it. Does not run or compare anything (servelab/lab/check_gpu.py does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from servelab.engine.loader import LoadedModel, model_shape

# NOTE: transformers initialises every projection from N(0, initializer_range) and norms at 1: the hidden state then
# carries context, but the logits spread only ~std x sqrt(hidden) (0.9 at Llama-3.2-1B's shape), so the top two of
# 128,256 are often a few hundredths apart and float noise would pick between them. The final norm's weight is set so
# that they spread this much instead (top-2 gaps of about a nat on average): the same computation, larger numbers
LOGIT_STD = 7.0
@dataclass(frozen=True)
class LlamaShape:
    """A Llama's shape, as its config.json states it."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tied: bool
    max_positions: int
    rope_factor: float
    rope_original_positions: int
    rope_theta: float = 500_000.0
    init_std: float = 0.02  # transformers' initializer_range

    def config(self, tokenizer):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, max_position_embeddings=self.max_positions, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "llama3", "rope_theta": self.rope_theta, "factor": self.rope_factor,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": self.rope_original_positions},
            tie_word_embeddings=self.tied, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, initializer_range=self.init_std)

    @property
    def num_parameters(self) -> int:
        layer = (self.hidden_size * (self.hidden_size // self.num_heads) * (2 * self.num_heads + 2 * self.num_kv_heads)
                 + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size)
        return self.num_layers * layer + self.vocab_size * self.hidden_size * (1 if self.tied else 2) + self.hidden_size


# NOTE: the shapes of the releases' config.json files (Llama-3.2-1B: tied, rope factor 32; Llama-3.1-8B: untied,
# factor 8). The tiny one has the bundled tokenizer's 49,152 tokens: on a CPU its output layer is most of a step
# (128,256 x 128 took 5 of the dry run's 9 s of tokens), and the vocabulary's size changes no code path
SHAPES = {
    "1b": LlamaShape("Llama-3.2-1B", 2048, 16, 32, 8, 8192, 128_256, True, 131_072, 32.0, 8192),
    "8b": LlamaShape("Llama-3.1-8B", 4096, 32, 32, 8, 14_336, 128_256, False, 131_072, 8.0, 8192),
    # NOTE: at hidden 64 a layer adds about std^2 x hidden to the residual against the embedding's std: at 0.02 the
    # embedding of the last token dominates and a tied model repeats it forever; at 0.2 (the suite's tiny model's) the
    # layers outweigh it x13, as 0.02 gives x41 at Llama-3.2-1B's 2048 (its greedy tokens vary, top-2 gaps 0.1-6 nats)
    "tiny": LlamaShape("tiny Llama (dry run)", 64, 2, 4, 2, 128, 49_152, True, 1024, 8.0, 256, init_std=0.2),
}


@torch.inference_mode()
def random_llama(shape: LlamaShape, tokenizer, *, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A Llama of this shape with seeded random weights (transformers' own initialisation, the final norm at
    the logits spread LOGIT_STD), made on the device."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):  # NOTE: made in its dtype on its device: an 8B model in fp32 first would take 32 GB
        model = AutoModelForCausalLM.from_config(shape.config(tokenizer), dtype=dtype)
    model.model.norm.weight.fill_(LOGIT_STD / (shape.init_std * shape.hidden_size ** 0.5))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval()


def loaded_model(model, tokenizer, *, dtype: torch.dtype, device: torch.device, folder: str) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=tokenizer, device=device, dtype=dtype, folder=folder,
                       shape=model_shape(model.config), load_s=0.0)


def pack_int32_columns(values: torch.Tensor) -> torch.Tensor:
    """(rows, cols) values 0..15 -> (rows, cols / 8) int32 in AWQ's interleaved nibble order: the inverse of
    servelab.engine.awq.unpack.unpack_int32_columns."""
    from servelab.engine.awq.unpack import ORDER

    rows, cols = values.shape
    nibbles = values.to(torch.int64).reshape(rows, cols // 8, 8)[:, :, list(ORDER)]  # nibble i holds output ORDER[i]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    packed = (nibbles << shifts).sum(-1)  # < 2^32
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def rtn_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric int4 per group of inputs (AWQ's grid with zero points) -> AWQ's GEMM tensors:
    qweight (in, out / 8) int32, qzeros (in / group, out / 8) int32, scales (in / group, out) fp16."""
    out_features, in_features = weight.shape
    w = weight.float().reshape(out_features, in_features // group, group)
    low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    scales = ((high - low) / 15).clamp(min=1e-5).half()  # NOTE: the stored fp16 scale is the one quantised with
    zeros = (-low / scales.float()).round().clamp(0, 15)
    q = (w / scales.float()[..., None]).round().add(zeros[..., None]).clamp(0, 15).reshape(out_features, in_features)
    return (pack_int32_columns(q.to(torch.uint8).t().contiguous()), pack_int32_columns(zeros.to(torch.uint8).t().contiguous()),
            scales.t().contiguous())


LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")


@torch.inference_mode()
def write_awq_checkpoint(model, tokenizer, folder: Path, group: int) -> None:
    """The model's layer linears as RTN int4 in AWQ's GEMM layout, everything else in fp16, as a published AWQ
    checkpoint (config.json declaring quantization_config) with the tokenizer's files."""
    from safetensors.torch import save_file

    tensors = {}
    for name, tensor in model.state_dict().items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.split(".", 3)[-1] in LAYER_LINEARS:
            qweight, qzeros, scales = rtn_int4(tensor, group)
            tensors |= {f"{module}.qweight": qweight.cpu(), f"{module}.qzeros": qzeros.cpu(),
                        f"{module}.scales": scales.cpu()}
        elif not (name == "lm_head.weight" and model.config.tie_word_embeddings):
            tensors[name] = tensor.half().contiguous().cpu()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config |= {"dtype": "float16", "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@torch.inference_mode()
def dequantised_reference(model, folder: Path):
    """The model (changed in place) with each layer linear holding the checkpoint's int4 weights dequantised by
    servelab's own unpacking, in the model's dtype: what the int4 kernels compute, without their rounding."""
    from safetensors.torch import load_file

    from servelab.engine.awq.unpack import dequantize, unpack_awq

    tensors = load_file(folder / "model.safetensors")
    for name, module in model.named_modules():
        if name.split(".", 3)[-1] in LAYER_LINEARS and f"{name}.qweight" in tensors:
            parts = (tensors[f"{name}.{t}"] for t in ("qweight", "qzeros", "scales"))
            module.weight.copy_(dequantize(*unpack_awq(*parts)).to(module.weight.dtype))
    return model


@torch.inference_mode()
def dense_twin(loaded: LoadedModel, shape: LlamaShape, tokenizer):
    """A dense model of the int4 model's shape holding its unquantised tensors (embedding, norms, output layer); the
    layer linears are filled from the checkpoint by dequantised_reference."""
    twin = random_llama(shape, tokenizer, dtype=loaded.dtype, device=loaded.device, seed=1)
    own = dict(loaded.model.named_parameters())
    for name, parameter in twin.named_parameters():
        if name.removesuffix(".weight").split(".", 3)[-1] in LAYER_LINEARS:
            continue
        if name not in own or own[name].shape != parameter.shape:
            raise ValueError(f"the int4 model holds no {name} of shape {tuple(parameter.shape)} to copy")
        parameter.copy_(own[name])
    return twin
