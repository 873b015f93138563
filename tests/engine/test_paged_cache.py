"""The paged KV cache: the block manager's books (sharing, reference counts, least-recently-used eviction), and the
engine decoding through it like the naive reference: rows joining and leaving at random on each kernel build this
CPU runs, a pool so small that rows must give their blocks back mid-decode, prompts served from cached blocks
(a prefix ending mid-block, a block evicted between two requests), prompts prefilled in chunks beside
decoding rows, and an int8 pool serving cached blocks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from servelab.scheduler.blocks import BlockManager, OutOfBlocks
from servelab.engine.decoder import TransformersDecoder
from servelab.engine.engine import Engine, cache_namespace
from servelab.engine.kernels import ISAS, isa_reason
from servelab.request import GenerationRequest, SamplingParams
from servelab.settings import Settings
from tests.engine.conftest import make_config
from tests.engine.naive import naive_greedy
from tests.engine.test_stepping import _request, _run_schedule


# --- the engine through the paged cache ---

BUILDS = [pytest.param(f"servelab-{isa.name}", marks=pytest.mark.skipif(isa_reason(isa) is not None,
                                                                        reason=f"{isa_reason(isa)}"))
          for isa in ISAS]


def _expected(engine: Engine, request: GenerationRequest) -> list[int]:
    return naive_greedy(engine.model, engine.encode(request), request.params.max_new_tokens, engine.eos_token_ids)


@pytest.fixture(scope="module")
def small_pool_engines(tiny_folder: Path, settings: Settings) -> dict[str, Engine]:
    """One tiny engine per runnable kernel build, with blocks of 4 tokens and a pool of 24 blocks (96 tokens): a
    handful of rows fill it, so rows give their blocks back mid-decode and are prefilled again."""
    engines = {}
    for build in ("servelab-avx512", "servelab-avx2"):
        isa = next(i for i in ISAS if build.endswith(i.name))
        if isa_reason(isa) is None:
            engines[build] = Engine.from_config(make_config(
                str(tiny_folder), linear_kernel=build, kv_cache={"block_size": 4},
                batching={"max_batch_tokens": 96, "max_prefill_tokens": 24},
                decoding={"max_new_tokens": 24, "max_context_tokens": 96}), settings)
    return engines


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("schedule_seed", range(3))
def test_paged_rows_joining_and_leaving_in_a_small_pool_decode_like_naive(small_pool_engines, build: str,
                                                                            schedule_seed: int) -> None:
    engine = small_pool_engines[build]
    assert engine.scheduler.pool.num_blocks == 24 and engine.decoder.decode_step_attention is not None
    rng = random.Random(100 + schedule_seed)
    arrivals: dict[int, list[GenerationRequest]] = {}
    for i in range(rng.randint(5, 9)):
        arrivals.setdefault(rng.randint(0, 12), []).append(_request(rng, f"r{i}"))
    engine.take_stats()
    done = _run_schedule(engine, arrivals)
    timings, memory = engine.take_stats()
    for request in (r for group in arrivals.values() for r in group):
        assert list(done[request.request_id].token_ids) == _expected(engine, request), (build, request.request_id)
    assert engine.num_live == 0 and engine.scheduler.pool.num_used_blocks == 0
    assert memory.kv_block_size == 4 and memory.kv_cache_tokens <= 96


def test_the_pool_running_out_mid_decode_gives_a_row_back_and_it_ends_the_same(small_pool_engines) -> None:
    engine = next(iter(small_pool_engines.values()), None)
    if engine is None:
        pytest.skip("no servelab kernel build runs on this CPU")
    requests = [GenerationRequest(f"p{i}", prompt=f"row {i} counts the blue houses on the hill",
                                  params=SamplingParams(max_new_tokens=24)) for i in range(5)]
    engine.take_stats()
    result = engine.generate(requests)
    assert result.timings.num_preempted > 0  # 5 rows x (~12 + 24) tokens do not fit 96 columns at once
    for request, completion in zip(requests, result.completions):
        assert list(completion.token_ids) == _expected(engine, request)


@pytest.fixture(scope="module")
def prefix_engines(tiny_folder: Path, settings: Settings) -> dict[bool, Engine]:
    return {on: Engine.from_config(make_config(str(tiny_folder), kv_cache={"block_size": 4, "prefix_caching": on}),
                                   settings) for on in (False, True)}


SYSTEM = "You answer in one word. Examples: sky is blue, grass is green, snow is white. Now:"


def test_a_prompt_served_from_cached_blocks_gives_the_same_tokens(prefix_engines) -> None:
    on, off = prefix_engines[True], prefix_engines[False]
    on.reset()
    first = GenerationRequest("a", prompt=f"{SYSTEM} the sea is", params=SamplingParams(max_new_tokens=8))
    second = GenerationRequest("b", prompt=f"{SYSTEM} a lemon is", params=SamplingParams(max_new_tokens=8))
    on.take_stats()
    a = on.generate([first]).completions[0]
    result = on.generate([second])
    b = result.completions[0]
    shared = len(on.encode(first)) - next(i for i, (x, y) in enumerate(zip(on.encode(first), on.encode(second)))
                                          if x != y)
    common = len(on.encode(first)) - shared  # tokens the two prompts start with
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == common // 4 * 4 > 0  # full blocks only
    assert result.timings.num_prefix_hit_tokens == b.num_cached_tokens
    assert result.timings.num_prefix_query_tokens == len(on.encode(second))
    for request, completion in ((first, a), (second, b)):
        assert list(completion.token_ids) == _expected(on, request)
        assert completion.token_ids == off.generate([request]).completions[0].token_ids
        assert off.generate([request]).completions[0].num_cached_tokens == 0


@torch.inference_mode()
def test_logits_from_cached_blocks_match_a_whole_prefill_and_an_evicted_block_is_computed_again(prefix_engines) -> None:
    engine = prefix_engines[True]
    engine.reset()
    request = GenerationRequest("x", prompt=f"{SYSTEM} the night is", params=SamplingParams(max_new_tokens=1,
                                                                                             logprobs=5))
    whole = engine.generate([request]).completions[0]
    cached = engine.generate([request]).completions[0]
    assert whole.num_cached_tokens == 0 and cached.num_cached_tokens > 0
    for a, b in zip(whole.logprobs, cached.logprobs):  # fp32: the same prefix keys, a different matmul shape
        assert a.chosen.token_id == b.chosen.token_id and abs(a.chosen.logprob - b.chosen.logprob) < 1e-4
    engine.reset()  # every unreferenced cached block is evicted
    again = engine.generate([request]).completions[0]
    assert again.num_cached_tokens == 0 and again.token_ids == whole.token_ids


def test_an_int8_pool_serves_cached_blocks_holds_its_scales_and_names_int8_in_the_prefix_namespace(
        tiny_folder: Path, settings: Settings, prefix_engines) -> None:
    engine = Engine.from_config(make_config(str(tiny_folder), kv_cache_dtype="int8",
                                            kv_cache={"block_size": 4, "prefix_caching": True}), settings)
    fp32 = prefix_engines[True]
    assert engine.decoder.decode_step_attention is not None  # the fused kernel reads the int8 pool as stored
    request = GenerationRequest("x", prompt=f"{SYSTEM} the night is", params=SamplingParams(max_new_tokens=8))
    whole = engine.generate([request]).completions[0]
    cached = engine.generate([request]).completions[0]
    assert whole.num_cached_tokens == 0 < cached.num_cached_tokens and cached.token_ids == whole.token_ids
    pool = engine.runner.cache(engine.scheduler.pool)
    assert pool.keys[0].dtype == torch.int8 and pool.key_scales[0].shape == pool.keys[0].shape[:3]
    assert pool.allocated_bytes == pool.num_allocated_blocks * pool.block_bytes
    head_dim = engine.loaded.shape.head_dim  # 16 here: a scale (4 bytes) per 16 int8 values
    assert pool.block_bytes * 4 * head_dim == fp32.runner.cache(fp32.scheduler.pool).block_bytes * (head_dim + 4)
    assert engine.kv_bytes_per_element == 1 + 4 / head_dim
    namespaces = {cache_namespace(e.config, e.loaded.dtype) for e in (engine, fp32)}
    assert len(namespaces) == 2 and any("|int8|" in n for n in namespaces)  # int8 blocks are never found by fp32
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' needs servelab's decoder"):
        TransformersDecoder(engine.loaded.model, kv_cache_dtype="int8", dtype=torch.float32)


def test_a_long_prompt_is_prefilled_in_chunks_while_running_rows_decode_every_step(tiny_folder: Path,
                                                                                   settings: Settings) -> None:
    engine = Engine.from_config(make_config(str(tiny_folder), batching={"max_prefill_tokens": 16}), settings)
    running = [GenerationRequest(f"run{i}", prompt=f"row {i} is", params=SamplingParams(max_new_tokens=30))
               for i in range(3)]
    long = GenerationRequest("long", prompt=" ".join(["the quick brown fox jumps over the lazy dog"] * 8),
                             params=SamplingParams(max_new_tokens=5))
    num_long = len(engine.encode(long))
    assert num_long > 4 * 16
    engine.add(running)
    engine.add([long])
    steps_to_first = 0
    first_seen = False
    done = {}
    while engine.num_live:
        out = engine.step()
        made = {rid for rid, _ in out.new_tokens}
        if not first_seen:
            steps_to_first += 1
            # every running row makes its token at every step of the newcomer's prefill
            assert {f"run{i}" for i in range(3)} <= made | set(done)
            first_seen = "long" in made
        done.update((c.request_id, c) for c in out.finished)
    assert steps_to_first >= num_long // 16  # the prompt took several steps, not one
    for request in (*running, long):
        assert list(done[request.request_id].token_ids) == _expected(engine, request)
