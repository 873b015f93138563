"""AWQ int4: quantise a tiny random Llama once, load it back as packed int4 modules, and refuse bad checkpoints.

The tiny model (2 layers, hidden 128) keeps quantisation to seconds; the bundled tokenizer makes the
calibration windows real. The full bundled model is measured in benchmarks, not here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from servelab.config import ServingConfig
from servelab.engine import awq
from servelab.engine.engine import Engine
from servelab.engine.kernels import load_blocked_kernel
from servelab.engine.linear import Int4Linear, ServelabInt4Linear
from servelab.engine.measure import tensor_storage_bytes, weight_bytes
from servelab.request import GenerationRequest, SamplingParams
from servelab.settings import Settings
from tests.engine.conftest import (assert_prompt_steps_equal_the_layer_loop, assert_stack_equals_the_layer_loop,
                                   save_tiny_llama, with_built_kernels)
from tests.engine.naive import naive_greedy

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None, reason="needs gptqmodel==7.6.0")

PROMPTS = ["The capital of France is", "A man is sitting on a roof. He", "Seven blue houses stood by the river"]


def _awq_config(model: str | Path, **awq) -> ServingConfig:
    return ServingConfig.from_dict({
        "name": "tiny-awq", "model": str(model), "weights": "awq-int4", "device": "cpu",
        "decoding": {"max_new_tokens": 16, "max_context_tokens": 128},
        "awq": {"num_calibration_samples": 8, "calibration_seq_len": 64, **awq},
    })


@pytest.fixture(scope="module")
def awq_settings(tmp_path_factory) -> Settings:
    return Settings(cache_dir=with_built_kernels(tmp_path_factory.mktemp("awq-cache")),
                    state_dir=tmp_path_factory.mktemp("awq-state"))


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory, bundled_folder: str) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-base"), bundled_folder, hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def tiny_config(tiny_base: Path) -> ServingConfig:
    return _awq_config(tiny_base)


@pytest.fixture(scope="module")
def quantized(tiny_config: ServingConfig, awq_settings: Settings) -> awq.QuantizeRecord:
    return awq.quantize(tiny_config, awq_settings, progress=lambda _: None)


@pytest.fixture(scope="module")
def loaded(quantized: awq.QuantizeRecord, tiny_config: ServingConfig, awq_settings: Settings):
    return awq.load_awq_model(tiny_config, awq_settings)


def _copy_checkpoint(record: awq.QuantizeRecord, config: ServingConfig, settings: Settings) -> Path:
    """The checkpoint copied to where `config` looks for its own, under another cache."""
    target = awq.awq_checkpoint_dir(config, settings)
    shutil.copytree(record.checkpoint, target)
    return target


@torch.inference_mode()
def _logits(model, tokenizer, prompt: str) -> torch.Tensor:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    return model(input_ids=ids).logits[0].float()  # (T, V)


# --- calibration ---


def test_calibration_windows_are_exact_length_and_deterministic(tiny_base: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_base)
    cfg = _awq_config(tiny_base, num_calibration_samples=6, calibration_seq_len=48).awq
    windows = awq.calibration_windows(cfg, tokenizer)
    assert [len(w) for w in windows] == [48] * 6
    assert windows == awq.calibration_windows(cfg, tokenizer)
    assert awq.calibration_texts(cfg, tokenizer)[0].startswith("Roof shingle removal: A man is sitting on a roof.")


def test_calibration_set_chooses_the_text(tiny_base: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_base)
    text = awq.calibration_texts(_awq_config(tiny_base, calibration_set="arc_easy").awq, tokenizer)[0]
    assert text.startswith("Question:") and "Roof shingle" not in text


def test_asking_more_calibration_text_than_the_set_has_is_refused(tiny_base: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_base)
    cfg = _awq_config(tiny_base, calibration_set="arc_easy", num_calibration_samples=4096,
                      calibration_seq_len=4096).awq
    with pytest.raises(ValueError, match="fewer or shorter samples"):
        awq.calibration_windows(cfg, tokenizer)


# --- quantising and the cache ---


def test_batched_clip_search_picks_the_same_clips_as_gptqmodel() -> None:
    awq.import_gptqmodel()
    from gptqmodel.looper.awq_processor import AWQProcessor

    processor = AWQProcessor.__new__(AWQProcessor)  # only its quant settings and quantiser are used
    processor.qcfg = type("QuantSettings", (), {"group_size": 64, "sym": False, "bits": 4})()
    torch.manual_seed(0)
    w = torch.randn(320, 128) * 0.05  # 320 rows: two row chunks of the batched search
    x = torch.randn(512, 128)
    x[:, :3] *= 20  # outlier input channels, as in real activations
    want = AWQProcessor._compute_best_clip(processor, w, x)  # fp32: both searches are exact
    got = awq.batched_best_clip(processor, w, x)
    assert got.shape == want.shape == (320, 2, 1)
    assert torch.equal(got, want)
    assert (got < w.reshape(320, 2, 64).abs().amax(-1, keepdim=True)).any(), "some groups are clipped"


def test_quantize_writes_a_checkpoint_with_its_record(quantized: awq.QuantizeRecord, awq_settings: Settings,
                                                      tiny_config: ServingConfig) -> None:
    folder = Path(quantized.checkpoint)
    assert folder == awq.awq_checkpoint_dir(tiny_config, awq_settings)
    assert not quantized.is_reused and quantized.method == "awq" and quantized.quantize_s > 0
    on_disk = json.loads((folder / awq.RECORD_FILE).read_text())
    assert on_disk["calibration_set"] == "hellaswag" and on_disk["num_calibration_samples"] == 8
    assert on_disk["calibration_seq_len"] == 64 and on_disk["group_size"] == 64
    assert not list(folder.parent.glob("*.partial")), "a finished quantisation leaves no staging folder"
    hf = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert (hf["quant_method"], hf["bits"], hf["group_size"], hf["zero_point"]) == ("awq", 4, 64, True)
    # gptqmodel's per-run log went under the state folder, not into ./logs of the folder the command ran in
    assert list((awq_settings.state_dir / "logs" / "gptqmodel").glob("awq_log_*.log"))
    from gptqmodel.looper import loop_processor

    assert loop_processor._PROJECT_LOG_DIR == Path("logs")  # gptqmodel's own setting restored after


def test_second_quantize_reuses_the_checkpoint(quantized: awq.QuantizeRecord, tiny_config: ServingConfig,
                                               awq_settings: Settings) -> None:
    weights = Path(quantized.checkpoint) / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    again = awq.quantize(tiny_config, awq_settings, progress=lambda _: None)
    assert again.is_reused and again.checkpoint == quantized.checkpoint
    assert again.quantize_s == quantized.quantize_s and weights.stat().st_mtime_ns == mtime


def test_cache_key_follows_the_calibration(tiny_config: ServingConfig, tiny_base: Path, awq_settings: Settings) -> None:
    other = _awq_config(tiny_base, num_calibration_samples=9)
    assert awq.awq_checkpoint_dir(other, awq_settings) != awq.awq_checkpoint_dir(tiny_config, awq_settings)
    # RTN reads no calibration text, so its checkpoint does not depend on it
    assert (awq.awq_checkpoint_dir(other, awq_settings, method="rtn")
            == awq.awq_checkpoint_dir(tiny_config, awq_settings, method="rtn"))


def test_group_size_that_does_not_divide_the_hidden_size_is_refused(settings: Settings, bundled_folder: str) -> None:
    config = _awq_config("bundled:smollm2-135m-instruct", group_size=128)  # hidden size 576 = 4.5 x 128
    with pytest.raises(ValueError, match=r"group_size 128 .* hidden_size \(576\).*\[32, 64\]"):
        awq.quantize(config, settings, progress=lambda _: None)


# --- loading ---


def test_loaded_layers_are_packed_int4_modules(loaded, tiny_base: Path) -> None:
    base = LlamaForCausalLM.from_pretrained(tiny_base)
    base_linears = {n: m for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    modules = dict(loaded.model.named_modules())
    assert len(base_linears) == 14
    for name, linear in base_linears.items():
        quant = modules[name]
        assert not isinstance(quant, torch.nn.Linear), f"{name} was left in full precision"
        packed_bytes = quant.qweight.numel() * quant.qweight.element_size()
        assert packed_bytes * 2 == linear.in_features * linear.out_features, f"{name} is not 4 bits per weight"
    assert awq.kernel_name(loaded.model) == "AwqAtenLinear"  # servelab's own layers: no gptqmodel to serve


def test_servelabs_layers_compute_what_gptqmodels_aten_layers_do(loaded, quantized: awq.QuantizeRecord) -> None:
    """ATen's int4 matmul through servelab's layers (its packing, its scales and zeros) gives gptqmodel's ATen layers'
    logits to the bit: the same weights, two implementations of their packing."""
    from servelab.engine.awq.load import _from_pretrained

    theirs = _from_pretrained(Path(quantized.checkpoint), loaded.device, loaded.dtype,
                              _awq_config(quantized.checkpoint, kernel="aten").awq)
    assert awq.kernel_name(theirs) == "TorchAtenAwqLinear"
    for prompt in PROMPTS:
        torch.testing.assert_close(_logits(loaded.model, loaded.tokenizer, prompt),
                                   _logits(theirs, loaded.tokenizer, prompt), atol=0, rtol=0)


def test_serving_int4_on_cpu_never_imports_gptqmodel(quantized, tiny_config: ServingConfig,
                                                     awq_settings: Settings) -> None:
    """A worker serving int4 on a CPU loads no gptqmodel (its import brings pyarrow, pandas and datasets)."""
    script = (
        "import sys\n"
        "from servelab.config import ServingConfig\n"
        "from servelab.engine.engine import Engine\n"
        "from servelab.settings import Settings\n"
        f"config = ServingConfig.from_dict({tiny_config.model_dump(mode='json')!r})\n"
        f"engine = Engine.from_config(config, Settings(cache_dir={str(awq_settings.cache_dir)!r}))\n"
        "print(engine.kernel)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('gptqmodel', 'pyarrow', 'datasets')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SERVELAB_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    kernel, modules = done.stdout.strip().splitlines()[-2:]
    assert kernel.startswith("servelab decoder") and modules == "[]", done.stdout


def test_checkpoint_stores_int32_packed_qweight(quantized: awq.QuantizeRecord) -> None:
    from safetensors import safe_open

    with safe_open(Path(quantized.checkpoint) / "model.safetensors", "pt") as handle:
        qweight = handle.get_tensor("model.layers.0.self_attn.q_proj.qweight")
        scales = handle.get_tensor("model.layers.0.self_attn.q_proj.scales")
        qzeros = handle.get_tensor("model.layers.0.self_attn.q_proj.qzeros")
        assert "model.layers.0.self_attn.q_proj.weight" not in handle.keys()
    assert qweight.dtype == torch.int32 and tuple(qweight.shape) == (128, 128 // 8)  # (in, out / 8 nibbles)
    assert tuple(scales.shape) == (128 // 64, 128) and tuple(qzeros.shape) == (2, 16)  # one per group x out
    assert len(torch.unique(qzeros)) > 1, "asymmetric quantisation has a zero point per group"


def test_weight_bytes_count_the_packed_tensors(loaded, tiny_base: Path) -> None:
    quantized_bytes = sum(
        b.numel() * b.element_size() for m in loaded.model.modules() if hasattr(m, "qweight") for b in m.buffers()
    )
    num_weights = 2 * (4 * 128 * 128 // 2 + 128 * 32 * 2 + 3 * 128 * 256)  # 2 layers: q,o + k,v + gate,up,down
    assert 0.5 * num_weights <= quantized_bytes <= 0.6 * num_weights  # 4 bits + a scale and zero per 64
    embedding = loaded.model.model.embed_tokens.weight  # tied with the head; fp32 or bf16 by CPU
    embedding_bytes = embedding.numel() * embedding.element_size()
    assert weight_bytes(loaded.model) >= quantized_bytes + embedding_bytes
    assert weight_bytes(loaded.model) < quantized_bytes + embedding_bytes + 10_000  # norms only


def test_rtn_baseline_shares_the_layout_and_kernel_but_not_the_weights(
        loaded, quantized: awq.QuantizeRecord, tiny_config: ServingConfig, awq_settings: Settings,
        tiny_base: Path) -> None:
    # NOTE: whether AWQ beats RTN is a quality question for the real model on LAMBADA; a random tiny
    # model has no activation outliers for AWQ to protect, so only the mechanics are checked here.
    from safetensors.torch import load_file

    rtn_record = awq.quantize_rtn(tiny_config, awq_settings, progress=lambda _: None)
    assert rtn_record.method == "rtn" and rtn_record.calibration_set is None
    rtn = awq.load_awq_model(tiny_config, awq_settings, method="rtn")
    assert awq.kernel_name(rtn.model) == awq.kernel_name(loaded.model)
    awq_tensors = load_file(Path(quantized.checkpoint) / "model.safetensors")
    rtn_tensors = load_file(Path(rtn_record.checkpoint) / "model.safetensors")
    assert awq_tensors.keys() == rtn_tensors.keys()
    key = "model.layers.0.mlp.up_proj.scales"
    assert not torch.equal(awq_tensors[key].float(), rtn_tensors[key].float()), "AWQ rescales; RTN does not"
    reference = AutoModelForCausalLM.from_pretrained(tiny_base, dtype=torch.float32)
    for prompt in PROMPTS:
        want = _logits(reference, loaded.tokenizer, prompt)
        for model in (loaded.model, rtn.model):
            got = _logits(model, loaded.tokenizer, prompt)
            assert (got - want).pow(2).mean() < 0.5 * want.pow(2).mean(), prompt  # garbage is ~1x or more


class _OwnKernel(torch.nn.Module):
    """One AWQ layer through servelab's int4 kernel, as a module transformers' forward can call."""

    def __init__(self, linear: ServelabInt4Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


@pytest.mark.parametrize("activations", ["int8", "float"])
def test_engine_decodes_the_awq_model_like_naive_greedy(quantized, tiny_config: ServingConfig,
                                                        awq_settings: Settings, activations: str) -> None:
    """servelab's own int4 kernel where this CPU runs a build (else gptqmodel's ATen layers, joined): the engine
    (batched, cached, q/k/v joined) against transformers' forward with the same kernel in each layer, on int8 or
    fp32 activations."""
    awq_config = tiny_config.awq.model_copy(update={"activations": activations})
    engine = Engine.from_config(tiny_config.model_copy(update={"awq": awq_config}), awq_settings)
    float_activations = activations == "float"
    blocked = load_blocked_kernel(awq_settings.cache_dir)
    # NOTE: the serving engine emptied the int4 layers it laid out for its own kernel (one copy of the
    # weights); engine.model is a fresh load of gptqmodel's layers
    assert (engine.released_bytes > 0) == (blocked.module is not None)
    reference = engine.model
    if blocked.module is not None:
        for layer in engine.decoder.layers:  # the integer path at every row count, in both
            for projection in (layer.qkv, layer.o, layer.gate_up, layer.down):
                projection.int_rows = 1 << 30
        for name, module in list(reference.named_modules()):
            if hasattr(module, "qweight"):
                parent, _, child = name.rpartition(".")
                setattr(reference.get_submodule(parent), child,
                        _OwnKernel(ServelabInt4Linear(blocked, [module], 1 << 30, float_activations)))
    requests = [GenerationRequest(f"r{i}", prompt=p, params=SamplingParams(max_new_tokens=8))
                for i, p in enumerate(PROMPTS)]
    result = engine.generate(requests)
    for request, completion in zip(requests, result.completions):
        expected = naive_greedy(reference, engine.encode(request), 8, engine.eos_token_ids)
        assert list(completion.token_ids) == expected, request.prompt
    fused = engine.decoder.layers[0].qkv  # q/k/v int4 weights joined: one int4 matmul
    if blocked.module is not None:
        assert engine.decoder._decode_stack() is not None  # the decode steps above ran every layer in one call
        assert isinstance(fused, ServelabInt4Linear) and fused.float_activations == float_activations
        assert engine.kernel.startswith("servelab decoder, int4 servelab")  # reported with every run
        assert ("fp32 activations" in engine.kernel) == float_activations
        assert engine.loaded.model.model.layers[0].self_attn.q_proj.qweight.numel() == 0
        own_layout = tensor_storage_bytes([t for layer in engine.decoder.layers for t in layer.qkv.tensors()])
        assert engine.weight_bytes >= own_layout > 0  # the process's weights: the decoder's layouts
    else:
        assert isinstance(fused, Int4Linear) and engine.kernel == "servelab decoder, AwqAtenLinear"


@pytest.mark.parametrize(("activations", "kv_cache_dtype"), [("int8", "auto"), ("float", "auto"), ("int8", "int8")])
@torch.inference_mode()
def test_int4_decode_stack_equals_the_python_layer_loop(quantized, tiny_config: ServingConfig,
                                                         awq_settings: Settings, activations: str,
                                                         kv_cache_dtype: str) -> None:
    """The one-call decode step (DecodeStack) runs the same kernels in the same order as the decoder's loop:
    the same logits to the bit, and the same cache, over rows of different lengths; with either activations, and
    over an int8 cache (its scales handed to the stack); as one parallel region (its team) at 1, 2 and 3 threads or
    with a region per kernel."""
    awq_config = tiny_config.awq.model_copy(update={"activations": activations})
    engine = Engine.from_config(tiny_config.model_copy(update={"awq": awq_config, "kv_cache_dtype": kv_cache_dtype}),
                                awq_settings)
    decoder = engine.decoder
    if decoder._decode_stack() is None:
        pytest.skip("servelab's int4 kernel does not serve here")
    assert_stack_equals_the_layer_loop(engine, PROMPTS, team_serves=activations == "int8")


@torch.inference_mode()
def test_int4_prompt_chunks_in_one_call_equal_the_python_layer_loop(quantized, tiny_config: ServingConfig,
                                                                   awq_settings: Settings) -> None:
    """Steps with prompt chunks, alone or beside decode rows, through every int4 layer in one call
    (DecodeStack.mixed) give the Python loop's logits and cache to the bit at 1, 2 and 3 threads."""
    batching = tiny_config.batching.model_copy(update={"max_prefill_tokens": 12})
    engine = Engine.from_config(tiny_config.model_copy(update={"batching": batching}), awq_settings)
    if engine.decoder._decode_stack() is None:
        pytest.skip("servelab's int4 kernel does not serve here")
    longer = [p + " and then, after a while, again" for p in PROMPTS[1:3]]  # NOTE: prompts of several chunks
    assert_prompt_steps_equal_the_layer_loop(engine, [PROMPTS[0], *longer])


