"""servelab's decoder against transformers' forward, logit for logit, with every matmul kernel."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from servelab.engine.decoder import LlamaDecoder, build_decoder, unsupported_reason
from servelab.engine.kernels import cpu_flags, load_blocked_kernel
from servelab.engine.kvcache import StaticKVCache
from servelab.engine.linear import BlockedLinear, LinearKernelError, OneDNNLinear, choose_linear_kernel

CPU = torch.device("cpu")
HAS_AVX512 = "avx512f" in cpu_flags()
KERNELS = [
    pytest.param("servelab", marks=pytest.mark.skipif(not HAS_AVX512, reason="servelab's kernel needs AVX-512")),
    "onednn",
    "torch",
]


@pytest.fixture(scope="module")
def tiny_models(tiny_folder) -> dict[torch.dtype, LlamaForCausalLM]:
    return {dtype: AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=dtype).eval()
            for dtype in (torch.float32, torch.bfloat16)}


def _decode_logits(decoder, rows: list[list[int]], num_steps: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Left-padded prefill, then greedy steps; -> logits (B, V) per step, and each row's tokens fed so far."""
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = decoder.new_cache(len(rows), width + num_steps)
    sequences = [list(r) for r in rows]
    logits = [decoder.forward(ids, mask, positions, cache)]
    last = positions[:, -1]
    for _ in range(num_steps):
        next_ids = logits[-1].argmax(-1)
        for seq, token in zip(sequences, next_ids.tolist()):
            seq.append(token)
        mask, last = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=-1), last + 1
        logits.append(decoder.forward(next_ids.view(-1, 1), mask, last.view(-1, 1), cache))
    return logits, sequences


@torch.inference_mode()
@pytest.mark.parametrize("kernel", KERNELS)
def test_decoder_logits_equal_transformers_unpadded_uncached(tiny_models, kernel: str, settings) -> None:
    model = tiny_models[torch.float32]
    decoder = build_decoder(model, choice="auto", kv_cache_dtype="auto", dtype=torch.float32, device=CPU,
                            linear_kernel=kernel, cache_dir=settings.cache_dir)
    assert isinstance(decoder, LlamaDecoder) and decoder.kernel.name == kernel
    rows = [[5, 17, 923, 4001, 88, 12], [77], [301, 302, 303]]
    steps, sequences = _decode_logits(decoder, rows, num_steps=4)
    for step, logits in enumerate(steps):
        for i, seq in enumerate(sequences):
            fed = seq[: len(rows[i]) + step]  # what the row had seen when these logits were made
            expected = model(input_ids=torch.tensor([fed])).logits[0, -1]
            torch.testing.assert_close(logits[i], expected, atol=2e-4, rtol=1e-4)


@torch.inference_mode()
@pytest.mark.parametrize("kernel", KERNELS)
def test_bf16_decoder_tracks_transformers_bf16(tiny_models, kernel: str, settings) -> None:
    model = tiny_models[torch.bfloat16]
    decoder = build_decoder(model, choice="auto", kv_cache_dtype="auto", dtype=torch.bfloat16, device=CPU,
                            linear_kernel=kernel, cache_dir=settings.cache_dir)
    rows = [[5, 17, 923, 4001, 88, 12], [301, 302, 303]]
    steps, sequences = _decode_logits(decoder, rows, num_steps=3)
    for step, logits in enumerate(steps):
        for i, seq in enumerate(sequences):
            expected = model(input_ids=torch.tensor([seq[: len(rows[i]) + step]])).logits[0, -1].float()
            # NOTE: bf16 rounds differently per kernel and fused order; the logits agree to bf16 precision
            error = (logits[i].float() - expected).abs().max() / expected.abs().max()
            assert error < 0.03, (step, i, float(error))


@pytest.mark.skipif(not HAS_AVX512, reason="servelab's kernel needs AVX-512")
@pytest.mark.parametrize("num_rows", [1, 3, 8, 9, 37])
def test_blocked_kernel_equals_f_linear_with_padding_and_bias(num_rows: int, settings) -> None:
    kernel = choose_linear_kernel("servelab", device=CPU, dtype=torch.float32, cache_dir=settings.cache_dir)
    torch.manual_seed(num_rows)
    weight, bias = torch.randn(50, 24), torch.randn(50)  # 50 outputs: padded to 64 inside, cut off again
    linear = kernel.make(weight, bias)
    assert isinstance(linear, BlockedLinear)
    x = torch.randn(num_rows, 2, 24).transpose(0, 1)  # (2, rows, 24), not contiguous
    torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="the bf16 path needs AVX-512 BF16")
def test_blocked_kernel_bf16_rounds_like_onednn_and_odd_k_goes_to_onednn(settings) -> None:
    kernel = choose_linear_kernel("servelab", device=CPU, dtype=torch.bfloat16, cache_dir=settings.cache_dir)
    torch.manual_seed(0)
    weight, x = torch.randn(64, 96, dtype=torch.bfloat16), torch.randn(5, 96, dtype=torch.bfloat16)
    exact = x.float() @ weight.float().T  # fp32 accumulation, then one rounding to bf16
    torch.testing.assert_close(kernel.make(weight, None)(x), exact.bfloat16(), atol=0, rtol=0.008)
    assert isinstance(kernel.make(torch.randn(64, 95, dtype=torch.bfloat16), None), OneDNNLinear)


