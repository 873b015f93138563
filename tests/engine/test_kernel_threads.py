"""servelab's kernels on torch's threads (blocked.cpp, both builds this CPU runs): every build runs at::parallel_for
on torch's pool (a build without OpenMP would run every kernel on one thread), the grain keeps small work on one
thread, and every threaded kernel gives exactly the single-threaded bits at 2 threads and at an odd count (3):
a thread takes whole output blocks or whole rows, computed in the same order whatever the count.

The grain is set to 0 here so that these small shapes split across every thread (the default would keep most of
them on one); torch's thread count and the grain are restored after each test.
"""

from __future__ import annotations

import os

import pytest
import torch

from servelab.engine.kernels import ISAS, isa_reason, load_blocked_kernel

BUILDS = [pytest.param(isa.name, marks=pytest.mark.skipif(isa_reason(isa) is not None, reason=f"{isa_reason(isa)}"))
          for isa in ISAS]
THREADS = (2, 3)  # against 1


@pytest.fixture
def kernel(request, settings):
    module = load_blocked_kernel(settings.cache_dir, request.param).module
    threads, grain = torch.get_num_threads(), module.thread_grain()
    module.thread_grain(0)
    yield module
    module.thread_grain(grain)
    torch.set_num_threads(threads)


def at_threads(fn, *args, **kwargs) -> dict[int, torch.Tensor]:
    out = {}
    for n in (1, *THREADS):
        torch.set_num_threads(n)
        out[n] = fn(*args, **kwargs)
    return out


def assert_same_bits(results: dict[int, torch.Tensor | list[torch.Tensor]], what: str) -> None:
    for n in THREADS:
        got, want = results[n], results[1]
        for g, w in zip(got if isinstance(got, list) else [got], want if isinstance(want, list) else [want]):
            assert torch.equal(g, w), f"{what}: {n} threads differ from 1"


@pytest.mark.parametrize("kernel", BUILDS, indirect=True)
def test_every_build_runs_on_torchs_threads_and_the_grain_keeps_small_work_on_one(kernel) -> None:
    assert kernel.parallel(), "built without OpenMP: at::parallel_for would run on the calling thread only"
    for n in (1, *THREADS):
        torch.set_num_threads(n)
        assert kernel.threads_used(64, 1 << 20) == n
        assert kernel.threads_used(1, 1 << 20) == 1  # one item: one thread
    kernel.thread_grain(1 << 20)
    assert kernel.threads_used(64, 1024) == 1  # 64 KB of work, below the grain: not worth a second thread
    assert kernel.threads_used(4096, 1024) == 3  # 4 MB: every thread
    torch.set_num_threads(1)
    assert kernel.threads_used(4096, 1024) == 1


