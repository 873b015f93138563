"""servelab's decoder against transformers' forward, logit for logit, with every matmul kernel."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from servelab.engine import linear as linear_module
from servelab.engine.decoder import LlamaDecoder, _rotate, build_decoder, unsupported_reason
from servelab.engine.kernels import ISAS, best_isa, isa_reason, load_blocked_kernel
from servelab.engine.kvcache import StaticKVCache, dequantize_heads, quantize_heads
from servelab.engine.linear import (BlockedLinear, LinearKernel, LinearKernelError, OneDNNLinear, RowDispatchLinear,
                                    TorchLinear, choose_linear_kernel, layout_families, linear_kernel_reason,
                                    one_layout_winners)
from tests.engine.conftest import amx_kernel, amx_path, with_built_kernels

CPU = torch.device("cpu")
CACHE = Path(__file__).resolve().parents[2] / ".cache"


def runnable(kernel: str, dtype: torch.dtype = torch.float32):
    """A kernel as a test parameter, skipped with the reason where this CPU cannot run it. servelab's builds are
    judged by the CPU's instruction sets alone here, so collecting the tests never waits on a compile (in a fresh
    clone every test process would, a minute and a half on a 2-core machine); the test builds it and skips on
    what the build says (skip_unless_runnable)."""
    if kernel.startswith("servelab-"):
        reason = isa_reason(next(isa for isa in ISAS if isa.name == kernel.removeprefix("servelab-")))
    else:
        reason = linear_kernel_reason(kernel, device=CPU, dtype=dtype, cache_dir=CACHE)
    return pytest.param(kernel, marks=pytest.mark.skipif(reason is not None, reason=f"{kernel}: {reason}"))


def skip_unless_runnable(kernel: str, dtype: torch.dtype, cache_dir: Path) -> None:
    """Skip, with the reason, where the kernel cannot run here after all (its build failed, say)."""
    if (reason := linear_kernel_reason(kernel, device=CPU, dtype=dtype, cache_dir=cache_dir)) is not None:
        pytest.skip(f"{kernel}: {reason}")


KERNELS = ["servelab-avx512", "servelab-avx2", "onednn", "torch", "auto"]
BUILDS = [pytest.param(isa.name, marks=pytest.mark.skipif(isa_reason(isa) is not None, reason=f"{isa_reason(isa)}"))
          for isa in ISAS]


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
@pytest.mark.parametrize("kernel", [runnable(k) for k in KERNELS])
def test_decoder_logits_equal_transformers_unpadded_uncached(tiny_models, kernel: str, settings) -> None:
    skip_unless_runnable(kernel, torch.float32, settings.cache_dir)
    model = tiny_models[torch.float32]
    decoder = build_decoder(model, choice="auto", kv_cache_dtype="auto", dtype=torch.float32, device=CPU,
                            linear_kernel=kernel, cache_dir=settings.cache_dir)
    assert isinstance(decoder, LlamaDecoder) and decoder.kernel.name == kernel.split("-")[0]
    if kernel.startswith("servelab-"):
        assert decoder.kernel.blocked.isa.name == kernel.removeprefix("servelab-")
    rows = [[5, 17, 923, 4001, 88, 12], [77], [301, 302, 303]]
    steps, sequences = _decode_logits(decoder, rows, num_steps=4)
    for step, logits in enumerate(steps):
        for i, seq in enumerate(sequences):
            fed = seq[: len(rows[i]) + step]  # what the row had seen when these logits were made
            expected = model(input_ids=torch.tensor([fed])).logits[0, -1]
            torch.testing.assert_close(logits[i], expected, atol=2e-4, rtol=1e-4)


@torch.inference_mode()
@pytest.mark.parametrize("kernel", [runnable(k, torch.bfloat16) for k in KERNELS])
def test_bf16_decoder_tracks_transformers_bf16(tiny_models, kernel: str, settings) -> None:
    skip_unless_runnable(kernel, torch.bfloat16, settings.cache_dir)
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


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 8, 9, 37])
def test_blocked_kernel_equals_f_linear_with_padding_and_bias(build: str, num_rows: int, settings) -> None:
    kernel = choose_linear_kernel(f"servelab-{build}", device=CPU, dtype=torch.float32, cache_dir=settings.cache_dir)
    torch.manual_seed(num_rows)
    weight, bias = torch.randn(90, 24), torch.randn(90)  # 90 outputs: 6 blocks, padded to 96 inside, cut off again
    linear = kernel.make(weight, bias)
    assert isinstance(linear, BlockedLinear)
    x = torch.randn(num_rows, 2, 24).transpose(0, 1)  # (2, rows, 24), not contiguous
    torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("num_rows", [1, 2, 5, 9])
def test_blocked_kernel_bf16_rounds_the_exact_product_once(build: str, num_rows: int, settings) -> None:
    """AVX-512 BF16 (vdpbf16ps) or bf16 weights converted to fp32 in registers: within one bf16 rounding."""
    kernel = choose_linear_kernel(f"servelab-{build}", device=CPU, dtype=torch.bfloat16, cache_dir=settings.cache_dir)
    torch.manual_seed(num_rows)
    weight, x = torch.randn(80, 96, dtype=torch.bfloat16), torch.randn(num_rows, 96, dtype=torch.bfloat16)
    exact = x.float() @ weight.float().T  # fp32 accumulation, then one rounding to bf16
    out = kernel.make(weight, None)(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, exact.bfloat16(), atol=0, rtol=0.008)


def test_bf16_with_an_odd_k_is_served_by_another_kernel(settings) -> None:
    if best_isa() is None:
        pytest.skip("servelab's kernel cannot run on this CPU")
    kernel = choose_linear_kernel("servelab", device=CPU, dtype=torch.bfloat16, cache_dir=settings.cache_dir)
    weight = torch.randn(64, 95, dtype=torch.bfloat16)
    linear = kernel.make(weight, None)
    onednn_runs = linear_kernel_reason("onednn", device=CPU, dtype=torch.bfloat16, cache_dir=settings.cache_dir) is None
    assert isinstance(linear, OneDNNLinear if onednn_runs else TorchLinear)
    x = torch.randn(3, 95, dtype=torch.bfloat16)
    torch.testing.assert_close(linear(x).float(), (x.float() @ weight.float().T), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_kernel_gives_a_row_the_same_bits_whatever_rows_share_its_pass(build, dtype, settings) -> None:
    """A pass takes up to 4-8 rows against 1-4 blocks (the register tile depends on the rows, the build and the
    layout), but each output sums over k in one order: 13 rows at once (passes of 6, 6, 1 on AVX2) give each row the
    bits it gets alone (1 row, 4 blocks a pass; bf16 units: 2), so a request's tokens do not depend on its
    batch-mates. 4 blocks, and 13 (bf16 units: a last block alone)."""
    kernel = load_blocked_kernel(settings.cache_dir, build).module
    generator = torch.Generator().manual_seed(0)
    for outputs in (64, 208):
        packed = kernel.pack(torch.randn(outputs, 96, generator=generator).to(dtype))
        x = torch.randn(13, 96, generator=generator).to(dtype)
        with amx_path(kernel, False):  # bf16 on AMX: the tiles' own test below
            together = kernel.linear(x, packed)
            alone = torch.cat([kernel.linear(x[i:i + 1].contiguous(), packed) for i in range(13)])
        assert torch.equal(together, alone), outputs


@pytest.mark.parametrize("build", BUILDS)
def test_bf16_pack_interleaves_the_builds_units_of_blocks_and_reads_rows_back(build, settings) -> None:
    """bf16 blocks (16 outputs x K/2 lines of 2 k) in units of bf16_unit() blocks, their lines interleaved line by
    line (1: blocked16 as it is), a last block alone; rows (a tied embedding) read back from either."""
    kernel = load_blocked_kernel(settings.cache_dir, build).module
    weight = torch.randn(208, 96, generator=torch.Generator().manual_seed(4)).bfloat16()  # 13 blocks
    unit = kernel.bf16_unit()
    assert unit in (1, 2)
    blocked = weight.view(13, 16, 48, 2).permute(0, 2, 1, 3)  # (blocks, K/2, 16, 2)
    whole = 13 - 13 % unit
    want = [blocked[u:u + unit].transpose(0, 1).reshape(-1) for u in range(0, whole, unit)]
    packed = kernel.pack(weight)
    assert torch.equal(packed.reshape(-1), torch.cat([*want, blocked[whole:].reshape(-1)]))
    assert torch.equal(kernel.bf16_rows(torch.arange(208).flip(0), packed), weight.flip(0))


def on_path(kernel, amx: bool, fn, *args):
    with amx_path(kernel, amx):
        return fn(*args)


@pytest.mark.parametrize("shape", [(208, 96), (64, 576), (48, 80)])
def test_amx_tiles_agree_with_vdpbf16ps_within_one_bf16_rounding(shape, settings) -> None:
    """bf16 matmuls from a few rows run on AMX tiles, which read the blocked layout as it is (a block's 16 lines of
    2 k x 16 outputs are one B tile). Both accumulate in fp32 over the same k pairs, but TDPBF16PS adds inside a
    tile in its own order: an output may differ by one bf16 rounding, no more. 13 blocks (an odd last pair), rows
    that fill no whole tile (padded with zero rows), a residual; K not a multiple of 32 is left to vdpbf16ps."""
    kernel = amx_kernel(settings.cache_dir)
    generator = torch.Generator().manual_seed(0)
    n, k = shape
    weight = (torch.randn(n, k, generator=generator) * 0.05).bfloat16()
    packed = kernel.pack(weight)
    for rows in (1, 4, 5, 16, 19, 33):
        x = torch.randn(rows, k, generator=generator).bfloat16()
        residual = torch.randn(rows, n, generator=generator).bfloat16()
        for args in ((x, packed), (x, packed, residual)):
            tiles, vdp = on_path(kernel, True, kernel.linear, *args), on_path(kernel, False, kernel.linear, *args)
            if k % 32:
                assert torch.equal(tiles, vdp), "K % 32 != 0 must be served by vdpbf16ps"
                continue
            torch.testing.assert_close(tiles.float(), vdp.float(), rtol=2 ** -7, atol=1e-6)
            assert (tiles == vdp).float().mean() > 0.99
        want = x.double() @ weight.double().T
        torch.testing.assert_close(on_path(kernel, True, kernel.linear, x, packed).double(), want, rtol=2 ** -7,
                                   atol=1e-3)


def test_amx_tiles_give_a_row_the_same_bits_whatever_rows_share_its_tile(settings) -> None:
    kernel = amx_kernel(settings.cache_dir)
    generator = torch.Generator().manual_seed(1)
    packed = kernel.pack(torch.randn(208, 576, generator=generator).bfloat16())
    x = torch.randn(37, 576, generator=generator).bfloat16()
    together = on_path(kernel, True, kernel.linear, x, packed)
    alone = torch.cat([on_path(kernel, True, kernel.linear, x[i:i + 1].contiguous(), packed) for i in range(37)])
    assert torch.equal(together, alone)


def test_bf16_on_vdpbf16ps_gives_the_avx2_builds_bits(settings) -> None:
    """vdpbf16ps adds a lane's odd product before its even one; the weights' and activations' halves are swapped in
    registers so that it adds k before k + 1, as the AVX2 build's two fp32 FMAs do: both builds, one result. The
    layouts differ too (this build interleaves each 2 blocks' lines where it runs no AMX; the AVX2 build keeps
    blocked16): 13 blocks, so a last block alone."""
    if isa_reason(ISAS[0]) is not None:
        pytest.skip(isa_reason(ISAS[0]))
    fast, wide = (load_blocked_kernel(settings.cache_dir, name).module for name in ("avx512", "avx2"))
    if not fast.native_bf16():
        pytest.skip("this CPU has no AVX-512 BF16: both builds convert bf16 to fp32 (the same code)")
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(208, 576, generator=generator).bfloat16()
    for rows in (1, 2, 3, 5, 13):
        x = torch.randn(rows, 576, generator=generator).bfloat16()
        assert torch.equal(on_path(fast, False, fast.linear, x, fast.pack(weight)), wide.linear(x, wide.pack(weight)))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                   (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_decode_attention_kernel_equals_softmax_attention(build, q_dtype, kv_dtype, settings) -> None:
    kernel = load_blocked_kernel(settings.cache_dir, build).module
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


def _causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """The reference: q (T, H, D), keys and values (H_kv, start + T, D); token t sees columns 0.. start + t."""
    T, H, D = q.shape
    H_kv, S = keys.shape[:2]
    group = q.float().transpose(0, 1).reshape(H_kv, H // H_kv * T, D)  # rows: (head in group, token)
    scores = (group @ keys.float().transpose(-1, -2)) / D ** 0.5  # (H_kv, G x T, S)
    seen = torch.arange(S)[None, :] <= torch.arange(start, start + T)[:, None]  # (T, S)
    scores = scores.masked_fill(~seen.repeat(H // H_kv, 1)[None], float("-inf"))
    out = (scores.softmax(-1) @ values.float()).view(H, T, D)
    return out.transpose(0, 1).reshape(T, H * D)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                   (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_prefill_attention_kernel_equals_causal_softmax_attention(build, q_dtype, kv_dtype, settings) -> None:
    """A prompt chunk's causal attention (servelab's tiles of 16 tokens against pieces of 64 columns, online softmax)
    against the plain softmax: a first chunk, a chunk after a cached prefix whose tiles straddle pieces, one token,
    head sizes of one and several vectors, queries as the strided view the decoder passes."""
    kernel = load_blocked_kernel(settings.cache_dir, build).module
    torch.manual_seed(0)
    for T, start, H, H_kv, D in [(70, 0, 6, 2, 64), (37, 100, 4, 4, 16), (1, 9, 4, 1, 32), (130, 5, 3, 3, 48)]:
        qkv = (torch.randn(T, H + 2 * H_kv, D) * 2).to(q_dtype)
        keys, values = (torch.randn(start + T, H_kv, D).to(kv_dtype).transpose(0, 1) for _ in range(2))
        out = kernel.prefill_attention(qkv[:, :H], keys, values, start, D ** -0.5)
        assert out.dtype == q_dtype and out.shape == (T, H * D)
        expected = _causal_attention(qkv[:, :H], keys, values, start)
        tolerance = {"atol": 1e-5, "rtol": 1e-4} if q_dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
        torch.testing.assert_close(out.float(), expected, **tolerance, msg=lambda m: f"T={T} start={start}: {m}")
    with pytest.raises(RuntimeError, match="the keys must be the start columns before the chunk"):
        kernel.prefill_attention(qkv[:, :H], keys, values, start + 1, D ** -0.5)


def chunk_step_inputs(dtype: torch.dtype, cache: str, generator: torch.Generator) -> dict:
    """A prompt chunk of 30 tokens after 21 cached columns (4 blocks of 16 in a shuffled table), a pool of 10 blocks
    in the cache's precision, for prefill_step_attention and its unfused form."""
    H, H_kv, D, bs, start, T = 6, 2, 32, 16, 21, 30
    pool = torch.randn(10, H_kv, bs, D, generator=generator) * 2
    keys, values = ((pool * 20).to(torch.int8) if cache == "int8" else pool.to(CACHE_DTYPES[cache]) for _ in range(2))
    scales = [torch.rand(10, H_kv, bs, generator=generator) * 0.1 for _ in range(2)] if cache == "int8" else []
    return {"qkv": torch.randn(T, H + 2 * H_kv, D, generator=generator).to(dtype),
            "cos": torch.randn(128, D, generator=generator).to(dtype), "sin": torch.randn(128, D, generator=generator).to(dtype),
            "positions": torch.arange(start, start + T), "keys": keys, "values": values,
            "table": torch.randperm(10, generator=generator)[:6].to(torch.int32), "start": start, "num_heads": H,
            "scale": D ** -0.5, "key_scales": scales[0] if scales else None, "value_scales": scales[1] if scales else None}


CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _written_then_attended(kernel, qkv, cos, sin, positions, keys, values, table, start, num_heads, scale, key_scales,
                           value_scales) -> torch.Tensor:
    """The unfused chunk step, as the decoder ran it: torch's rotary, the pool's write and read (PagedKVCache.write /
    read's own operations), then prefill_attention."""
    T, _, D = qkv.shape
    H, H_kv, bs = num_heads, keys.shape[1], keys.shape[2]
    qk = _rotate(qkv[:, :H + H_kv].unsqueeze(0), cos[positions].view(1, T, 1, D), sin[positions].view(1, T, 1, D))[0]
    columns = torch.arange(start + T)
    blocks, offsets = table.long()[columns // bs], columns % bs
    new_blocks, new_offsets = blocks[start:], offsets[start:]
    if key_scales is not None:
        (k, ks), (v, vs) = quantize_heads(qk[:, H:]), quantize_heads(qkv[:, H + H_kv:])
        keys[new_blocks, :, new_offsets], key_scales[new_blocks, :, new_offsets] = k, ks
        values[new_blocks, :, new_offsets], value_scales[new_blocks, :, new_offsets] = v, vs
        k = dequantize_heads(keys[blocks, :, offsets], key_scales[blocks, :, offsets])
        v = dequantize_heads(values[blocks, :, offsets], value_scales[blocks, :, offsets])
    else:
        keys[new_blocks, :, new_offsets] = qk[:, H:].to(keys.dtype)
        values[new_blocks, :, new_offsets] = qkv[:, H + H_kv:].to(values.dtype)
        k, v = keys[blocks, :, offsets], values[blocks, :, offsets]
    return kernel.prefill_attention(qk[:, :H], k.transpose(0, 1), v.transpose(0, 1), start, scale)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize(("dtype", "cache"), [(torch.float32, "fp32"), (torch.float32, "bf16"), (torch.bfloat16, "bf16"),
                                              (torch.bfloat16, "fp32"), (torch.float32, "int8"), (torch.bfloat16, "int8")])
def test_fused_prefill_step_equals_the_cache_write_then_prefill_attention(build, dtype, cache: str, settings) -> None:
    """prefill_step_attention (rotary, cache writes and attention of a chunk in one call) writes the pool as torch's
    rotary and the cache's write do and attends as prefill_attention over what the cache's read gives: the same bits,
    the pool (and an int8 pool's scales) whole, columns outside the chunk untouched."""
    kernel = load_blocked_kernel(settings.cache_dir, build).module
    inputs = chunk_step_inputs(dtype, cache, torch.Generator().manual_seed(0))
    pools = ("keys", "values", "key_scales", "value_scales")
    unfused = {**inputs, **{k: inputs[k].clone() for k in pools if inputs[k] is not None}}
    fused = {**inputs, **{k: inputs[k].clone() for k in pools if inputs[k] is not None}}
    want = _written_then_attended(kernel, **unfused)
    got = kernel.prefill_step_attention(**fused)
    assert got.dtype == dtype and torch.equal(got, want)
    for k in pools:
        if inputs[k] is not None:
            assert torch.equal(fused[k], unfused[k]), k
            assert not torch.equal(fused[k], inputs[k]), f"{k}: the chunk's columns were not written"
    with pytest.raises(RuntimeError, match="the row's table holds fewer blocks"):
        kernel.prefill_step_attention(**{**fused, "table": fused["table"][:3]})
    empty = torch.empty(4, 2, 0, 32, dtype=fused["keys"].dtype)
    with pytest.raises(RuntimeError, match="pool \\(blocks, H_kv, block_size, D\\)"):  # a block size of 0: refused
        kernel.prefill_step_attention(**{**fused, "keys": empty, "values": empty})


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel_equals_transformers_rms_norm(build, dtype, tiny_models, settings) -> None:
    kernel = load_blocked_kernel(settings.cache_dir, build).module
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
    with pytest.raises(LinearKernelError, match="servelab's kernel covers fp32 and bf16"):
        choose_linear_kernel("servelab", device=CPU, dtype=torch.float16, cache_dir=settings.cache_dir)
    assert choose_linear_kernel("auto", device=CPU, dtype=torch.float16, cache_dir=settings.cache_dir).name == "torch"
    avx2_only = {"avx2", "fma", "f16c", "sse4_2"}
    assert isa_reason(ISAS[0], avx2_only) == "this CPU has no AVX-512 (avx512bw, avx512dq, avx512f, avx512vl missing)"
    assert isa_reason(ISAS[1], {"sse4_2"}) == "this CPU has no AVX2 (avx2, f16c, fma missing)"
    for isa in ISAS:  # what this CPU cannot run is refused with that reason
        if (reason := isa_reason(isa)) is not None:
            with pytest.raises(LinearKernelError, match=f"'servelab-{isa.name}' cannot run here: {re.escape(reason)}"):
                choose_linear_kernel(f"servelab-{isa.name}", device=CPU, dtype=torch.float32,
                                     cache_dir=settings.cache_dir)


def test_an_explicit_kernel_that_cannot_run_is_refused_before_the_model_loads(tmp_path, settings) -> None:
    from servelab.engine.engine import Engine
    from tests.engine.conftest import make_config

    missing_model = str(tmp_path / "no-such-model")  # loading it would fail with another error
    with pytest.raises(LinearKernelError, match="linear_kernel 'onednn' cannot run here: oneDNN packing covers"):
        Engine.from_config(make_config(missing_model, weights="fp16", linear_kernel="onednn"), settings)


def test_auto_serves_each_batch_size_with_the_kernel_measured_fastest_there(tmp_path, monkeypatch) -> None:
    shapes = ((48, 32), (32, 48))
    monkeypatch.setattr(linear_module, "MIN_CPU_SHARE", 0.0)  # NOTE: caching a busy machine's choice: the test below
    with_built_kernels(tmp_path)  # NOTE: its own choices, the suite's build
    kernel = choose_linear_kernel("auto", device=CPU, dtype=torch.float32, cache_dir=tmp_path, shapes=shapes)
    [cached] = list((tmp_path / "kernels" / "choices").glob("*.json"))
    record = json.loads(cached.read_text())
    assert kernel.name == "auto" and [k for _, k in kernel.by_rows] == record["winners"]
    families = layout_families(record["candidates"], torch_on_blocked=record["torch_on_blocked"])
    kept = families[record["layout"]]
    for i, winner in enumerate(record["winners"]):  # the kept layout's fastest kernel at that row count
        assert winner in kept and record["seconds"][winner][i] == min(record["seconds"][k][i] for k in kept)
    assert (record["layout"], record["winners"]) == one_layout_winners(record["seconds"], families)
    assert set(record["candidates"]) >= {"torch"} and kernel.label.endswith(("(auto, measured)", "rows torch F.linear", "rows torch matmul on the blocked layout",
                                                                           "rows oneDNN pre-packed", "kernel"))
    # the second choice reads the cache: a doctored record is what it serves
    cached.write_text(json.dumps({**record, "winners": ["torch", "torch", record["candidates"][0]]}))
    again = choose_linear_kernel("auto", device=CPU, dtype=torch.float32, cache_dir=tmp_path, shapes=shapes)
    assert [k for _, k in again.by_rows] == ["torch", "torch", record["candidates"][0]]
    # measured at the thread count it will serve at (servelab's kernels run on torch's threads): another count,
    # another measurement
    assert record["threads"] == torch.get_num_threads() and record["parallel"] is True
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)
    try:
        choose_linear_kernel("auto", device=CPU, dtype=torch.float32, cache_dir=tmp_path, shapes=shapes)
    finally:
        torch.set_num_threads(before)
    records = [json.loads(p.read_text()) for p in (tmp_path / "kernels" / "choices").glob("*.json")]
    assert sorted(r["threads"] for r in records) == [before, before + 1]


