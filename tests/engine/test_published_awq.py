"""Published AWQ checkpoints served as they are: a folder in the layout AutoAWQ wrote (config.json's
quantization_config: awq, gemm, 4 bits, zero points) named by a config's model, loaded with no base model and no
cache slot, and the layouts servelab does not read refused by name.

The published checkpoint is made here: a tiny random Llama RTN-quantised by servelab (gptqmodel writes the gemm
layout), copied out of the cache and stripped to what a downloaded one holds (config.json with AutoAWQ's
quantization_config, the weights, the tokenizer files).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from servelab.config import ServingConfig
from servelab.engine import awq
from servelab.engine.engine import Engine
from servelab.engine.kernels import load_blocked_kernel
from servelab.engine.loader import ModelLoadError, load_model
from servelab.engine.model_files import describe_weights
from servelab.request import GenerationRequest, SamplingParams
from servelab.settings import Settings
from tests.engine.conftest import save_tiny_llama, with_built_kernels

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None, reason="needs gptqmodel==7.6.0")

PROMPTS = ["The capital of France is", "A man is sitting on a roof. He", "Seven blue houses stood by the river"]
# what AutoAWQ writes into config.json (transformers and gptqmodel read the same)
AUTOAWQ_QUANTIZATION_CONFIG = {"bits": 4, "group_size": 64, "modules_to_not_convert": None, "quant_method": "awq",
                               "version": "gemm", "zero_point": True}
SERVELAB_FILES = (awq.RECORD_FILE, "quant_log.csv", "quantize_config.json")  # what a download does not hold


def _config(model: Path, **awq_fields) -> ServingConfig:
    return ServingConfig.from_dict({
        "name": "tiny-awq", "model": str(model), "weights": "awq-int4", "device": "cpu",
        "decoding": {"max_new_tokens": 16, "max_context_tokens": 128}, "awq": awq_fields,
    })


@pytest.fixture(scope="module")
def awq_settings(tmp_path_factory) -> Settings:
    return Settings(cache_dir=with_built_kernels(tmp_path_factory.mktemp("published-awq-cache")))


@pytest.fixture(scope="module")
def rtn_config(tmp_path_factory, bundled_folder: str) -> ServingConfig:
    base = save_tiny_llama(tmp_path_factory.mktemp("tiny-base"), bundled_folder, hidden_size=128, intermediate_size=256)
    return _config(base, method="rtn")


@pytest.fixture(scope="module")
def published(rtn_config: ServingConfig, awq_settings: Settings, tmp_path_factory) -> Path:
    """servelab's RTN checkpoint of the tiny model, copied out of the cache as a downloaded AWQ checkpoint."""
    record = awq.quantize_rtn(rtn_config, awq_settings, progress=lambda _: None)
    folder = tmp_path_factory.mktemp("downloads") / "tiny-llama-awq"
    shutil.copytree(record.checkpoint, folder)
    for name in SERVELAB_FILES:
        (folder / name).unlink()
    hf = json.loads((folder / "config.json").read_text())
    hf["quantization_config"] = AUTOAWQ_QUANTIZATION_CONFIG
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    assert {p.name for p in folder.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    return folder


def _edited(published: Path, folder: Path, edit) -> Path:
    """The published checkpoint with its config.json edited (its other files linked, not copied)."""
    folder.mkdir()
    for path in published.iterdir():
        if path.name != "config.json":
            (folder / path.name).symlink_to(path)
    hf = json.loads((published / "config.json").read_text())
    edit(hf)
    (folder / "config.json").write_text(json.dumps(hf))
    return folder


def _greedy_tokens(engine: Engine) -> list[list[int]]:
    requests = [GenerationRequest(f"r{i}", prompt=p, params=SamplingParams(max_new_tokens=8))
                for i, p in enumerate(PROMPTS)]
    return [list(c.token_ids) for c in engine.generate(requests).completions]


def test_a_published_checkpoint_is_served_as_it_is_with_the_self_quantised_tokens(
        published: Path, rtn_config: ServingConfig, awq_settings: Settings) -> None:
    slots_before = sorted((awq_settings.model_cache_dir / "awq").iterdir())
    engine = Engine.from_config(_config(published), awq_settings)
    assert engine.loaded.folder == str(published)  # no base model, no cache slot: the folder itself
    assert sorted((awq_settings.model_cache_dir / "awq").iterdir()) == slots_before, "nothing was quantised"
    assert awq.awq_checkpoint_dir(_config(published), awq_settings) == published
    assert describe_weights(str(published)).startswith("the published awq int4 checkpoint (group size 64)")
    assert engine.decoder.name == "servelab"
    if load_blocked_kernel(awq_settings.cache_dir).module is not None:  # the AWQ tensors laid out for servelab's kernel
        assert engine.kernel.startswith("servelab decoder, int4 servelab") and engine.released_bytes > 0
    own = _greedy_tokens(engine)
    assert all(len(tokens) == 8 for tokens in own)
    self_quantised = Engine.from_config(rtn_config, awq_settings)
    assert self_quantised.loaded.folder != str(published)
    assert _greedy_tokens(self_quantised) == own  # the same tensors through the same kernel


def test_quantize_refuses_a_folder_that_is_already_an_awq_checkpoint(published: Path, awq_settings: Settings) -> None:
    with pytest.raises(awq.AWQCheckpointError, match="already an AWQ int4 checkpoint") as info:
        awq.quantize(_config(published), awq_settings, progress=lambda _: None)
    assert str(published) in str(info.value) and "serves it as it is" in str(info.value)


def test_full_precision_weights_on_a_published_checkpoint_are_refused(published: Path, settings: Settings) -> None:
    config = ServingConfig.from_dict({"name": "dense", "model": str(published), "weights": "fp32", "device": "cpu"})
    with pytest.raises(ModelLoadError, match="holds quantised weights .*quant_method 'awq'.* weights: awq-int4"):
        load_model(config, settings)


def test_the_config_must_state_the_checkpoints_layout(published: Path, awq_settings: Settings) -> None:
    with pytest.raises(awq.AWQCheckpointError,
                       match=r"awq.group_size is 32, the checkpoint's 64 .*set awq \{group_size: 64\}"):
        load_model(_config(published, group_size=32), awq_settings)
    with pytest.raises(awq.AWQCheckpointError, match="awq.method 'rtn' asks servelab to quantise"):
        load_model(_config(published, method="rtn"), awq_settings)


def _set(field: str, value):
    return lambda hf: hf["quantization_config"].__setitem__(field, value)


@pytest.mark.parametrize(("edit", "message"), [
    (_set("version", "gemv"), r"version 'gemv' \(qweight packed along the inputs.*gemm packing only"),
    (_set("version", "marlin"), r"version 'marlin' \(tensors repacked for the Marlin kernel\)"),
    (_set("bits", 8), "has bits 8; servelab serves 4-bit AWQ weights only"),
    (_set("quant_method", "gptq"), "has quant_method 'gptq'; weights: awq-int4 serves AWQ checkpoints"),
    (_set("zero_point", False), "has zero_point False; servelab reads AWQ's asymmetric int4 with zero points"),
    (lambda hf: hf["quantization_config"].pop("version"), r"has version None \(it names no layout\)"),
    (lambda hf: hf.__setitem__("quantization_config", "awq"), "quantization_config is 'awq', not a mapping"),
    (lambda hf: hf.pop("quantization_config"),
     r"has no quantization_config, but .* holds packed int4 tensors \(model\.layers\.0\..*\.qweight, 14 in all\)"),
], ids=["gemv", "marlin", "8-bit", "gptq", "no-zero-point", "no-version", "not-a-mapping", "no-quantization-config"])
def test_a_layout_servelab_does_not_read_is_refused_by_name(published: Path, awq_settings: Settings, tmp_path: Path,
                                                            edit, message: str) -> None:
    folder = _edited(published, tmp_path / "checkpoint", edit)
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(_config(folder), awq_settings)
    assert str(folder) in str(info.value)


def test_tensors_that_disagree_with_the_declared_group_size_name_the_tensor(published: Path, awq_settings: Settings,
                                                                           tmp_path: Path) -> None:
    folder = _edited(published, tmp_path / "checkpoint", _set("group_size", 32))
    with pytest.raises(awq.AWQCheckpointError, match=r"proj\.qzeros is \(\(\d+, \d+\), 'I32'\), expected \(\d+, \d+\) "
                                                     r"I32 for AWQ's gemm layout at group_size 32"):
        load_model(_config(folder, group_size=32), awq_settings)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_serves_a_published_checkpoint_through_gptqmodels_kernel(published: Path, awq_settings: Settings) -> None:
    loaded = load_model(ServingConfig.from_dict({**_config(published).model_dump(), "device": "cuda"}), awq_settings)
    assert loaded.dtype == torch.float16 and loaded.folder == str(published)
    assert "Aten" not in awq.kernel_name(loaded.model)
    ids = loaded.tokenizer(PROMPTS[0], return_tensors="pt").input_ids.to(loaded.device)
    assert torch.isfinite(loaded.model(input_ids=ids).logits).all()
