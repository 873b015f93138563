"""servelab's fused decode-step kernels (blocked.cpp) against the unfused operations they replace, on every build
this CPU runs: the residual added inside a matmul, SwiGLU's activation, and a decode step's rotary positions,
cache write and attention in one call; then the decoder's running-batch step against transformers' forward.

The fused kernels round as the unfused operations do in bf16, so the residual and rotation checks are exact.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from servelab.engine.awq.unpack import dequantize
from servelab.engine.decoder import LlamaDecoder, _rotate, build_decoder
from servelab.engine.kernels import ISAS, isa_reason, load_blocked_kernel
from servelab.engine.kvcache import dequantize_heads, quantize_heads
from servelab.engine.decoder import PagedBatch
from servelab.engine.engine import Engine
from tests.engine.conftest import (amx_path, assert_prompt_steps_equal_the_layer_loop, assert_stack_equals_the_layer_loop,
                                   make_config)
from tests.engine.test_decoder import KERNELS, runnable, skip_unless_runnable

CPU = torch.device("cpu")
BUILDS = [pytest.param(isa.name, marks=pytest.mark.skipif(isa_reason(isa) is not None, reason=f"{isa_reason(isa)}"))
          for isa in ISAS]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_residual_fused_into_the_matmul_equals_adding_it_after(build: str, dtype: torch.dtype, settings) -> None:
    kernel = load_blocked_kernel(settings.cache_dir, build).module
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=generator).to(dtype)
    packed = kernel.pack(weight)
    q = torch.randint(0, 16, (48, 64), dtype=torch.uint8, generator=generator)
    scales = (torch.rand(1, 48, generator=generator) * 0.02 + 0.001).half().float()
    zeros = torch.randint(0, 16, (1, 48), generator=generator).float()
    int4 = kernel.int4_pack(q, scales, zeros, 64)
    for rows in (1, 3, 9, 20):
        x = torch.randn(rows, 64, generator=generator).to(dtype)
        residual = torch.randn(rows, 48, generator=generator).to(dtype)
        fused = kernel.linear(x, packed, residual)
        assert fused.dtype == dtype
        torch.testing.assert_close(fused, kernel.linear(x, packed) + residual, atol=0, rtol=0)
        for int_rows in (0, 1 << 30):  # fp32 tiles and integer dot products
            fused = kernel.int4_linear(x, *int4, 64, int_rows, residual)
            torch.testing.assert_close(fused, kernel.int4_linear(x, *int4, 64, int_rows) + residual, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="residual must be a contiguous"):
        kernel.linear(x, packed, residual.float() if dtype == torch.bfloat16 else residual.bfloat16())


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_matmul_takes_bf16_activations_as_they_are(build: str, dtype: torch.dtype, settings) -> None:
    """No conversion around the kernel: bf16 in, bf16 out, the same products as fp32 activations holding the
    same values, rounded once."""
    kernel = load_blocked_kernel(settings.cache_dir, build).module
    generator = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (32, 128), dtype=torch.uint8, generator=generator)
    scales = (torch.rand(2, 32, generator=generator) * 0.02 + 0.001).half().float()
    zeros = torch.randint(0, 16, (2, 32), generator=generator).float()
    packed = kernel.int4_pack(q, scales, zeros, 64)
    x = torch.randn(5, 128, generator=generator).to(dtype)
    with amx_path(kernel, False):  # bf16 rows on AMX tiles round each weight to bf16: test_int4_kernel.py's own test
        for int_rows in (0, 1 << 30):
            got = kernel.int4_linear(x, *packed, 64, int_rows)
            assert got.dtype == dtype
            torch.testing.assert_close(got, kernel.int4_linear(x.float(), *packed, 64, int_rows).to(dtype), atol=0,
                                       rtol=0)
    assert packed[1].dtype == torch.float16 and packed[2].dtype == torch.uint8  # 3 bytes per output and group
    torch.testing.assert_close(kernel.int4_linear(x.float(), *packed, 64, 0),
                               x.float() @ dequantize(q, zeros, scales, 64).t(), atol=1e-4, rtol=1e-4)


def test_int4_scales_that_fp16_cannot_hold_are_refused(settings) -> None:
    kernel = load_blocked_kernel(settings.cache_dir).module
    if kernel is None:
        pytest.skip("this CPU runs no servelab build")
    q = torch.zeros(16, 64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="scales must be fp16 values"):
        kernel.int4_pack(q, torch.full((1, 16), 0.1), torch.zeros(1, 16), 64)
    with pytest.raises(RuntimeError, match="zero points must be whole numbers in 0..15"):
        kernel.int4_pack(q, torch.full((1, 16), 0.125), torch.full((1, 16), 16.0), 64)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_silu_of_gate_times_up(build: str, dtype: torch.dtype, settings) -> None:
    kernel = load_blocked_kernel(settings.cache_dir, build).module
    generator = torch.Generator().manual_seed(2)
    for width in (16, 72, 1536):  # 72: a tail shorter than a vector
        x = (torch.randn(3, 2, 2 * width, generator=generator) * 4).to(dtype)
        x[0, 0, :8] = torch.tensor([-200.0, -88.0, -20.0, 0.0, 1e-3, 20.0, 88.0, 200.0])  # the exp's range ends
        gate, up = x.chunk(2, dim=-1)
        expected = torch.nn.functional.silu(gate) * up
        got = kernel.silu_mul(x)
        assert got.shape == expected.shape and got.dtype == dtype
        tolerance = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-6, "rtol": 0.008}
        torch.testing.assert_close(got, expected, **tolerance)


def _cache(rows: int, heads: int, columns: int, dim: int, dtype: torch.dtype, generator) -> torch.Tensor:
    return torch.randn(rows, heads, columns, dim, generator=generator).to(dtype)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                   (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_decode_step_attention_equals_rotate_write_and_attend(build, q_dtype, kv_dtype, settings) -> None:
    """Rows of different lengths in the blocks of a paged pool (scattered, in no order, one shared), each row's new
    token at its own column, read through its block table."""
    kernel = load_blocked_kernel(settings.cache_dir, build).module
    generator = torch.Generator().manual_seed(3)
    B, H, H_kv, D, bs, num_blocks = 3, 6, 2, 32, 8, 12
    lengths = torch.tensor([5, 0, 31])
    positions = lengths + torch.tensor([0, 7, 2])  # positions need not equal columns
    tables = [[7, 3], [10], [2, 9, 0, 5]]  # row 0 and row 2 never share a written block; blocks 1, 4... unused
    table = torch.zeros((B, 4), dtype=torch.int32)
    for b, t in enumerate(tables):
        table[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
    keys, values = _cache(num_blocks, H_kv, bs, D, kv_dtype, generator), _cache(num_blocks, H_kv, bs, D, kv_dtype, generator)
    angles = torch.arange(64)[:, None] * torch.rand(1, D // 2, generator=generator)
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(q_dtype), torch.cat([angles.sin()] * 2, -1).to(q_dtype)
    qkv = torch.randn(B, H + 2 * H_kv, D, generator=generator).to(q_dtype)
    want_keys, want_values = keys.clone(), values.clone()
    rotated = _rotate(qkv[:, None, : H + H_kv], cos[positions][:, None, None], sin[positions][:, None, None])[:, 0]
    expected = []
    for b, n in enumerate(lengths.tolist()):
        block, offset = tables[b][n // bs], n % bs
        want_keys[block, :, offset] = rotated[b, H:].to(kv_dtype)
        want_values[block, :, offset] = qkv[b, H + H_kv:].to(kv_dtype)
        row_keys = torch.cat([want_keys[t] for t in tables[b]], dim=1)[:, : n + 1]  # (H_kv, n + 1, D)
        row_values = torch.cat([want_values[t] for t in tables[b]], dim=1)[:, : n + 1]
        q = rotated[b, :H].float().view(H_kv, H // H_kv, D)
        scores = q @ row_keys.float().transpose(-1, -2) / D ** 0.5
        expected.append((scores.softmax(-1) @ row_values.float()).reshape(H * D))
    out = kernel.decode_step_attention(qkv, cos, sin, positions, keys, values, lengths, table, H, D ** -0.5)
    assert out.dtype == q_dtype and out.shape == (B, H * D)
    # rotated as transformers rounds it in bf16 (exactly); in fp32 up to the compiler's fused multiply-adds
    exact = {"atol": 0, "rtol": 0} if q_dtype == torch.bfloat16 else {"atol": 1e-6, "rtol": 1e-6}
    torch.testing.assert_close(keys, want_keys, **exact)
    torch.testing.assert_close(values, want_values, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), torch.stack(expected), atol=1e-5 if q_dtype == torch.float32 else 1e-2,
                               rtol=1e-2)
    with pytest.raises(RuntimeError, match="row 2 position .* or length 40 out of range"):
        kernel.decode_step_attention(qkv, cos, sin, positions, keys, values, torch.tensor([5, 0, 40]), table, H,
                                     D ** -0.5)
    table[1, 0] = num_blocks  # a table naming a block past the pool is refused, not read
    with pytest.raises(RuntimeError, match="row 1 block 12 outside the pool"):
        kernel.decode_step_attention(qkv, cos, sin, positions, keys, values, lengths, table, H, D ** -0.5)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize(("H", "H_kv", "D"), [(10, 2, 48), (8, 1, 64), (4, 4, 128), (12, 1, 32)])
def test_decode_step_attention_tiles_heads_and_dims_of_every_shape(build, H, H_kv, D, settings) -> None:
    """The value sums run in register tiles of up to 4 query heads x 4 vectors of d: groups of 5 (4 + 1), 8 (4 + 4),
    1 and 12 heads, head dims that take 1, 2 or 4 vectors a tile; a head_dim past the kernel's buffers is refused."""
    kernel = load_blocked_kernel(settings.cache_dir, build).module
    generator = torch.Generator().manual_seed(5)
    bs, n = 16, 37  # 38 columns over 3 blocks, the last partly filled
    keys, values = _cache(4, H_kv, bs, D, torch.bfloat16, generator), _cache(4, H_kv, bs, D, torch.bfloat16, generator)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    qkv = torch.randn(1, H + 2 * H_kv, D, generator=generator).bfloat16()
    cos, sin = torch.ones(64, D).bfloat16(), torch.zeros(64, D).bfloat16()  # position 0's rotation: none
    out = kernel.decode_step_attention(qkv, cos, sin, torch.tensor([0]), keys, values, torch.tensor([n]), table, H,
                                       D ** -0.5)
    row_keys = torch.cat([keys[t] for t in (2, 0, 3)], dim=1)[:, : n + 1].float()  # (H_kv, n + 1, D), new key written
    row_values = torch.cat([values[t] for t in (2, 0, 3)], dim=1)[:, : n + 1].float()
    q = qkv[0, :H].float().view(H_kv, H // H_kv, D)
    want = ((q @ row_keys.transpose(-1, -2) * D ** -0.5).softmax(-1) @ row_values).reshape(H * D)
    torch.testing.assert_close(out[0].float(), want, atol=1e-2, rtol=1e-2)
    too_wide = torch.randn(1, 3, 272).bfloat16()
    with pytest.raises(RuntimeError, match="head_dim is at most 256"):
        kernel.decode_step_attention(too_wide, torch.ones(4, 272).bfloat16(), torch.zeros(4, 272).bfloat16(),
                                     torch.tensor([0]), _cache(1, 1, bs, 272, torch.bfloat16, generator),
                                     _cache(1, 1, bs, 272, torch.bfloat16, generator), torch.tensor([0]),
                                     torch.tensor([[0]], dtype=torch.int32), 1, 0.1)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("q_dtype", DTYPES)
def test_decode_step_attention_over_an_int8_cache_reads_it_as_stored_and_stays_near_the_float_cache(build, q_dtype,
                                                                                                     settings) -> None:
    """The int8 pool (int8 keys and values, an fp32 scale per column and kv head): the new key and value are quantised
    as kvcache.quantize_heads quantises (the same bits), the attention equals torch's over the dequantised pool, and
    it stays within the quantisation's error of the attention over the float values the pool was quantised from."""
    kernel = load_blocked_kernel(settings.cache_dir, build).module
    generator = torch.Generator().manual_seed(5)
    B, H, H_kv, D, bs, num_blocks = 3, 6, 2, 64, 8, 30
    lengths = torch.tensor([5, 0, 150])
    positions = lengths + torch.tensor([0, 7, 2])
    tables = [[7, 3], [10], list(range(29, 10, -1))]  # row 2: 19 blocks, in reverse order
    table = torch.zeros((B, 19), dtype=torch.int32)
    for b, t in enumerate(tables):
        table[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
    float_keys, float_values = (torch.randn(num_blocks, H_kv, bs, D, generator=generator) for _ in range(2))
    (keys, key_scales), (values, value_scales) = quantize_heads(float_keys), quantize_heads(float_values)
    angles = torch.arange(256)[:, None] * torch.rand(1, D // 2, generator=generator)
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(q_dtype), torch.cat([angles.sin()] * 2, -1).to(q_dtype)
    qkv = torch.randn(B, H + 2 * H_kv, D, generator=generator).to(q_dtype)
    out = kernel.decode_step_attention(qkv, cos, sin, positions, keys, values, lengths, table, H, D ** -0.5,
                                       key_scales, value_scales)
    float_out = kernel.decode_step_attention(qkv, cos, sin, positions, float_keys, float_values, lengths, table, H,
                                             D ** -0.5)
    assert out.dtype == q_dtype and out.shape == (B, H * D)
    rotated = _rotate(qkv[:, None, : H + H_kv], cos[positions][:, None, None], sin[positions][:, None, None])[:, 0]
    held_keys, held_values = dequantize_heads(keys, key_scales), dequantize_heads(values, value_scales)
    expected = []
    for b, n in enumerate(lengths.tolist()):
        block, offset = tables[b][n // bs], n % bs
        for got, got_scale, want in ((keys, key_scales, rotated[b, H:]), (values, value_scales, qkv[b, H + H_kv:])):
            q, scale = quantize_heads(want)
            if got is keys and q_dtype == torch.float32:  # rotated in fp32 up to the compiler's fused multiply-adds
                assert (got[block, :, offset].int() - q.int()).abs().max() <= 1
                torch.testing.assert_close(got_scale[block, :, offset], scale, atol=0, rtol=1e-6)
            else:
                assert torch.equal(got[block, :, offset], q) and torch.equal(got_scale[block, :, offset], scale), b
        row_keys = torch.cat([held_keys[t] for t in tables[b]], dim=1)[:, : n + 1]  # (H_kv, n + 1, D)
        row_values = torch.cat([held_values[t] for t in tables[b]], dim=1)[:, : n + 1]
        q = rotated[b, :H].float().view(H_kv, H // H_kv, D)
        expected.append(((q @ row_keys.transpose(-1, -2) / D ** 0.5).softmax(-1) @ row_values).reshape(H * D))
    torch.testing.assert_close(out.float(), torch.stack(expected), atol=1e-5 if q_dtype == torch.float32 else 1e-2,
                               rtol=1e-2)
    # NOTE: the bound: each cached element is off by at most max |x| / 254 (about 0.015 for these unit normals at
    # D = 64; measured 0.014 at most on the outputs, whose largest is about 3); bf16 adds its own rounding
    bound = 0.03 if q_dtype == torch.float32 else 0.06
    assert (out.float() - float_out.float()).abs().max() < bound
    with pytest.raises(RuntimeError, match="only an int8 pool, comes with key_scales and value_scales"):
        kernel.decode_step_attention(qkv, cos, sin, positions, keys, values, lengths, table, H, D ** -0.5)
    with pytest.raises(RuntimeError, match="scales .blocks, H_kv, block_size. fp32"):
        kernel.decode_step_attention(qkv, cos, sin, positions, keys, values, lengths, table, H, D ** -0.5,
                                     key_scales[:-1], value_scales)


def _running_batch_logits(decoder: LlamaDecoder, rows: list[list[int]], num_steps: int, block_size: int = 4):
    """Prefill every row as a chunk of one forward, then greedy decode steps over the paged cache (the fused step
    where it runs) -> logits per step, sequences."""
    cache = decoder.new_paged_cache(num_blocks=64, block_size=block_size)
    taken = iter(range(64))  # NOTE: each row takes the next free blocks as it grows, as a pool would hand them out
    tables = [[next(taken) for _ in range(-(-len(r) // block_size))] for r in rows]
    cache.reach(tables)
    offsets = [sum(len(r) for r in rows[:i]) for i in range(len(rows))]
    batch = PagedBatch(torch.tensor([t for r in rows for t in r]), torch.tensor([p for r in rows for p in range(len(r))]),
                       cache.table_tensor(tables), 0, tuple((o, 0, len(r)) for o, r in zip(offsets, rows)),
                       torch.tensor([o + len(r) - 1 for o, r in zip(offsets, rows)]))
    logits = [decoder.forward_paged(batch, cache)]
    sequences = [list(r) for r in rows]
    for _ in range(num_steps):
        next_ids = logits[-1].argmax(-1)
        for i, (seq, token) in enumerate(zip(sequences, next_ids.tolist())):
            seq.append(token)
            tables[i] += [next(taken) for _ in range(-(-len(seq) // block_size) - len(tables[i]))]
        cache.reach(tables)
        positions = torch.tensor([len(seq) - 1 for seq in sequences])
        logits.append(decoder.forward_paged(PagedBatch(next_ids, positions, cache.table_tensor(tables), len(rows), (),
                                                       torch.arange(len(rows))), cache))
    return logits, sequences


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", [runnable(k) for k in KERNELS])
def test_running_batch_step_equals_transformers(tiny_folder, kernel: str, dtype: torch.dtype, settings) -> None:
    skip_unless_runnable(kernel, dtype, settings.cache_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=dtype).eval()
    decoder = build_decoder(model, choice="auto", kv_cache_dtype="auto", dtype=dtype, device=CPU,
                            linear_kernel=kernel, cache_dir=settings.cache_dir)
    fused = decoder.decode_step_attention is not None
    assert fused == (decoder.kernel.blocked is not None)  # servelab's build serves the fused step where it runs
    rows = [[5, 17, 923, 4001, 88, 12], [77], [301, 302, 303]]
    steps, sequences = _running_batch_logits(decoder, rows, num_steps=4)
    for step, logits in enumerate(steps):
        for i, seq in enumerate(sequences):
            expected = model(input_ids=torch.tensor([seq[: len(rows[i]) + step]])).logits[0, -1].float()
            if dtype == torch.float32:
                torch.testing.assert_close(logits[i], expected, atol=2e-4, rtol=1e-4)
            else:  # NOTE: as test_bf16_decoder_tracks_transformers_bf16: bf16 agrees to bf16 precision
                assert (logits[i].float() - expected).abs().max() / expected.abs().max() < 0.03, (step, i)


@torch.inference_mode()
def test_a_running_batch_over_an_int8_cache_decodes_alike_through_the_fused_kernel_and_torch(tiny_folder,
                                                                                             settings) -> None:
    """Chunked prefill (SDPA over dequantised blocks) and decode steps over an int8 pool: the fused kernel of each
    build and the torch path (dequantised gathers) give the same tokens and logits within float noise, and stay near
    the fp32 cache's."""
    model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    rows = [[5, 17, 923, 4001, 88, 12, 7, 7, 301], [77], [301, 302, 303]]

    def run(kernel: str, cache_dtype: str):
        decoder = build_decoder(model, choice="auto", kv_cache_dtype=cache_dtype, dtype=torch.float32, device=CPU,
                                linear_kernel=kernel, cache_dir=settings.cache_dir)
        return decoder, *_running_batch_logits(decoder, rows, num_steps=6)

    torch_path, reference, sequences = run("torch", "int8")
    assert torch_path.decode_step_attention is None and torch_path.cache_dtype == torch.int8
    ids = torch.tensor([rows[0]])  # a prefill without the pool (the quality lab's logits) sees int8's values too
    unpaged = torch_path.logits(ids, torch.ones_like(ids), torch.arange(len(rows[0]))[None], keep=1)[0, -1]
    torch.testing.assert_close(unpaged, reference[0][0], atol=2e-4, rtol=1e-4)  # 2e-6 measured; fp32's: ~0.1
    _, float_logits, float_sequences = run("torch", "fp32")
    same = next((j for j in range(6) if any(f[len(r) + j] != s[len(r) + j]
                                            for r, f, s in zip(rows, float_sequences, sequences))), 6)
    assert same >= 3  # the first tokens agree (a random tiny model has near ties later)
    for a, b in zip(reference[:same + 1], float_logits[:same + 1]):  # the same inputs so far
        # NOTE: as bf16's check (test_bf16_decoder_tracks_transformers_bf16) against the largest logit; measured 0.024 at most
        assert (a - b).abs().max() / b.abs().max() < 0.06
    for build in (isa.name for isa in ISAS if isa_reason(isa) is None):
        fused, steps, fused_sequences = run(f"servelab-{build}", "int8")
        assert fused.decode_step_attention is not None
        assert fused_sequences == sequences
        for a, b in zip(steps, reference):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


@torch.inference_mode()
@pytest.mark.parametrize(("weights", "kv_cache_dtype"), [("fp32", "auto"), ("bf16", "auto"), ("fp32", "int8")])
def test_dense_decode_step_in_one_call_equals_the_python_layer_loop(tiny_folder, weights: str, kv_cache_dtype: str,
                                                                   settings) -> None:
    """fp32 and bf16 weights in servelab's blocked layout: a decode step through every layer in one call
    (DecodeStack; bf16 rows made fp32 inside it where the build has no AVX-512 BF16) gives the Python loop's
    logits and cache to the bit, as one parallel region at 1, 2 and 3 threads and with a region per kernel."""
    engine = Engine.from_config(make_config(str(tiny_folder), weights=weights, linear_kernel="servelab",
                                            kv_cache_dtype=kv_cache_dtype), settings)
    assert engine.decoder._decode_stack() is not None and engine.decoder._stack_rows > 3
    prompts = ["The capital of France is", "A man is sitting on a roof. He", "Seven blue houses stood by the river"]
    assert_stack_equals_the_layer_loop(engine, prompts, team_serves=True)


@torch.inference_mode()
@pytest.mark.parametrize(("weights", "kv_cache_dtype"), [("fp32", "auto"), ("bf16", "int8")])
def test_prompt_chunks_in_one_call_equal_the_python_layer_loop(tiny_folder, weights: str, kv_cache_dtype: str,
                                                               settings) -> None:
    """Steps with prompt chunks, alone or beside decode rows, through every layer in one call (DecodeStack.mixed)
    give the Python loop's logits and cache to the bit at 1, 2 and 3 threads; over a float and an int8 cache."""
    engine = Engine.from_config(make_config(str(tiny_folder), weights=weights, linear_kernel="servelab",
                                            kv_cache_dtype=kv_cache_dtype, batching={"max_prefill_tokens": 12}), settings)
    prompts = ["The capital of France is", "A man is sitting on a roof. He looks at the sky, then at the street below",
               "Seven blue houses stood by the river, and the oldest of them had a red door"]
    assert_prompt_steps_equal_the_layer_loop(engine, prompts)