def test_a_choice_measured_without_its_threads_time_serves_but_is_not_cached(tmp_path, monkeypatch) -> None:
    """Other processes on the cores make a measurement noise (docs/performance.md): a choice whose measurement
    got less than MIN_CPU_SHARE of its threads' time is used but not kept, so the next start measures again."""
    choices = tmp_path / "kernels" / "choices"
    waited = linear_module._cached_choice(tmp_path, "t-", {"threads": 2, "probe": "waits"},
                                          lambda: (time.sleep(0.3), {"pick": "a"})[1])
    assert waited["pick"] == "a" and waited["cpu_share"] < 0.2  # a thread that waits is given no CPU time
    assert not list(choices.glob("*.json"))
    monkeypatch.setattr(linear_module, "MIN_CPU_SHARE", 0.3)  # NOTE: a busy loop gets more unless the machine is
    busy = linear_module._cached_choice(tmp_path, "t-", {"threads": 1, "probe": "works"},  # three times oversubscribed
                                        lambda: {"pick": sum(i * i for i in range(3_000_000))})
    [kept] = choices.glob("*.json")
    assert json.loads(kept.read_text()) == busy and busy["cpu_share"] >= 0.3
    again = linear_module._cached_choice(tmp_path, "t-", {"threads": 1, "probe": "works"},
                                         lambda: pytest.fail("a cached choice is not measured again"))
    assert again == busy