@pytest.mark.parametrize("kernel", BUILDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "mixed"])
def test_threaded_matmul_equals_the_single_threaded_one(kernel, dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    w_dtype = torch.bfloat16 if dtype == "mixed" else dtype
    x_dtype = torch.float32 if dtype == "mixed" else dtype
    packed = kernel.pack(torch.randn(208, 96, generator=generator).to(w_dtype))  # 13 blocks: uneven splits
    for rows in (1, 2, 5, 19, 400):  # bf16 at 400 rows where AMX runs: the tiles' rows in 2 parts at 2 threads, 3 at 3
        x = torch.randn(rows, 96, generator=generator).to(x_dtype)
        residual = torch.randn(rows, 208, generator=generator).to(x_dtype)
        assert_same_bits(at_threads(kernel.linear, x, packed), f"linear {dtype} at {rows} rows")
        assert_same_bits(at_threads(kernel.linear, x, packed, residual), f"linear + residual {dtype} at {rows} rows")


@pytest.mark.parametrize("kernel", BUILDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threaded_int4_and_int8_matmuls_equal_the_single_threaded_ones(kernel, dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    N, K, group = 208, 128, 32
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=generator)
    scales = (torch.rand(K // group, N, generator=generator) * 0.02 + 0.001).half().float()
    zeros = torch.randint(0, 16, (K // group, N), generator=generator).float()
    int4 = kernel.int4_pack(q, scales, zeros, group)
    int8 = kernel.int8_pack(torch.randn(N, K, generator=generator))
    for rows in (1, 3, 9, 19):  # activation quantisation splits by rows, the matmuls by blocks
        x = torch.randn(rows, K, generator=generator).to(dtype)
        for float_activations in (False, True):
            assert_same_bits(at_threads(kernel.int4_linear, x, *int4, group, 1 << 30, float_activations=float_activations),
                             f"int4 streamed ({'fp32' if float_activations else 'int8'} activations) at {rows} rows")
        assert_same_bits(at_threads(kernel.int8_linear, x, *int8, group), f"int8 at {rows} rows")
    # many rows: the dequantised tile (split by blocks: exact) times torch's GEMM, whose own threading may reorder
    # its sums: within fp32 rounding of the single-threaded product
    x = torch.randn(40, K, generator=generator).to(dtype)
    tiles = at_threads(kernel.int4_linear, x, *int4, group, 0)
    for n in THREADS:
        torch.testing.assert_close(tiles[n].float(), tiles[1].float(), atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("kernel", BUILDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threaded_norm_and_swiglu_equal_the_single_threaded_ones(kernel, dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    for rows in (1, 2, 7):
        x = torch.randn(rows, 3, 64, generator=generator).to(dtype)
        weight = torch.randn(64, generator=generator).to(dtype)
        assert_same_bits(at_threads(kernel.rms_norm, x, weight, 1e-5), f"rms_norm at {rows * 3} rows")
        assert_same_bits(at_threads(kernel.silu_mul, x.view(rows, 3 * 64)[:, :192].contiguous()), f"silu_mul at {rows} rows")


@pytest.mark.parametrize("kernel", BUILDS, indirect=True)
@pytest.mark.parametrize("cache", ["fp32", "bf16", "int8"])
def test_threaded_decode_attention_equals_the_single_threaded_one(kernel, cache: str) -> None:
    """The fused decode attention (rotary positions, cache write, attention) at 1, 2 and 3 threads, one item per row
    and kv head: one row's three kv heads (2 against 1 on 2 threads) and two rows of different lengths; the same
    output and the same cache, to the bit, over each cache precision."""
    generator = torch.Generator().manual_seed(0)
    H, H_kv, D, bs, blocks = 9, 3, 64, 16, 12
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[cache]
    for lengths in ([37], [5, 70]):
        B = len(lengths)
        qkv = torch.randn(B, H + 2 * H_kv, D, generator=generator)
        cos, sin = torch.randn(128, D, generator=generator), torch.randn(128, D, generator=generator)
        pool = torch.randn(blocks, H_kv, bs, D, generator=generator) * 3
        keys, values = (pool.to(dtype) if cache != "int8" else (pool * 10).to(torch.int8) for _ in range(2))
        scales = [torch.rand(blocks, H_kv, bs, generator=generator) * 0.1 for _ in range(2)] if cache == "int8" else []
        table = torch.randperm(blocks, generator=generator)[: B * 6].view(B, 6).to(torch.int32)
        positions, lens = torch.tensor(lengths), torch.tensor(lengths)

        def attend():
            k, v, sc = keys.clone(), values.clone(), [t.clone() for t in scales]
            out = kernel.decode_step_attention(qkv, cos, sin, positions, k, v, lens, table, H, D ** -0.5, *sc)
            return [out, k, v, *sc]

        assert_same_bits(at_threads(attend), f"decode attention, {cache} cache, rows of {lengths}")


@pytest.mark.parametrize("kernel", BUILDS, indirect=True)
def test_threaded_prefill_attention_equals_the_single_threaded_one(kernel) -> None:
    """A prompt chunk's attention: a thread takes whole tiles (16 tokens, one kv head), each computed in one order,
    so 2 and 3 threads give 1's bits; 40 tokens after a prefix of 30 make 3 tiles of unequal work per kv head."""
    generator = torch.Generator().manual_seed(0)
    T, start, H, H_kv, D = 40, 30, 6, 2, 64
    qkv = torch.randn(T, H + 2 * H_kv, D, generator=generator)
    keys, values = (torch.randn(start + T, H_kv, D, generator=generator).transpose(0, 1) for _ in range(2))
    out = at_threads(kernel.prefill_attention, qkv[:, :H], keys, values, start, D ** -0.5)
    assert_same_bits(out, "prefill attention")


@pytest.mark.parametrize("kernel", BUILDS, indirect=True)
@pytest.mark.parametrize("cache", ["bf16", "int8"])
def test_threaded_fused_prefill_step_equals_the_single_threaded_one(kernel, cache: str) -> None:
    """The fused chunk step: a thread takes whole tokens (rotary, cache writes), whole pieces of columns (the read)
    and whole tiles (attention), so the output and the pool are 1 thread's bits at 2 and 3."""
    from tests.engine.test_decoder import chunk_step_inputs

    inputs = chunk_step_inputs(torch.float32, cache, torch.Generator().manual_seed(1))
    pools = ("keys", "values", "key_scales", "value_scales")

    def step():
        mine = {**inputs, **{k: inputs[k].clone() for k in pools if inputs[k] is not None}}
        return [kernel.prefill_step_attention(**mine), *(mine[k] for k in pools if mine[k] is not None)]

    assert_same_bits(at_threads(step), f"fused prefill step, {cache} cache")


def test_threads_default_to_the_cores_the_process_may_run_on(tmp_path, settings) -> None:
    from servelab.config import ServingConfig
    from servelab.engine.loader import apply_threads
    from servelab.settings import _cpu_quota, available_cores

    before, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(affinity)})  # this thread: as `servelab up` pins a worker to one core
        assert available_cores() == 1
        os.sched_setaffinity(0, affinity)
        assert apply_threads(ServingConfig(name="t"), settings.model_copy(update={"num_threads": None})) == available_cores()
        assert available_cores() <= len(affinity)
        assert apply_threads(ServingConfig(name="t", num_threads=3), settings) == 3  # the config's count wins
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(before)
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # docker run --cpus 1.5
    assert _cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert _cpu_quota(tmp_path) is None


@pytest.mark.parametrize("kernel", BUILDS, indirect=True)
def test_argmax_rows_is_torchs_argmax_and_sends_rows_with_nan_or_inf_to_torch(kernel) -> None:
    """argmax_rows gives torch.argmax's index (the first of tied maxima) for finite rows, at every thread count,
    with a tail past the last full vector and rows shorter than one; a row holding NaN or an infinity gives -1 and
    kernel_argmax, the engine's greedy pick, asks torch for it (torch orders NaN above every value)."""
    from servelab.engine.sampling import kernel_argmax

    generator = torch.Generator().manual_seed(0)
    for width in (49152, 1003, 7, 1):
        x = torch.randn(9, width, generator=generator)
        if width > 100:
            x[1, 50] = x[1, 900] = x[1].max() + 1  # a tie: the first wins
            x[2, -1] = x[2].max() + 1  # the largest in the tail
            x[3] = -0.0
            x[3, 17] = 0.0  # equal to -0.0: index 0 wins, as in torch
        results = at_threads(lambda: kernel.argmax_rows(x)[0])
        assert_same_bits(results, "argmax_rows")
        assert torch.equal(results[1], x.argmax(dim=-1)) and kernel.argmax_rows(x)[1] == 0, width
    x = torch.randn(4, 1003, generator=generator)
    x[0, 10], x[1, 20], x[2, 1000] = float("nan"), float("-inf"), float("inf")
    ids, not_finite = kernel.argmax_rows(x)
    assert ids.tolist()[:3] == [-1, -1, -1] and ids[3] == x[3].argmax() and not_finite == 3
    assert torch.equal(kernel_argmax(kernel)(x), x.argmax(dim=-1))
    assert torch.equal(kernel_argmax(kernel)(x.double()), x.double().argmax(dim=-1))  # not fp32: torch's own
    with pytest.raises(RuntimeError, match="rows of no values have no argmax"):
        kernel.argmax_rows(torch.empty(2, 0))


@pytest.mark.parametrize("kernel", BUILDS, indirect=True)
def test_the_weight_prefetch_follows_the_vendor_moves_no_bits_and_refuses_unknown_settings(kernel) -> None:
    vendor = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("vendor_id")), "")
    default = kernel.weight_prefetch()
    assert default == (("l2", 16) if vendor == "AuthenticAMD" else ("l1", 32)), (vendor, default)
    torch.manual_seed(0)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            weight = kernel.pack((torch.randn(160, 96) * 0.1).to(dtype))  # 10 blocks: passes of 4 and a rest
            for rows in (1, 2, 4, 16):  # 4-block passes at 1-4 rows (AVX-512) or 1 (AVX2); fewer blocks above
                x = torch.randn(rows, 96).to(dtype)
                outputs = []
                for setting in (("l1", 32), ("l2", 16), ("l2", 1), ("l1", 1024)):
                    assert kernel.weight_prefetch(*setting) is not None
                    assert kernel.weight_prefetch() == setting
                    outputs.append(kernel.linear(x, weight))
                assert all(torch.equal(outputs[0], other) for other in outputs[1:]), (dtype, rows)
        kernel.weight_prefetch("l2", 16)
        assert kernel.weight_prefetch("", 0) == ("l2", 16) and kernel.weight_prefetch() == ("l2", 16)  # kept
        for bad in (("l3", 16), ("L1", 16), ("l1", -1), ("l1", 1025)):
            with pytest.raises(RuntimeError, match="weight_prefetch"):
                kernel.weight_prefetch(*bad)
        assert kernel.weight_prefetch() == ("l2", 16)  # a refused setting changes nothing
    finally:
        kernel.weight_prefetch(*default)