def test_aten_kernel_joins_servelabs_layers(quantized, tiny_base: Path, awq_settings: Settings) -> None:
    engine = Engine.from_config(_awq_config(tiny_base, kernel="aten"), awq_settings)
    assert engine.kernel == "servelab decoder, AwqAtenLinear"
    assert engine.released_bytes > 0  # Int4Linear joined (copied) the layers: their own tensors are emptied
    attention = engine.model.model.layers[0].self_attn
    fused = engine.decoder.layers[0].qkv
    assert isinstance(fused, Int4Linear)
    x = torch.randn(3, attention.q_proj.in_features)
    with torch.inference_mode():
        separate = torch.cat([attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)], dim=-1)
        torch.testing.assert_close(fused(x), separate, atol=0, rtol=0)


def test_kernel_override_selects_the_torch_kernel(quantized, tiny_base: Path, awq_settings: Settings) -> None:
    loaded = awq.load_awq_model(_awq_config(tiny_base, kernel="torch"), awq_settings)
    assert awq.kernel_name(loaded.model) == "AwqTorchLinear"


# --- refusing bad checkpoints ---


def test_missing_checkpoint_tells_to_run_quantize(tiny_base: Path, awq_settings: Settings) -> None:
    config = _awq_config(tiny_base, num_calibration_samples=3)
    with pytest.raises(awq.AWQCheckpointError, match="servelab quantize --config") as info:
        awq.load_awq_model(config, awq_settings)
    assert str(awq.awq_checkpoint_dir(config, awq_settings)) in str(info.value)