def test_the_share_is_taken_over_the_timed_passes_not_the_set_up(tmp_path, monkeypatch) -> None:
    """Set-up on one thread (random weights, packing) is not the machine being busy: a measurement that waits
    0.5 s before its timed pass is cached on the share of that pass (PassClock), where the whole call's share
    would not have been."""
    monkeypatch.setattr(linear_module, "MIN_CPU_SHARE", 0.3)  # NOTE: as above, a busy loop's share on a loaded machine

    def measure() -> dict:
        clock = linear_module.PassClock(threads=1)
        time.sleep(0.5)  # the set-up: no CPU time, not timed
        with clock:
            total = sum(i * i for i in range(1_000_000))
        return {"pick": total, "cpu_share": clock.share}

    wall, cpu = time.perf_counter(), time.process_time()
    record = linear_module._cached_choice(tmp_path, "t-", {"threads": 1, "probe": "set-up"}, measure)
    whole_share = (time.process_time() - cpu) / (time.perf_counter() - wall)
    [kept] = (tmp_path / "kernels" / "choices").glob("*.json")
    assert json.loads(kept.read_text()) == record and record["cpu_share"] >= 0.3 > whole_share
    clock = linear_module.PassClock(threads=2)
    with clock:
        time.sleep(0.05)
    assert clock.wall >= 0.05 and clock.share < 0.2  # a pass that waits gets no CPU time