@pytest.mark.skipif(not HAS_AVX512, reason="servelab's kernel needs AVX-512")
@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                   (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_decode_attention_kernel_equals_softmax_attention(q_dtype, kv_dtype, settings) -> None:
    kernel = load_blocked_kernel(settings.cache_dir).module
    torch.manual_seed(0)
    B, H, H_kv, S, D = 3, 6, 2, 37, 32
    cache_keys, cache_values = torch.randn(B, H_kv, S + 9, D).to(kv_dtype), torch.randn(B, H_kv, S + 9, D).to(kv_dtype)
    keys, values = cache_keys[:, :, 4:4 + S], cache_values[:, :, 4:4 + S]  # a view into a larger cache, as served
    q = torch.randn(B, H, D).to(q_dtype)
    mask = torch.rand(B, S) > 0.3
    mask[:, -1] = True
    for m in (mask, None):
        scores = (q.float().view(B, H_kv, H // H_kv, D) @ keys.float().transpose(-1, -2)) / D ** 0.5
        if m is not None:
            scores = scores.masked_fill(~m[:, None, None, :], float("-inf"))
        expected = (scores.softmax(-1) @ values.float()).reshape(B, H, D)
        out = kernel.decode_attention(q, keys, values, m, D ** -0.5)
        assert out.dtype == q_dtype
        torch.testing.assert_close(out.float(), expected, atol=1e-5 if q_dtype == torch.float32 else 1e-2, rtol=1e-2)


@pytest.mark.skipif(not HAS_AVX512, reason="servelab's kernel needs AVX-512")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel_equals_transformers_rms_norm(dtype, tiny_models, settings) -> None:
    kernel = load_blocked_kernel(settings.cache_dir).module
    norm = tiny_models[dtype].model.norm  # transformers' LlamaRMSNorm with the tiny model's weight
    torch.manual_seed(0)
    x = (torch.randn(7, 5, norm.weight.numel()) * 3).to(dtype)
    with torch.inference_mode():
        expected = norm(x)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.0, "rtol": 0.008}
    torch.testing.assert_close(kernel.rms_norm(x, norm.weight.detach(), norm.variance_epsilon), expected, **tolerance)


def test_a_kernel_that_cannot_serve_says_why(settings) -> None:
    with pytest.raises(LinearKernelError, match="unknown linear kernel 'mkl'"):
        choose_linear_kernel("mkl", device=CPU, dtype=torch.float32, cache_dir=settings.cache_dir)
    with pytest.raises(LinearKernelError, match="oneDNN packing covers fp32 and bf16"):
        choose_linear_kernel("onednn", device=CPU, dtype=torch.float16, cache_dir=settings.cache_dir)
    assert choose_linear_kernel("auto", device=CPU, dtype=torch.float16, cache_dir=settings.cache_dir).name == "torch"
    if not HAS_AVX512:
        with pytest.raises(LinearKernelError, match="no AVX-512"):
            choose_linear_kernel("servelab", device=CPU, dtype=torch.float32, cache_dir=settings.cache_dir)
        assert load_blocked_kernel(settings.cache_dir).module is None


def test_static_cache_holds_columns_rows_and_its_capacity() -> None:
    cache = StaticKVCache(num_layers=1, batch_size=3, num_kv_heads=2, capacity=4, head_dim=8,
                          dtype=torch.bfloat16, device=CPU)
    keys = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 2, 3, 8)  # row i holds the value i
    held_keys, _ = cache.append(0, keys, keys)
    cache.advance(3)
    assert held_keys.dtype == cache.keys[0].dtype == torch.bfloat16  # stored narrower, read as stored
    assert cache.num_columns == 3 and cache.allocated_bytes == 2 * 3 * 2 * 4 * 8 * 2
    cache.select_rows(torch.tensor([2, 0]))
    cache.drop_leading_columns(1)
    held_keys, _ = cache.append(0, torch.full((2, 2, 1, 8), 9.0), torch.zeros(2, 2, 1, 8))
    cache.advance(1)
    assert cache.num_columns == 3 and held_keys.shape == (2, 2, 3, 8)
    assert held_keys[:, 0, 0, 0].tolist() == [2.0, 0.0] and held_keys[:, 0, -1, 0].tolist() == [9.0, 9.0]
    with pytest.raises(RuntimeError, match="capacity 4 exceeded"):
        cache.append(0, torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8))


def test_a_model_the_decoder_does_not_cover_is_served_by_transformers(settings) -> None:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_scaling={"rope_type": "linear", "factor": 2.0})
    model = LlamaForCausalLM(config).eval()
    assert "rope type 'linear'" in unsupported_reason(model)
    decoder = build_decoder(model, choice="auto", kv_cache_dtype="auto", dtype=torch.float32, device=CPU,
                            linear_kernel="auto", cache_dir=settings.cache_dir)
    assert decoder.name == "transformers"