def test_corrupt_checkpoint_names_the_file(quantized, tiny_config: ServingConfig, tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path)
    weights = _copy_checkpoint(quantized, tiny_config, settings) / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(awq.AWQCheckpointError, match="not a readable safetensors file") as info:
        awq.load_awq_model(tiny_config, settings)
    assert str(weights) in str(info.value)


def test_missing_weights_file_names_the_file(quantized, tiny_config: ServingConfig, tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path)
    weights = _copy_checkpoint(quantized, tiny_config, settings) / "model.safetensors"
    weights.unlink()
    with pytest.raises(awq.AWQCheckpointError, match="is missing") as info:
        awq.load_awq_model(tiny_config, settings)
    assert str(weights) in str(info.value)


def test_a_tensor_missing_from_the_checkpoint_is_named(quantized, tiny_config: ServingConfig, tmp_path: Path) -> None:
    """Beyond the layer linears the checkpoint checks: a norm missing is named, not left unallocated."""
    from safetensors.torch import load_file, save_file

    settings = Settings(cache_dir=tmp_path)
    weights = _copy_checkpoint(quantized, tiny_config, settings) / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.norm.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(awq.AWQCheckpointError, match=r"model\.norm\.weight is not in the checkpoint"):
        awq.load_awq_model(tiny_config, settings)