def test_auto_keeps_one_layout_of_the_weights() -> None:
    """oneDNN fastest at 16 and 64 rows, servelab's kernel at one: two layouts would be two copies of the weights,
    so the layout kept is the one that loses least over the row counts, and only its kernels serve."""
    timings = {"servelab": [1.0, 3.0, 9.0], "torch": [4.0, 2.5, 7.0], "onednn": [1.8, 1.0, 3.0]}
    families = layout_families(list(timings), torch_on_blocked=True)
    assert families == {"servelab": ["servelab", "torch"], "onednn": ["onednn"]}
    # servelab's layout: slowdowns 1.0, 2.5, 2.33 (geometric mean 1.80); oneDNN's: 1.8, 1.0, 1.0 (1.22)
    assert one_layout_winners(timings, families) == ("onednn", ["onednn", "onednn", "onednn"])
    timings["onednn"] = [4.0, 1.0, 3.0]  # 4x slower at one row, and still the lesser loss: 4 ** (1 / 3) = 1.59 < 1.80
    assert one_layout_winners(timings, families) == ("onednn", ["onednn", "onednn", "onednn"])
    timings["onednn"] = [8.0, 1.0, 3.0]  # 2.0 against 1.80
    assert one_layout_winners(timings, families) == ("servelab", ["servelab", "torch", "torch"])
    # without torch's matmul over the blocked layout, F.linear reads the checkpoint's tensor: a layout of its own
    assert layout_families(["servelab", "onednn", "torch"], torch_on_blocked=False) == {
        "servelab": ["servelab"], "onednn": ["onednn"], "torch": ["torch"]}


