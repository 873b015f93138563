"""servelab's int4 kernel (blocked.cpp, 'int4x16') against dequantise-then-matmul, on every build this CPU runs.

AWQ's layout is unpacked by servelab and checked against gptqmodel's own dequantisation; the kernel's two
paths are each checked against their exact reference: fp32 tiles against x @ W^T, and integer dot products
against x quantised per group to int8 (as the kernel does), then x @ W^T, so a wrong nibble, group or zero
point shows as a large error, not as noise under a loose tolerance.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from servelab.engine.awq.unpack import ORDER, dequantize, unpack_awq
from servelab.engine.kernels import ISAS, isa_reason, load_blocked_kernel
from servelab.engine.linear import ServelabInt4Linear, int4_modules_reason
from tests.engine.conftest import amx_kernel, amx_path

CACHE = Path(__file__).resolve().parents[2] / ".cache"
BUILDS = [pytest.param(isa.name, marks=pytest.mark.skipif(isa_reason(isa) is not None, reason=f"{isa_reason(isa)}"))
          for isa in ISAS]
ALL_ROWS = 1 << 30  # int_rows: every row count takes the integer path


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """(rows, cols) values 0..15 -> AWQ's (rows, cols / 8) int32, nibble i holding column 8 j + ORDER[i]."""
    rows, cols = values.shape
    grouped = values.to(torch.int64).view(rows, cols // 8, 8)[:, :, list(ORDER)]
    words = sum(grouped[:, :, i] << (4 * i) for i in range(8))
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _awq_layer(out_features: int, in_features: int, group: int, generator: torch.Generator, bias: bool = False):
    """A layer as gptqmodel loads it from a checkpoint (AWQ's gemm layout), and its weight (out, in) in fp32."""
    q = torch.randint(0, 16, (in_features, out_features), generator=generator)
    zeros = torch.randint(0, 16, (in_features // group, out_features), generator=generator)
    scales = (torch.rand(in_features // group, out_features, generator=generator) * 0.02 + 0.001).half()
    layer = SimpleNamespace(qweight=_pack_awq(q), qzeros=_pack_awq(zeros), scales=scales, bits=4, group_size=group,
                            in_features=in_features, out_features=out_features,
                            bias=torch.randn(out_features, generator=generator) if bias else None)
    weight = (q.t().float() - zeros.float().repeat_interleave(group, 0).t()) * scales.float().repeat_interleave(group, 0).t()
    return layer, weight


def _quantized_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the integer path sees it: per row and group, int8 with d = max|x| / 127 (round half to even)."""
    g = x.view(x.shape[0], -1, group)
    amax = g.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, 1), 0)  # as the kernel computes it, in fp32
    return (torch.round(g * inverse) * (amax / 127)).view_as(x)


def test_awq_layout_unpacks_as_gptqmodel_dequantises_it() -> None:
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    generator = torch.Generator().manual_seed(0)
    layer, weight = _awq_layer(48, 128, 32, generator)
    q, zeros, scales, group = unpack_awq(layer.qweight, layer.qzeros, layer.scales)
    assert group == 32 and q.shape == (48, 128) and zeros.shape == (4, 48)
    torch.testing.assert_close(dequantize(q, zeros, scales, group), weight, rtol=0, atol=0)
    theirs = dequantize_gemm(layer.qweight, layer.qzeros, layer.scales, 4, 32).t()  # (out, in), fp16 arithmetic
    torch.testing.assert_close(theirs.float(), weight.half().float(), rtol=0, atol=0)


@pytest.mark.parametrize("build", BUILDS)
# NOTE: 8 takes the scalar quantisation of the activations in the AVX-512 build (16 lanes), the vector one in AVX2
@pytest.mark.parametrize("group", [8, 16, 32, 64, 128])
def test_int4_matmul_equals_dequantise_then_matmul(build: str, group: int) -> None:
    kernel = load_blocked_kernel(CACHE, build).module
    generator = torch.Generator().manual_seed(group)
    for out_features, in_features in [(16, 128), (48, 256), (1536, 384)]:
        q = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=generator)
        zeros = torch.randint(0, 16, (in_features // group, out_features), generator=generator).float()
        scales = (torch.rand(in_features // group, out_features, generator=generator) * 0.02 + 0.001).half().float()
        weight = dequantize(q, zeros, scales, group)
        packed = kernel.int4_pack(q, scales, zeros, group)
        for rows in (1, 2, 3, 4, 5, 8, 9, 17, 40):
            x = torch.randn(rows, in_features, generator=generator)
            x[0, :group] = 0  # an all-zero group: its scale is 0, and nothing divides by it
            tiles = kernel.int4_linear(x, *packed, group, 0)
            torch.testing.assert_close(tiles, x @ weight.t(), rtol=1e-4, atol=1e-4)
            dots = kernel.int4_linear(x, *packed, group, ALL_ROWS)
            torch.testing.assert_close(dots, _quantized_rows(x, group) @ weight.t(), rtol=1e-4, atol=1e-4)
            # and the int8 rounding of x costs little against the full-precision product
            assert (dots - x @ weight.t()).norm() <= 0.02 * (x @ weight.t()).norm()
            # fp32 activations on weights dequantised in registers: x @ W^T itself, no rounding of x
            floats = kernel.int4_linear(x, *packed, group, ALL_ROWS, float_activations=True)
            torch.testing.assert_close(floats, x @ weight.t(), rtol=1e-4, atol=1e-4)
            residual = torch.randn(rows, out_features, generator=generator)
            torch.testing.assert_close(kernel.int4_linear(x, *packed, group, ALL_ROWS, residual, float_activations=True),
                                       floats + residual, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build", BUILDS)
def test_joined_awq_layers_with_padding_bias_and_bf16(build: str) -> None:
    """q/k/v-like layers of one input joined into one matmul, 40 + 24 + 24 outputs padded to 96, a bias."""
    blocked = load_blocked_kernel(CACHE, build)
    generator = torch.Generator().manual_seed(1)
    layers = [_awq_layer(n, 128, 64, generator, bias=True) for n in (40, 24, 24)]
    assert int4_modules_reason([layer for layer, _ in layers]) is None
    for int_rows, float_activations in ((0, False), (ALL_ROWS, False), (ALL_ROWS, True)):
        joined = ServelabInt4Linear(blocked, [layer for layer, _ in layers], int_rows, float_activations)
        x = torch.randn(2, 3, 128, generator=generator)
        seen = x if int_rows == 0 or float_activations else _quantized_rows(x.view(-1, 128), 64).view_as(x)
        want = torch.cat([seen @ w.t() + layer.bias for layer, w in layers], dim=-1)
        torch.testing.assert_close(joined(x), want, rtol=1e-4, atol=1e-4)
        got_bf16 = joined(x.bfloat16())
        assert got_bf16.dtype == torch.bfloat16 and got_bf16.shape == (2, 3, 88)
        torch.testing.assert_close(got_bf16.float(), joined(x.bfloat16().float()), rtol=1e-2, atol=1e-2)


def test_layers_the_kernel_cannot_take_are_named() -> None:
    generator = torch.Generator().manual_seed(2)
    layer, _ = _awq_layer(16, 128, 64, generator)
    other, _ = _awq_layer(16, 256, 64, generator)
    assert "differ in inputs" in int4_modules_reason([layer, other])
    transformed = SimpleNamespace(**{**vars(layer), "qweight": torch.zeros(16, 64, dtype=torch.uint8)})
    assert "gemm layout" in int4_modules_reason([transformed])
    kernel = load_blocked_kernel(CACHE).module
    if kernel is None:
        pytest.skip("this CPU runs no servelab build")
    q = torch.zeros(16, 96, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="group size must divide K"):
        kernel.int4_pack(q, torch.ones(2, 16), torch.zeros(2, 16), 64)


@pytest.mark.parametrize("build", BUILDS)
def test_bf16_weights_with_fp32_activations_equal_the_fp32_product(build: str) -> None:
    """An output layer stored in bf16 (as AWQ checkpoints store it) serves fp32 activations and logits: the same
    products as fp32 weights holding those values, half the bytes."""
    from servelab.engine.linear import BlockedLinear

    blocked = load_blocked_kernel(CACHE, build)
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(72, 64, generator=generator).bfloat16()
    head = BlockedLinear(blocked, weight, None)
    for rows in (1, 3, 9):
        x = torch.randn(rows, 64, generator=generator)
        got = head(x)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, x @ weight.float().t(), rtol=1e-5, atol=1e-5)
    ids = torch.tensor([[0, 15], [16, 71]])
    assert torch.equal(head.rows(ids), weight[ids])  # the embedding read from the head's layout
    every = torch.arange(72)
    assert torch.equal(head.rows(every.flip(0)), weight.flip(0)) and head.rows(every[:0]).shape == (0, 64)
    with pytest.raises(RuntimeError, match="id 80 is not a row of the weight"):  # 72 rows, padded to 5 blocks
        head.rows(torch.tensor([3, 80]))


def test_random_weights_of_a_models_shape_go_through_servelabs_int4_kernel(tmp_path: Path, bundled_folder: str,
                                                                           settings) -> None:
    """bench.random_model (timing where a model's files are not at hand) gives every projection AWQ's gemm layout,
    which servelab's int4 kernel takes as it takes a real checkpoint's; the engine decodes on it at 1 and 2 threads
    to the same tokens."""
    from bench.random_model import RandomAwqLinear, random_loaded
    from servelab.config import ServingConfig
    from servelab.engine.engine import Engine
    from servelab.request import GenerationRequest, SamplingParams
    from tests.engine.conftest import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "shape", bundled_folder, hidden_size=128, intermediate_size=256)
    config = ServingConfig.from_dict({"name": "random-int4", "model": str(folder), "weights": "awq-int4",
                                      "device": "cpu", "awq": {"group_size": 64},
                                      "decoding": {"max_new_tokens": 8, "max_context_tokens": 128}})
    loaded = random_loaded(config, folder)
    layers = [m for m in loaded.model.modules() if isinstance(m, RandomAwqLinear)]
    assert len(layers) == 2 * 7 and int4_modules_reason(layers[:3]) is None
    engine = Engine(loaded, config, cache_dir=settings.cache_dir)
    assert "int4 servelab" in engine.kernel, engine.kernel
    threads, tokens = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            params = SamplingParams(max_new_tokens=6, ignore_eos=True)
            result = engine.generate([GenerationRequest(f"r{i}", prompt=p, params=params)
                                      for i, p in enumerate(("Hello there", "The history of the city"))])
            tokens.append([c.token_ids for c in result.completions])
    finally:
        torch.set_num_threads(threads)
    assert all(len(t) == 6 for t in tokens[0]) and tokens[0] == tokens[1]


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_prefill_on_amx_tiles_rounds_each_weight_to_bf16_once(group: int) -> None:
    """Many bf16 rows on an AMX CPU: the weight dequantised to bf16 (s (q - z) in fp32, rounded once) and the tiles'
    fp32 sums, within one bf16 rounding of that product in fp32; the fp32 tile path and K not a multiple of 32 are
    untouched."""
    kernel = amx_kernel(CACHE)
    generator = torch.Generator().manual_seed(group)
    for out_features, in_features in [(48, 256), (1536, 384)]:
        q = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=generator)
        zeros = torch.randint(0, 16, (in_features // group, out_features), generator=generator).float()
        scales = (torch.rand(in_features // group, out_features, generator=generator) * 0.02 + 0.001).half().float()
        weight = dequantize(q, zeros, scales, group)
        packed = kernel.int4_pack(q, scales, zeros, group)
        for rows in (5, 17, 40):
            x = torch.randn(rows, in_features, generator=generator).bfloat16()
            residual = torch.randn(rows, out_features, generator=generator).bfloat16()
            want = x.float() @ weight.bfloat16().float().t()
            tiles = kernel.int4_linear(x, *packed, group, 0)
            assert tiles.dtype == torch.bfloat16
            torch.testing.assert_close(tiles.float(), want, rtol=2 ** -7, atol=1e-5)
            torch.testing.assert_close(kernel.int4_linear(x, *packed, group, 0, residual).float(),
                                       (tiles.float() + residual.float()).bfloat16().float(), rtol=2 ** -7, atol=1e-5)
            # the fp32 tile path: the exact weights, within one bf16 rounding of the tiles' result
            with amx_path(kernel, False):
                exact = kernel.int4_linear(x, *packed, group, 0)
            torch.testing.assert_close(exact.float(), x.float() @ weight.t(), rtol=2 ** -7, atol=1e-5)
            assert (tiles.float() - exact.float()).norm() <= 0.01 * exact.float().norm()