@pytest.fixture
def narrow_config(tmp_path: Path, bundled_folder: str) -> ServingConfig:
    """Another base model (hidden 64) whose cache slot can be filled with the wrong checkpoint."""
    return _awq_config(save_tiny_llama(tmp_path / "narrow", bundled_folder, hidden_size=64, intermediate_size=128))


def test_checkpoint_of_another_model_names_the_file(quantized, narrow_config: ServingConfig, tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path / "cache")
    folder = _copy_checkpoint(quantized, narrow_config, settings)
    with pytest.raises(awq.AWQCheckpointError, match="hidden_size: checkpoint has 128, expected 64") as info:
        awq.load_awq_model(narrow_config, settings)
    assert str(folder / "config.json") in str(info.value)


def test_checkpoint_with_wrong_tensors_names_the_tensor(quantized, narrow_config: ServingConfig,
                                                        tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path / "cache")
    folder = _copy_checkpoint(quantized, narrow_config, settings)
    hf = json.loads((folder / "config.json").read_text())
    hf.update(hidden_size=64, intermediate_size=128)  # a config edited to match; the tensors still do not
    (folder / "config.json").write_text(json.dumps(hf))
    wrong_tensor = r"proj\.qweight is \(\(\d+, \d+\), 'I32'\), expected shape"
    with pytest.raises(awq.AWQCheckpointError, match=wrong_tensor) as info:
        awq.load_awq_model(narrow_config, settings)
    assert str(folder) in str(info.value)


