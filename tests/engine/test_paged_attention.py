"""How the paged pool is read (`paged_attention`): FlexAttention reading each decode row's blocks in place, compiled as
it is on a GPU (here by inductor's CPU kernels), against a gather of the same columns; the engine decoding through it
like the naive reference (rows joining and leaving a small pool, a cached prefix, prompts in chunks, the padded steps a
CUDA graph replays); the token-major pool's reads against the default layout's; the choice `auto` makes and the refusals by
name. On CUDA the same engine check runs on the GPU."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from servelab.engine import paged_attention as paged
from servelab.engine.engine import Engine, check_configured_kernel
from servelab.engine.kvcache import PagedKVCache, padded_tables
from servelab.request import GenerationRequest, SamplingParams
from servelab.settings import Settings
from tests.engine.conftest import make_config
from tests.engine.host_reads import HostReads, unobserved
from tests.engine.naive import naive_greedy
from tests.engine.test_stepping import _request, _run_schedule


def _gathered(pool_k, pool_v, tables: list[list[int]], lengths: list[int], queries, scale: float) -> torch.Tensor:
    """Each row's columns 0..lengths[b] gathered from its blocks, then SDPA: (B, H x D)."""
    bs, out = pool_k.shape[1], []
    for b, (table, length) in enumerate(zip(tables, lengths)):
        columns = torch.arange(length + 1)
        blocks, offsets = torch.tensor(table)[columns // bs], columns % bs
        k, v = pool_k[blocks, offsets].transpose(0, 1), pool_v[blocks, offsets].transpose(0, 1)  # (H_kv, S, D)
        o = F.scaled_dot_product_attention(queries[b][None, :, None], k[None], v[None], scale=scale, enable_gqa=True)
        out.append(o.reshape(-1))
    return torch.stack(out)


def _flex_against_a_gather(bs: int, num_blocks: int, cases) -> None:
    torch.manual_seed(0)
    H, H_kv, D = 4, 2, 16  # NOTE: the tiny Llama's heads
    pool_k, pool_v = torch.randn(num_blocks, bs, H_kv, D), torch.randn(num_blocks, bs, H_kv, D)
    flex = paged.FlexDecode(num_heads=H, num_kv_heads=H_kv, head_dim=D, scale=D ** -0.5, block_size=bs,
                            dtype=torch.float32, device=torch.device("cpu"), max_positions=num_blocks * bs)
    for tables, lengths in cases:
        width = max(map(len, tables))
        table = torch.tensor([[*t, *[0] * (width - len(t))] for t in tables], dtype=torch.int32)
        queries = torch.randn(len(tables), H, D)
        step = flex.prepare(torch.tensor(lengths), table, num_blocks)
        assert step.buffers.query.shape[0] == paged.MIN_ROWS
        assert step.new_blocks.tolist() == [t[n // bs] for t, n in zip(tables, lengths)]
        assert step.new_offsets.tolist() == [n % bs for n in lengths]
        got = flex.attend(step, queries, pool_k, pool_v)
        torch.testing.assert_close(got, _gathered(pool_k, pool_v, tables, lengths, queries, D ** -0.5))


@torch.inference_mode()  # NOTE: as a serving step runs (grad mode compiles another kernel)
def test_flex_reads_each_rows_blocks_in_place_like_a_gather_of_its_columns() -> None:
    """Rows of one block, of several, one sharing another's first block, one whose new key fills its last block, one
    padded row (3 rows at a padded 4); then fewer rows in the same buffers (stale padding must not leak). The engines'
    pool below (40 blocks of 4 and the scratch block): one compiled kernel."""
    _flex_against_a_gather(4, 41, [([[5], [7, 2, 11], [7, 3]], [2, 9, 7]), ([[9, 4], [1]], [7, 0])])


@torch.inference_mode()
def test_flex_reads_a_pool_of_512_slots_a_row_or_more_like_a_gather() -> None:
    """A pool past 512 slots for each padded row: inductor's C++ kernel is then its decoding template (the kernel every
    CPU pool of a default config compiles to), which would not compile without a list of full blocks."""
    rows = [[3, 17, 101, 64, 9, 88, 120, 42, 5, 77, 31], [12], [56, 2, 90]]
    _flex_against_a_gather(16, 129, [(rows, [165, 0, 47]), ([rows[2], [127, 128]], [32, 20])])


def test_padded_rows_are_powers_of_two_from_the_smallest() -> None:
    assert [paged.padded_rows(n) for n in (1, 3, 4, 5, 8, 9, 64, 65)] == [4, 4, 4, 8, 8, 16, 64, 128]


def test_block_tables_are_padded_to_their_width_with_the_block_named() -> None:
    table = padded_tables([[3, 1], [], [5]], 3, 9)
    assert table.dtype == torch.int32 and table.tolist() == [[3, 1, 9], [9, 9, 9], [5, 9, 9]]
    assert padded_tables([], 4, 0).shape == (0, 4)


def test_a_token_major_pool_reads_the_same_columns_as_the_default_layout() -> None:
    torch.manual_seed(1)
    pools = {layout: PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                                  device=torch.device("cpu"), num_blocks=6, block_size=4, layout=layout)
             for layout in ("HND", "NHD")}
    blocks, offsets = torch.tensor([3, 3, 1, 5, 0]), torch.tensor([0, 1, 2, 3, 0])
    keys, values = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    for pool in pools.values():
        pool.reach([[0, 1, 3, 5]])
        pool.write(0, blocks, offsets, keys, values)
    # NOTE: a token-major pool is allocated whole at its first reach, with its scratch block past the pool's own
    assert pools["NHD"].keys[0].shape == (7, 4, 2, 8) and pools["NHD"].scratch_block == 6
    assert pools["HND"].keys[0].shape == (6, 2, 4, 8)
    for got, want in zip(pools["NHD"].read(0, blocks, offsets), pools["HND"].read(0, blocks, offsets)):
        torch.testing.assert_close(got, want)
    table = torch.tensor([[3, 1], [5, 0]])
    for got, want in zip(pools["NHD"].read_blocks(0, table), pools["HND"].read_blocks(0, table)):
        torch.testing.assert_close(got, want)
    with pytest.raises(AssertionError, match="int8"):
        PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.int8, device=torch.device("cpu"),
                     num_blocks=6, block_size=4, layout="NHD")


@pytest.fixture(scope="module")
def flex_engine(tiny_folder: Path, settings: Settings) -> Engine:
    """The tiny Llama read through FlexAttention, blocks of 4 tokens in a pool of 40 (test_kv_window's flex engine's
    size: inductor's cache serves the kernels it compiled) and prompts in chunks of 24."""
    return Engine.from_config(make_config(
        str(tiny_folder), paged_attention="flex", kv_cache={"block_size": 4, "prefix_caching": True},
        batching={"max_batch_tokens": 160, "max_prefill_tokens": 24},
        decoding={"max_new_tokens": 24, "max_context_tokens": 96}), settings)


def _expected(engine: Engine, request: GenerationRequest) -> list[int]:
    return naive_greedy(engine.model, engine.encode(request), request.params.max_new_tokens, engine.eos_token_ids)


def test_flex_rows_joining_and_leaving_decode_like_naive(flex_engine: Engine) -> None:
    assert flex_engine.decoder.paged_attention == "flex" and flex_engine.decoder.decode_step_attention is None
    rng = random.Random(7)
    arrivals: dict[int, list[GenerationRequest]] = {}
    for i in range(10):
        arrivals.setdefault(rng.randint(0, 6), []).append(_request(rng, f"r{i}"))
    done = _run_schedule(flex_engine, arrivals)
    for request in (r for group in arrivals.values() for r in group):
        assert list(done[request.request_id].token_ids) == _expected(flex_engine, request), request.request_id
    assert flex_engine.num_live == 0 and flex_engine.scheduler.pool.num_used_blocks == 0


def test_flex_serves_a_cached_prefix_and_a_prompt_in_chunks_like_naive(flex_engine: Engine) -> None:
    system = "You answer in one word. Examples: sky is blue, grass is green, snow is white, coal is black. Now:"
    first = GenerationRequest("a", prompt=f"{system} the sea is", params=SamplingParams(max_new_tokens=6))
    second = GenerationRequest("b", prompt=f"{system} a lemon is", params=SamplingParams(max_new_tokens=6))
    assert len(flex_engine.encode(first)) > 24  # more than one chunk
    a = flex_engine.generate([first]).completions[0]
    b = flex_engine.generate([second]).completions[0]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens >= 16
    # NOTE: the chunks read the pool in place too (flex_chunks), in buffers of their padded sizes
    chunks = flex_engine.decoder.chunks(flex_engine.scheduler.pool.block_size)
    assert flex_engine.decoder.chunk_attention == "flex" and {size for size, _, _ in chunks._buffers} >= {32}
    for request, completion in ((first, a), (second, b)):
        assert list(completion.token_ids) == _expected(flex_engine, request)


def test_decode_steps_from_padded_buffers_decode_like_naive_and_pad_only_the_scratch_block(flex_engine: Engine) -> None:
    """The steps a CUDA graph replays, run eagerly here from the same buffers: padded rows write the scratch block
    and nothing else."""
    runner = flex_engine.runner
    runner.graph_rows = 8
    try:
        rng = random.Random(11)
        arrivals = {step: [_request(rng, f"g{step}-{i}") for i in range(n)] for step, n in ((0, 3), (2, 2), (6, 1))}
        done = _run_schedule(flex_engine, arrivals)
        graphs = next(iter(runner._graphs.values()))
        assert graphs._sizes and set(graphs._sizes) <= {4, 8} and graphs.captured == [] and not graphs.failed
        for request in (r for group in arrivals.values() for r in group):
            assert list(done[request.request_id].token_ids) == _expected(flex_engine, request), request.request_id
        cache = runner.cache(flex_engine.scheduler.pool)
        scratch = cache.scratch_block
        assert scratch == flex_engine.scheduler.pool.num_blocks and cache.num_allocated_blocks == scratch + 1
        assert cache.keys[0][scratch, 0].abs().sum() > 0 and cache.keys[0][scratch, 1:].abs().sum() == 0
    finally:
        runner.graph_rows = 0


def test_prepare_builds_each_padded_size_a_worker_can_take_before_it_serves(flex_engine: Engine) -> None:
    """What a worker does before its first read (on CUDA: every graph captured): here each size's eager step, padded
    rows only, so they write the scratch block and nothing else; then a step of that size reuses the size built."""
    runner = flex_engine.runner
    flex_engine.reset()  # NOTE: a fresh pool, every block zero
    pool = flex_engine.scheduler.pool
    runner.prepare(pool, 64)
    assert runner.prepared is None and pool not in runner._graphs  # graphs off: nothing to build
    runner.graph_rows = 4  # NOTE: sizes past 4 rows would compile FlexAttention again, at ~10 s each on a CPU
    try:
        runner.prepare(pool, 3)
        graphs = runner._graphs[pool]
        assert list(graphs._sizes) == [4] and runner.prepared[0] == [4]
        cache = runner.cache(pool)
        # NOTE: and each padded prompt-chunk size up to the chunk budget (24 tokens) compiled, reading the scratch block
        chunks = flex_engine.decoder.chunks(pool.block_size)
        assert {(16, cache.num_allocated_blocks, 0), (32, cache.num_allocated_blocks, 0)} <= set(chunks._buffers)
        assert cache.keys[0][cache.scratch_block].abs().sum() > 0
        assert cache.keys[0][:cache.scratch_block].abs().sum() == 0 and cache.values[0][:cache.scratch_block].abs().sum() == 0
        built = graphs._sizes[4]
        request = GenerationRequest("p", prompt="the sea is", params=SamplingParams(max_new_tokens=4))
        done = _run_schedule(flex_engine, {0: [request]})
        assert graphs._sizes[4] is built and list(done["p"].token_ids) == _expected(flex_engine, request)
    finally:
        runner.graph_rows, runner.prepared = 0, None


def test_chunk_sizes_compiled_before_serving_stop_at_the_longest_row_a_mask_lists(flex_engine: Engine,
                                                                                  monkeypatch) -> None:
    """On CUDA a chunk mask lists only as many blocks as the longest row holds (FlexChunks.width), which a chunk budget
    may pass (max_prefill_tokens 4096 against a context of 2048, say): the compile before serving asks for no chunk
    longer than that. Here the width narrowed to 5 blocks of 4 (20 tokens) under a 24-token budget, the calls recorded
    and not run."""
    runner, pool = flex_engine.runner, flex_engine.scheduler.pool
    chunks = flex_engine.decoder.chunks(pool.block_size)
    asked = []
    monkeypatch.setattr(chunks, "width", lambda num_pool_blocks: 5)
    monkeypatch.setattr(chunks, "prepare",
                        lambda table, start, num_tokens, *args: asked.append((len(table), num_tokens)))
    monkeypatch.setattr(chunks, "attend", lambda step, queries, *args: None)
    assert runner._compile_chunks(pool) == [16, 32] and asked == [(4, 16), (5, 20)]


def test_the_step_a_cuda_graph_captures_reads_nothing_back_and_copies_nothing_in(flex_engine: Engine,
                                                                                  monkeypatch) -> None:
    """The padded decode step a worker captures on a GPU (DecodeGraphs.step), run here under HostReads: no op that
    would fail its capture there (FlexAttention's compiled call itself aside). The same forward with its positions
    checked inside reads one value back, and is caught, at its line."""
    runner = flex_engine.runner
    flex_engine.reset()
    pool = flex_engine.scheduler.pool
    runner.graph_rows = 4
    try:
        runner.prepare(pool, 3)
        graphs = runner._graphs[pool]
        flex = flex_engine.decoder.flex(pool.block_size)
        monkeypatch.setattr(flex, "_flex", unobserved(flex._flex))
        batch = graphs._sizes[4].batch
        with torch.inference_mode(), HostReads().observing() as reads:
            logits = graphs.step(batch)
        assert logits.shape == (4, flex_engine.decoder.vocab_size) and reads.found == []
        with torch.inference_mode(), HostReads().observing() as reads:
            flex_engine.decoder.forward_paged(batch, graphs.cache)
        assert len(reads.found) == 1 and reads.found[0].startswith("aten.item.default at servelab/engine/decoder.py:")
    finally:
        runner.graph_rows, runner.prepared = 0, None


def test_host_reads_finds_what_a_capture_refuses_and_passes_what_it_takes() -> None:
    x = torch.arange(6.0)
    refused = {"item": lambda: x[1].item(), "int": lambda: int(x[1]), "bool": lambda: bool(x[1] > 0),
               "tolist": lambda: x.tolist(), "numpy": lambda: x.numpy(), "mask": lambda: x[x > 2],
               "masked write": lambda: x.clone().__setitem__(x > 2, 0.0), "nonzero": lambda: x.nonzero(),
               "from a list": lambda: torch.tensor([1, 2]), "equal": lambda: torch.equal(x, x)}
    for name, op in refused.items():
        with HostReads().observing() as reads:
            op()
        assert len(reads.found) == 1, (name, reads.found)
    with HostReads().observing() as reads:
        y = torch.zeros(6)
        y[2:] = 1.0
        y.index_copy_(0, torch.arange(2), x[:2])
        y[torch.arange(3)] = x[:3]
        torch.where(x > 2, x, y).max()
    assert reads.found == []


def test_the_load_time_measurement_times_both_ways_on_this_cpu(flex_engine: Engine) -> None:
    """What `auto` runs on CUDA at load, run here at a tiny shape (it must run, not only be chosen from), torch's side
    through the decoder's own attention."""
    # NOTE: 4 rows of 10 blocks of 4 and a spare block: the pool size every flex kernel here is compiled for
    seconds = flex_engine.decoder.measure_paged_attention(4, num_rows=4, columns=40)
    assert set(seconds) == {"flex", "torch"} and all(0 < t < 1 for t in seconds.values())
    # NOTE: and prompt chunks' (flex_chunks.choose): 16 tokens after 140 cached columns, a pool of 40 blocks and the
    # scratch block, as the engine's
    seconds = flex_engine.decoder.measure_chunk_attention(4, tokens=16, cached=140)
    assert set(seconds) == {"flex", "torch"} and all(0 < t < 1 for t in seconds.values())


def test_auto_picks_the_measured_faster_on_cuda_and_says_why() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert paged.choose("auto", fused_fits=True, device=cpu, flex_why_not=None, measure=None)[0] == "servelab"
    name, reason = paged.choose("auto", fused_fits=False, device=cuda, flex_why_not=None,
                                measure=lambda: {"flex": 20e-6, "torch": 90e-6})
    assert name == "flex" and "flex 20 us" in reason and "torch 90 us" in reason
    assert paged.choose("auto", fused_fits=False, device=cuda, flex_why_not=None,
                        measure=lambda: {"flex": 90e-6, "torch": 20e-6})[0] == "torch"
    assert paged.choose("auto", fused_fits=False, device=cuda, flex_why_not="int8", measure=None) == ("torch", "int8")

    def no_compiler():
        raise RuntimeError("Cannot find a working triton installation\nmore")

    assert paged.choose("auto", fused_fits=False, device=cuda, flex_why_not=None, measure=no_compiler) == (
        "torch", "FlexAttention could not be compiled or run here: Cannot find a working triton installation")
    # NOTE: asked for on CUDA, it is compiled and timed at load: a kernel that cannot compile is refused there
    with pytest.raises(paged.PagedAttentionError, match="'flex' cannot serve here: .*compiled or run: AssertionError"):
        paged.choose("flex", fused_fits=False, device=cuda, flex_why_not=None,
                     measure=lambda: (_ for _ in ()).throw(AssertionError()))
    name, reason = paged.choose("flex", fused_fits=False, device=cuda, flex_why_not=None,
                                measure=lambda: {"flex": 30e-6, "torch": 20e-6})
    assert name == "flex" and reason.startswith("asked") and "torch 20 us" in reason
    assert paged.choose("auto", fused_fits=False, device=cpu, flex_why_not=None, measure=None)[0] == "torch"
    with pytest.raises(paged.PagedAttentionError, match="'servelab' cannot serve here: .*CPU"):
        paged.choose("servelab", fused_fits=False, device=cuda, flex_why_not=None, measure=None)
    with pytest.raises(paged.PagedAttentionError, match="'flex' cannot serve here: int8"):
        paged.choose("flex", fused_fits=True, device=cpu, flex_why_not="int8", measure=None)


def test_what_flex_cannot_read_is_refused_by_name(tiny_folder: Path, settings: Settings) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    pool = dict(dtype=torch.float32, head_dim=64, block_size=16, device=cuda)
    assert "scales" in paged.flex_reason(**{**pool, "cache_dtype": torch.int8})
    assert "one dtype" in paged.flex_reason(**{**pool, "cache_dtype": torch.bfloat16})
    assert "power of two" in paged.flex_reason(**{**pool, "cache_dtype": torch.float32, "head_dim": 80})
    assert "block_size is 8" in paged.flex_reason(**{**pool, "cache_dtype": torch.float32, "block_size": 8})
    assert "(this model's: 3)" in paged.flex_reason(**{**pool, "cache_dtype": torch.float32, "group": 3})
    assert paged.flex_reason(**{**pool, "cache_dtype": torch.float32, "group": 3, "device": cpu}) is None
    assert paged.flex_reason(**{**pool, "cache_dtype": torch.float32, "block_size": 8, "device": cpu}) is None
    assert paged.flex_reason(**{**pool, "cache_dtype": torch.float32}) is None
    with pytest.raises(paged.PagedAttentionError, match="paged_attention 'flex' cannot serve here: .*int8"):
        check_configured_kernel(make_config(str(tiny_folder), paged_attention="flex", kv_cache_dtype="int8"), settings)
    with pytest.raises(paged.PagedAttentionError, match="needs servelab's decoder"):
        check_configured_kernel(make_config(str(tiny_folder), paged_attention="torch", decoder="transformers"),
                                settings)
    with pytest.raises(paged.PagedAttentionError, match="'flex' cannot serve here: .*one dtype"):
        Engine.from_config(make_config(str(tiny_folder), paged_attention="flex", kv_cache_dtype="bf16"), settings)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attention", ["flex", "torch", "auto"])
def test_each_paged_attention_on_cuda_decodes_like_naive(tiny_folder: Path, settings: Settings, attention: str) -> None:
    engine = Engine.from_config(make_config(str(tiny_folder), device="cuda", paged_attention=attention,
                                            kv_cache={"block_size": 16}), settings)
    assert engine.decoder.paged_attention in ("flex", "torch") and engine.decoder.paged_attention_reason
    rng = random.Random(3)
    arrivals = {step: [_request(rng, f"r{step}-{i}") for i in range(2)] for step in (0, 2, 5)}
    done = _run_schedule(engine, arrivals)
    for request in (r for group in arrivals.values() for r in group):
        assert list(done[request.request_id].token_ids) == _expected(engine, request), request.request_id
    if engine.decoder.paged_attention == "flex":  # its decode-only steps replayed from captured graphs
        assert "replayed from CUDA graphs at 4" in engine.runner.graphs_summary() and "eager" not in \
            engine.runner.graphs_summary()
        engine.reset()
        engine.runner.prepare(engine.scheduler.pool, 8)  # as a worker does before its first read
        assert engine.runner.prepared[0] == [4, 8] and "4, 8 captured before serving" in engine.runner.graphs_summary()
        again = _run_schedule(engine, {0: [arrivals[0][0]]})
        assert list(again[arrivals[0][0].request_id].token_ids) == _expected(engine, arrivals[0][0])