def test_row_dispatch_sends_each_batch_to_its_kernel() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(40, 24), torch.randn(40)
    if (reason := linear_kernel_reason("onednn", device=CPU, dtype=torch.float32, cache_dir=CACHE)) is not None:
        pytest.skip(reason)
    kernel = LinearKernel("auto", None, ((4, "torch"), (32, "onednn"), (None, "onednn")))
    linear = kernel.make(weight, bias)
    assert isinstance(linear, RowDispatchLinear) and linear.max_rows == [4]
    assert [type(x) for x in linear.linears] == [TorchLinear, OneDNNLinear]
    calls = []
    for i, inner in enumerate(linear.linears):
        linear.linears[i] = (lambda f, i: lambda x: calls.append(i) or f(x))(inner, i)
    for rows in (1, 4, 5, 64):
        x = torch.randn(rows, 24)
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    assert calls == [0, 0, 1, 1]
    assert kernel.label == "auto, measured: 1-4 rows torch F.linear, 5+ rows oneDNN pre-packed"


def test_static_cache_holds_a_prefill_in_its_capacity() -> None:
    cache = StaticKVCache(num_layers=1, batch_size=3, num_kv_heads=2, capacity=4, head_dim=8,
                          dtype=torch.bfloat16, device=CPU)
    keys = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 2, 3, 8)  # row i holds the value i
    held_keys, _ = cache.append(0, keys, keys)
    cache.advance(3)
    assert held_keys.dtype == cache.keys[0].dtype == torch.bfloat16  # stored narrower, read as stored
    assert held_keys.shape == (3, 2, 3, 8) and cache.allocated_bytes == 2 * 3 * 2 * 4 * 8 * 2
    with pytest.raises(RuntimeError, match="capacity 4 exceeded"):
        cache.append(0, torch.zeros(3, 2, 2, 8), torch.zeros(3, 2, 2, 8))


def _prefilled(values: list[float], width: int, lengths: list[int]) -> tuple[StaticKVCache, torch.Tensor]:
    """A one-layer prefill cache, row i left-padded to width, its real columns hold values[i] + column."""
    cache = StaticKVCache(num_layers=1, batch_size=len(values), num_kv_heads=1, capacity=width, head_dim=4,
                          dtype=torch.float32, device=CPU)
    keys = torch.tensor(values).view(-1, 1, 1, 1) + torch.arange(width, dtype=torch.float32).view(1, 1, -1, 1)
    cache.append(0, keys.expand(-1, 1, width, 4), keys.expand(-1, 1, width, 4))
    cache.advance(width)
    mask = torch.zeros(len(values), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, width - n:] = 1
    return cache, mask


def test_a_model_the_decoder_does_not_cover_is_served_by_transformers(settings) -> None:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, hidden_act="gelu")
    model = LlamaForCausalLM(config).eval()
    assert "activation 'gelu'" in unsupported_reason(model)
    decoder = build_decoder(model, choice="auto", kv_cache_dtype="auto", dtype=torch.float32, device=CPU,
                            linear_kernel="auto", cache_dir=settings.cache_dir)
    assert decoder.name == "transformers"
