"""Window eviction in the paged cache (kv_cache.eviction: window): the block manager's books (middle blocks freed,
cached ones findable, a long cached prompt sharing only its kept blocks), and the engine decoding like a naive
reference that applies the same mask (sinks plus the window behind each token's block, keys at their own
positions), a window wider than the sequence equal to no eviction, and a long row's retained tokens flat."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from servelab.scheduler.blocks import BlockManager
from servelab.engine.engine import Engine
from servelab.engine.kernels import ISAS, isa_reason
from servelab.lab.long_context import evaluate_long_context, long_context_ratio, long_segments
from servelab.request import GenerationRequest, SamplingParams
from servelab.settings import Settings
from tests.engine.conftest import make_config
from tests.engine.naive import naive_window_greedy, window_mask
from tests.engine.test_stepping import _request, _run_schedule

BS, SINK, WINDOW = 4, 1, 2  # blocks of 4 tokens; 4 sink tokens, an 8-token window
TEXT = "the quick brown fox jumps over the lazy dog"


def test_the_window_mask_is_sinks_and_the_blocks_behind_each_tokens_own() -> None:
    mask = window_mask(20, 4, 1, 2)
    assert mask[19].tolist() == [True] * 4 + [False] * 4 + [True] * 12  # block 4 sees block 0 and blocks 2-4
    assert mask[11].tolist() == [True] * 12 + [False] * 8  # block 2 sees everything before it
    assert not mask[3, 4]  # causal


# --- the engine ---

BUILDS = [*(pytest.param(f"servelab-{isa.name}", marks=pytest.mark.skipif(isa_reason(isa) is not None,
                                                                         reason=f"{isa_reason(isa)}"))
            for isa in ISAS), "torch", "flex"]


def _window_config(folder: Path, linear_kernel: str, max_batch_tokens: int = 160, paged_attention: str = "auto", **kv):
    return make_config(str(folder), linear_kernel=linear_kernel, paged_attention=paged_attention,
                       kv_cache={"block_size": BS, "eviction": "window", "sink_tokens": SINK * BS,
                                 "window_tokens": WINDOW * BS, **kv},
                       batching={"max_prefill_tokens": 8, "max_batch_tokens": max_batch_tokens},
                       decoding={"max_new_tokens": 160, "max_context_tokens": 256})


@pytest.fixture(scope="module")
def window_engines(tiny_folder: Path, settings: Settings) -> dict[str, Engine]:
    """One tiny engine per runnable kernel build, one on torch's matmul (the torch decode path) and one reading the pool
    through FlexAttention, its decode-only steps from padded buffers (graphs.py, eager on a CPU): blocks of 4, a
    4-token sink and an 8-token window, prefill chunks of 8 tokens."""
    engines = {}
    for build in ("servelab-avx512", "servelab-avx2", "torch"):
        isa = next((i for i in ISAS if build.endswith(i.name)), None)
        if isa is None or isa_reason(isa) is None:
            engines[build] = Engine.from_config(_window_config(tiny_folder, build), settings)
    engines["flex"] = Engine.from_config(_window_config(tiny_folder, "torch", paged_attention="flex"), settings)
    engines["flex"].runner.graph_rows = 8
    return engines


_NAIVE: dict[tuple, list[int]] = {}  # every engine here serves the same tiny model: each reference is run once


@pytest.fixture(scope="module")
def plain_engine(tiny_folder: Path, settings: Settings) -> Engine:
    return Engine.from_config(make_config(str(tiny_folder), kv_cache={"block_size": BS}), settings)


def _expected(engine: Engine, request: GenerationRequest) -> list[int]:
    key = (tuple(engine.encode(request)), request.params.max_new_tokens)
    if key not in _NAIVE:
        _NAIVE[key] = naive_window_greedy(engine.model, list(key[0]), key[1], engine.eos_token_ids, block_size=BS,
                                          sink_blocks=SINK, window_blocks=WINDOW)
    return _NAIVE[key]


@pytest.mark.parametrize("build", BUILDS)
def test_window_decoding_equals_a_naive_reference_with_the_same_mask(window_engines, plain_engine: Engine,
                                                                     build: str) -> None:
    engine = window_engines[build]
    assert (engine.decoder.decode_step_attention is None) == (build in ("torch", "flex"))
    rng = random.Random(7)
    arrivals: dict[int, list[GenerationRequest]] = {}
    for i in range(4):  # prompts up to 60 tokens: longer than sink + window, prefilled in chunks that evict
        prompt = " ".join([TEXT] * rng.randint(1, 6))
        arrivals.setdefault(rng.randint(0, 10), []).append(
            GenerationRequest(f"w{i}", prompt=prompt, params=SamplingParams(max_new_tokens=rng.randint(16, 30))))
    engine.reset()
    done = _run_schedule(engine, arrivals)
    requests = [r for group in arrivals.values() for r in group]
    for request in requests:
        assert list(done[request.request_id].token_ids) == _expected(engine, request), (build, request.request_id)
    everything = plain_engine.generate(requests).completions  # the same rows keeping every column
    assert sum(c.token_ids != done[c.request_id].token_ids for c in everything) >= 2  # the window changed them
    assert engine.num_live == 0 and engine.scheduler.pool.num_used_blocks == 0
    if build == "flex":  # NOTE: its decode-only steps ran from the padded buffers, rows past each table's start evicted
        assert engine.runner._graphs and next(iter(engine.runner._graphs.values()))._sizes


def test_rows_the_pool_gives_back_mid_decode_are_prefilled_again_under_the_window(tiny_folder: Path,
                                                                                  settings: Settings) -> None:
    # a pool of 10 blocks (the least it may be: sink + window + 2 + a chunk's 2 is 7): short prompts are admitted a
    # block each, then each row grows to 4 blocks
    engine = Engine.from_config(_window_config(tiny_folder, "torch", max_batch_tokens=40, prefix_caching=False),
                                settings)
    assert engine.scheduler.pool.num_blocks == 10
    requests = [GenerationRequest(f"p{i}", prompt=f"row {i} is" if i else " ".join([TEXT] * 3),
                                  params=SamplingParams(max_new_tokens=24)) for i in range(6)]
    result = engine.generate(requests)
    assert result.timings.num_preempted > 0
    for request, completion in zip(requests, result.completions):
        assert list(completion.token_ids) == _expected(engine, request)


def test_a_prompt_served_from_cached_window_blocks_gives_the_same_tokens(window_engines) -> None:
    engine = window_engines["torch"]
    engine.reset()
    request = GenerationRequest("c", prompt=" ".join([TEXT] * 3), params=SamplingParams(max_new_tokens=12))
    first = engine.generate([request]).completions[0]
    second = engine.generate([request]).completions[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    assert list(first.token_ids) == list(second.token_ids) == _expected(engine, request)


def test_a_long_row_holds_no_more_than_its_sinks_and_window(window_engines) -> None:
    engine = window_engines["torch"]
    engine.take_stats()
    engine.add([GenerationRequest("long", prompt=TEXT, params=SamplingParams(max_new_tokens=48, ignore_eos=True))])
    retained, allocated = [], []
    while engine.num_live:
        engine.step()
        _, memory = engine.take_stats()
        retained.append(memory.kv_cache_tokens)
        allocated.append(memory.kv_cache_allocated_bytes)
    bound = (SINK + WINDOW + 1) * BS
    assert max(retained) == bound and len(retained) >= 45  # 48 tokens made, never more than 16 columns held
    assert allocated[-1] == allocated[len(allocated) // 4]  # the pool's tensors stopped growing too


def test_a_window_wider_than_the_sequence_equals_no_eviction(tiny_folder: Path, settings: Settings,
                                                              plain_engine: Engine) -> None:
    plain = plain_engine
    wide = Engine.from_config(make_config(str(tiny_folder), kv_cache={"block_size": BS, "eviction": "window",
                                                                      "sink_tokens": 4, "window_tokens": 256}),
                              settings)
    rng = random.Random(3)
    requests = [_request(rng, f"q{i}", logprobs=2) for i in range(5)]
    a, b = plain.generate(requests), wide.generate(requests)
    for x, y in zip(a.completions, b.completions):
        assert x.token_ids == y.token_ids
        assert [t.chosen.logprob for t in x.logprobs] == [t.chosen.logprob for t in y.logprobs]
    assert a.memory.kv_cache_tokens == b.memory.kv_cache_tokens


# --- scoring under the window: the quality lab's forward ---

@torch.inference_mode()
def test_a_windowed_prefill_gives_the_logits_of_transformers_forward_with_the_window_mask(window_engines) -> None:
    engine = next(iter(window_engines.values()))
    ids = engine.tokenizer.encode(" ".join([TEXT] * 5), add_special_tokens=False)[:40]
    input_ids = torch.tensor([ids])
    positions = torch.arange(len(ids))[None]
    ours = engine.decoder.logits(input_ids, torch.ones_like(input_ids), positions, len(ids),
                                 window=(SINK, WINDOW, BS))[0]
    mask = window_mask(len(ids), BS, SINK, WINDOW)[None, None]
    reference = engine.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False).logits[0]
    assert torch.allclose(ours.float(), reference.float(), atol=2e-4)
    whole = engine.decoder.logits(input_ids, torch.ones_like(input_ids), positions, len(ids))[0]
    assert not torch.allclose(whole[-1], ours[-1], atol=1e-2)  # the window changed the far tokens' logits


def test_long_context_perplexity_is_paired_segment_by_segment(window_engines, plain_engine: Engine) -> None:
    engine = next(iter(window_engines.values()))
    segments = long_segments(engine.tokenizer, length=64, num_segments=4)
    assert len({s.topic for s in segments}) >= 1 and all(len(s.token_ids) == 64 for s in segments)
    windowed = evaluate_long_context(engine, segments, scored_from=32, batch_size=2)
    plain = evaluate_long_context(plain_engine, segments, scored_from=32)
    assert windowed.fingerprint == plain.fingerprint and windowed.num_tokens == (32,) * 4
    assert windowed.nll != plain.nll  # tokens 32-63 lose the context between the sink and their window
    same = long_context_ratio(plain, plain)
    assert same.value == pytest.approx(1.0) and same.low == pytest.approx(1.0)
    ratio = long_context_ratio(plain.as_dict(), windowed.as_dict())
    assert ratio.low <= ratio.value <= ratio.high and ratio.value != pytest.approx(1.0)
    other = evaluate_long_context(plain_engine, long_segments(engine.tokenizer, length=48, num_segments=4),
                                  scored_from=24)
    with pytest.raises(ValueError, match="pair only on the same segments"):
        long_context_ratio(plain, other)