def test_checkpoint_with_other_quant_settings_is_refused(quantized, tiny_config: ServingConfig,
                                                         tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path)
    folder = _copy_checkpoint(quantized, tiny_config, settings)
    hf = json.loads((folder / "config.json").read_text())
    hf["quantization_config"]["group_size"] = 32
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(awq.AWQCheckpointError, match="group_size: checkpoint has 32, expected 64"):
        awq.load_awq_model(tiny_config, settings)


def test_quantize_does_not_trust_a_folder_without_its_record(quantized, tiny_config: ServingConfig,
                                                             tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path)
    folder = _copy_checkpoint(quantized, tiny_config, settings)
    (folder / awq.RECORD_FILE).unlink()  # as if a copy was interrupted: quantise again
    (folder / "model.safetensors").write_bytes(b"partial")
    record = awq.quantize(tiny_config, settings, progress=lambda _: None)
    assert not record.is_reused and (folder / awq.RECORD_FILE).is_file()
    awq.load_awq_model(tiny_config, settings)


# --- GPU ---


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_loads_a_cuda_kernel_in_fp16(quantized, tiny_base: Path, awq_settings: Settings) -> None:
    config = ServingConfig.from_dict({**_awq_config(tiny_base).model_dump(), "device": "cuda"})
    loaded = awq.load_awq_model(config, awq_settings)
    assert loaded.dtype == torch.float16 and loaded.device.type == "cuda"
    assert "Aten" not in awq.kernel_name(loaded.model)
    ids = loaded.tokenizer(PROMPTS[0], return_tensors="pt").input_ids.to(loaded.device)
    assert torch.isfinite(loaded.model(input_ids=ids).logits).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_serves_servelabs_layers_through_atens_int4_matmul(quantized, tiny_base: Path,
                                                                awq_settings: Settings) -> None:
    """awq.kernel aten on CUDA (auto's choice where gptqmodel is not installed): servelab's layers in bf16, q/k/v
    packed joined for PyTorch's tinygemm, greedy tokens equal to transformers' forward over the same layers."""
    config = ServingConfig.from_dict({**_awq_config(tiny_base, kernel="aten").model_dump(), "device": "cuda"})
    engine = Engine.from_config(config, awq_settings)
    assert engine.loaded.dtype == torch.bfloat16 and engine.kernel == "servelab decoder, AwqAtenLinear"
    assert isinstance(engine.decoder.layers[0].qkv, Int4Linear) and engine.decoder.layers[0].qkv.weight.dim() == 4
    requests = [GenerationRequest(f"r{i}", prompt=p, params=SamplingParams(max_new_tokens=8))
                for i, p in enumerate(PROMPTS)]
    result = engine.generate(requests)
    for request, completion in zip(requests, result.completions):
        expected = naive_greedy(engine.model, engine.encode(request), 8, engine.eos_token_ids)
        assert list(completion.token_ids) == expected, request.prompt
