"""servelab's own AWQ layers and ATen's int4 matmul (servelab/engine/awq/native.py), without gptqmodel: the packing
against servelab's dequantisation, joined projections against the layers one by one, and the shapes ATen refuses."""

from __future__ import annotations

import pytest
import torch

from servelab.engine.awq.native import AwqAtenLinear, aten_layout_reason
from servelab.engine.awq.unpack import dequantize, unpack_awq
from servelab.engine.linear import Int4Linear
from servelab.lab.gpu_models import rtn_int4

CPU = torch.device("cpu")


def _layer(out_features: int, in_features: int = 128, group: int = 64, seed: int = 0) -> AwqAtenLinear:
    """A layer holding RTN int4 of a random weight in AWQ's gemm layout, as a checkpoint would."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    qweight, qzeros, scales = rtn_int4(weight, group)
    layer = AwqAtenLinear(in_features, out_features, group, bias=False)
    layer.qweight, layer.qzeros, layer.scales = qweight, qzeros, scales
    return layer


def _dequantised(layer: AwqAtenLinear) -> torch.Tensor:
    return dequantize(*unpack_awq(layer.qweight, layer.qzeros, layer.scales))


@torch.inference_mode()
def test_a_layer_computes_its_dequantised_weight_within_bf16() -> None:
    layer = _layer(96)
    weight = _dequantised(layer)
    x = torch.randn(5, 128)
    expected = x @ weight.t()
    got = layer(x)
    assert layer.linear_mode == "inference" and not hasattr(layer, "qzeros")  # packed once, the gemm tensors freed
    assert got.dtype == x.dtype and got.shape == (5, 96)
    # NOTE: ATen rounds the activations, the scales and the zero terms to bf16: a few parts in a thousand
    torch.testing.assert_close(got, expected, atol=0.02 * expected.abs().max().item(), rtol=0.02)


@torch.inference_mode()
def test_projections_joined_before_packing_equal_the_layers_one_by_one() -> None:
    """q/k/v of 64, 32 and 32 outputs: ATen's CPU packing interleaves outputs in blocks of 64, so packed weights
    cannot be concatenated; joined before packing, each output is what its own layer gives."""
    layers = [_layer(64, seed=1), _layer(32, seed=2), _layer(32, seed=3)]
    assert Int4Linear.covers(layers)
    joined = Int4Linear(layers)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    separate = torch.cat([layer(x) for layer in layers], dim=-1)  # NOTE: packs each layer on its own
    torch.testing.assert_close(joined(x), separate, atol=0, rtol=0)


def test_packed_layers_join_only_where_each_but_the_last_fills_its_blocks() -> None:
    packed = [_layer(n, seed=n) for n in (64, 32, 32)]
    for layer in packed:
        layer.pack()
    assert not Int4Linear.covers(packed)  # concatenated, k's 32 outputs would split a block of 64
    assert Int4Linear.covers(packed[:1] + packed[1:2])  # 64 then 32: the last may end a block short
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(Int4Linear(packed[:2])(x), torch.cat([packed[0](x), packed[1](x)], -1),
                                   atol=0, rtol=0)


def test_shapes_and_devices_aten_cannot_take_are_named() -> None:
    assert aten_layout_reason(96, 128, 64, CPU) is None
    assert "multiples of 16: 40" in aten_layout_reason(40, 128, 64, CPU)
    assert not Int4Linear.covers([_layer(16), _layer(24, seed=1)])  # 40 outputs joined: each is called on its own
    assert "not on meta" in aten_layout_reason(96, 128, 64, torch.device("meta"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none here)")
@torch.inference_mode()
def test_cuda_tinygemm_computes_the_dequantised_weight_and_joins_like_the_layers() -> None:
    if aten_layout_reason(64, 128, 64, torch.device("cuda")) is not None:
        pytest.skip(aten_layout_reason(64, 128, 64, torch.device("cuda")))
    def layers():
        return [_layer(64, seed=1).cuda(), _layer(32, seed=2).cuda(), _layer(32, seed=3).cuda()]

    weights = [_dequantised(layer) for layer in layers()]
    joined_layers = layers()
    joined = Int4Linear(joined_layers)
    assert joined.weight.dim() == 4  # tinygemm's tiles: (N / 8, K / (16 x tiles), 32, tiles / 2)
    assert all(layer.linear_mode == "joined" and layer.qweight.numel() == 0 for layer in joined_layers)  # one copy
    x = torch.randn(3, 128, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ torch.cat(weights).t()
    torch.testing.assert_close(joined(x).float(), expected, atol=0.02 * expected.abs().max().item(), rtol=0.02)
    torch.testing.assert_close(joined(x), torch.cat([layer(x) for layer in layers()], dim=-1), atol=0, rtol=0)


@torch.inference_mode()
def test_a_layer_freed_after_joining_says_so_when_called() -> None:
    layer = _layer(64)
    assert layer.free_joined() == 128 * 8 * 4 + 2 * 8 * 4 + 2 * 64 * 2  # qweight, qzeros (int32), scales (fp16)
    with pytest.raises(RuntimeError, match="packed into a joined matmul of servelab's decoder and freed"):
        layer(torch.randn(1, 128))


@pytest.fixture
def published(tmp_path, bundled_folder: str):
    """A tiny Llama's RTN int4 written as a published AWQ checkpoint (check-gpu's writer), and the tensors it holds."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from servelab.lab.gpu_models import SHAPES, random_llama, write_awq_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(bundled_folder)
    model = random_llama(SHAPES["tiny"], tokenizer, dtype=torch.float32, device=CPU, seed=1)
    write_awq_checkpoint(model, tokenizer, tmp_path, 64)
    return tmp_path, load_file(tmp_path / "model.safetensors")


def _rewrite(folder, tensors) -> None:
    from safetensors.torch import save_file

    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_the_loader_ignores_a_stored_computed_buffer_and_names_a_tensor_of_the_wrong_shape(published) -> None:
    from servelab.engine.awq.layout import AWQCheckpointError
    from servelab.engine.awq.native import load_native

    folder, tensors = published
    computed = load_native(folder, CPU, torch.float32, "sdpa", 64).model.rotary_emb.inv_freq.clone()
    _rewrite(folder, {**tensors, "model.rotary_emb.inv_freq": torch.zeros_like(computed).half()})
    model = load_native(folder, CPU, torch.float32, "sdpa", 64)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, computed, atol=0, rtol=0)  # as transformers: ignored
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: the checkpoint stores the embedding once
    norm = tensors["model.norm.weight"]
    _rewrite(folder, {**tensors, "model.norm.weight": torch.cat([norm, norm])})
    with pytest.raises(AWQCheckpointError, match=r"model\.norm\.weight is \(128,\), .* takes \(64,\)"):
        load_native(folder, CPU, torch.float32, "sdpa", 64)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none here)")
def test_cuda_engine_serves_a_published_checkpoint_through_tinygemm_like_naive_greedy(published, settings) -> None:
    """The path a CUDA host without gptqmodel takes (awq.kernel aten, auto's pick there): servelab's layers in bf16,
    q/k/v and gate/up packed joined and their checkpoint tensors freed, greedy tokens equal to transformers' forward
    over a fresh load of the same layers."""
    from servelab.config import ServingConfig
    from servelab.engine.engine import Engine
    from servelab.request import GenerationRequest, SamplingParams
    from tests.engine.naive import naive_greedy

    folder, _ = published
    config = ServingConfig.from_dict({
        "name": "tiny-int4-cuda", "model": str(folder), "weights": "awq-int4", "device": "cuda",
        "decoding": {"max_new_tokens": 8, "max_context_tokens": 128}, "awq": {"group_size": 64, "kernel": "aten"}})
    engine = Engine.from_config(config, settings)
    assert engine.loaded.dtype == torch.bfloat16 and engine.kernel == "servelab decoder, AwqAtenLinear"
    assert isinstance(engine.decoder.layers[0].qkv, Int4Linear) and engine.released_bytes > 0
    prompts = [list(range(100 + i, 110 + 2 * i)) for i in range(3)]
    requests = [GenerationRequest(f"r{i}", prompt=engine.tokenizer.decode(ids), prompt_token_ids=tuple(ids),
                                  params=SamplingParams(max_new_tokens=8, ignore_eos=True))
                for i, ids in enumerate(prompts)]
    for request, completion in zip(requests, engine.generate(requests).completions):
        assert list(completion.token_ids) == naive_greedy(engine.model, list(request.prompt_token_ids), 8, set())
