"""The engine against the naive reference, and its batch behaviour: padding, retirement, limits."""

from __future__ import annotations

import random

import pytest
import torch

from servelab.engine.engine import Engine
from servelab.engine.measure import tensor_storage_bytes, weight_bytes
from servelab.outputs import FinishReason
from servelab.request import ChatMessage, GenerationRequest, SamplingParams
from tests.engine.naive import naive_greedy



def _random_prompt(rng: random.Random, length: int) -> str:
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "river", "blue", "seven", "quickly", "house"]
    return " ".join(rng.choice(words) for _ in range(length))


def _greedy(prompt: str, max_new_tokens: int, request_id: str | None = None, **params) -> GenerationRequest:
    return GenerationRequest(request_id or prompt, prompt=prompt,
                             params=SamplingParams(max_new_tokens=max_new_tokens, **params))


def test_the_tiny_llama_is_served_by_servelabs_decoder(tiny_engine: Engine, tiny_transformers_engine: Engine) -> None:
    assert tiny_engine.decoder.name == "servelab" and tiny_engine.kernel.startswith("servelab decoder")
    assert tiny_transformers_engine.decoder.name == "transformers"


@pytest.mark.parametrize("mix_seed", range(12))
def test_batched_cached_decoding_equals_naive_uncached(either_engine: Engine, mix_seed: int) -> None:
    rng = random.Random(mix_seed)
    batch_size = rng.choice([1, 2, 3, 5, 8])
    requests = [
        _greedy(_random_prompt(rng, rng.randint(1, 40)), rng.randint(1, 24), request_id=f"r{i}")
        for i in range(batch_size)
    ]
    result = either_engine.generate(requests)
    for request, completion in zip(requests, result.completions):
        prompt_ids = either_engine.encode(request)
        # NOTE: the reference is transformers' forward without cache or padding, never servelab's decoder.
        expected = naive_greedy(either_engine.model, prompt_ids, request.params.max_new_tokens,
                                either_engine.eos_token_ids)
        assert list(completion.token_ids) == expected, (request.prompt, completion.token_ids, expected)
        assert completion.num_prompt_tokens == len(prompt_ids)


def test_finished_rows_leave_the_batch(tiny_engine: Engine) -> None:
    requests = [_greedy("the cat sat", 2, "short"), _greedy("a river of seven blue houses", 9, "long")]
    result = tiny_engine.generate(requests)
    assert result.timings.num_rows_per_step == (2, 2, 1, 1, 1, 1, 1, 1, 1)
    assert result.timings.num_decode_tokens == sum(result.timings.num_rows_per_step[1:])
    alone = tiny_engine.generate([requests[1]]).completions[0]
    assert result.completions[1].token_ids == alone.token_ids  # a batch-mate leaving changes nothing


def _allocated_bytes(engine: Engine, num_retained: int) -> int:
    """What the cache tensors hold: servelab's paged pool reaches as far as the highest block handed out (grown
    by half again); transformers' cache grows to what is retained."""
    if engine.scheduler.pool is not None:
        return engine.runner.cache(engine.scheduler.pool).num_allocated_blocks * engine.runner.cache(engine.scheduler.pool).block_bytes
    return engine.loaded.shape.kv_cache_bytes(num_retained, engine.kv_bytes_per_element)


def _held(engine: Engine, num_tokens: int) -> int:
    """Columns a row of num_tokens holds: whole blocks in servelab's paged cache, the tokens in transformers'."""
    bs = engine.scheduler.pool.block_size if engine.scheduler.pool is not None else 1
    return -(-num_tokens // bs) * bs


def test_kv_cache_bytes_double_with_retained_tokens(either_engine: Engine) -> None:
    short_prompt = " ".join(["cat"] * 20)
    long_prompt = " ".join(["cat"] * 40)
    short, long = (either_engine.generate([_greedy(p, 1)]).memory for p in (short_prompt, long_prompt))
    num_short = len(either_engine.encode(_greedy(short_prompt, 1)))
    assert len(either_engine.encode(_greedy(long_prompt, 1))) == 2 * num_short
    shape = either_engine.loaded.shape
    held_short, held_long = _held(either_engine, num_short), _held(either_engine, 2 * num_short)
    assert short.kv_cache_bytes == shape.kv_cache_bytes(held_short, 4) == 2 * 2 * 2 * 16 * 4 * held_short
    assert long.kv_cache_bytes == shape.kv_cache_bytes(held_long, 4) and held_long >= 2 * num_short
    for memory, num_prompt in ((short, num_short), (long, 2 * num_short)):  # the formula matches real tensors
        assert memory.kv_cache_allocated_bytes >= memory.kv_cache_bytes
        if either_engine.scheduler.pool is None:
            assert memory.kv_cache_allocated_bytes == _allocated_bytes(either_engine, num_prompt)
    if either_engine.scheduler.pool is not None:
        assert long.kv_cache_allocated_bytes <= _allocated_bytes(either_engine, 0)


def test_kv_cache_counts_padding_where_the_cache_holds_it(either_engine: Engine) -> None:
    requests = [_greedy("cat " * 30, 1, "a"), _greedy("cat", 1, "b")]
    memory = either_engine.generate(requests).memory
    width, short = (len(either_engine.encode(r)) for r in requests)
    shape = either_engine.loaded.shape
    # NOTE: servelab's blocks hold each row's own tokens; transformers' cache holds the short row left-padded
    retained = _held(either_engine, width) + _held(either_engine, short) if either_engine.scheduler.pool else 2 * width
    assert memory.kv_cache_tokens == retained
    assert memory.kv_cache_bytes == shape.kv_cache_bytes(retained, 4)
    if either_engine.scheduler.pool is None:
        assert memory.kv_cache_allocated_bytes == _allocated_bytes(either_engine, 2 * width)
    else:
        assert memory.kv_cache_bytes <= memory.kv_cache_allocated_bytes <= _allocated_bytes(either_engine, 0)


def test_weight_bytes_are_the_one_copy_the_process_holds(tiny_engine: Engine) -> None:
    """A serving engine keeps one copy of its weights: the decoder's layouts. transformers' model keeps only
    what the decoder reads in place, and weight_bytes counts each storage once."""
    decoder = tiny_engine.decoder.tensors()
    held = {t.untyped_storage().data_ptr() for t in decoder if t.layout == torch.strided}
    remaining = [t for t in (*tiny_engine.loaded.model.parameters(), *tiny_engine.loaded.model.buffers()) if t.numel()]
    assert tiny_engine.released_bytes > 0
    assert all(t.untyped_storage().data_ptr() in held for t in remaining), "a second copy was kept"
    assert tiny_engine.weight_bytes == tensor_storage_bytes(decoder + remaining)
    reference = tiny_engine.model  # transformers' forward needs the weights: a fresh copy, loaded for it
    assert reference is not tiny_engine.loaded.model
    assert reference.lm_head.weight.data_ptr() == reference.model.embed_tokens.weight.data_ptr()  # tied
    # one layout per weight, whichever kernels 'auto' measured fastest here; the tied table once
    assert 0.99 * weight_bytes(reference) <= tiny_engine.weight_bytes <= 1.05 * weight_bytes(reference)


def test_seeded_sampling_is_reproducible_and_seeds_differ(tiny_engine: Engine) -> None:
    def sample(seed: int, request_id: str) -> tuple[int, ...]:
        return _greedy("the cat sat on", 20, request_id, temperature=1.0, top_p=0.95, top_k=50, seed=seed)

    first = tiny_engine.generate([sample(1, "a"), sample(2, "b")]).completions
    again = tiny_engine.generate([sample(1, "a"), _greedy("house", 5, "mate")]).completions
    assert first[0].token_ids == again[0].token_ids  # same seed, other batch-mates: same tokens
    assert first[0].token_ids != first[1].token_ids
    assert first[0].seed == 1


def test_unseeded_sampling_reports_the_seed_it_used(tiny_engine: Engine) -> None:
    completion = tiny_engine.generate([_greedy("the cat", 10, "x", temperature=0.7)]).completions[0]
    assert completion.seed is not None
    replay = tiny_engine.generate([_greedy("the cat", 10, "x", temperature=0.7, seed=completion.seed)])
    assert replay.completions[0].token_ids == completion.token_ids


def test_top_k_one_is_greedy(tiny_engine: Engine) -> None:
    greedy = tiny_engine.generate([_greedy("blue river", 12, "g")]).completions[0]
    top1 = tiny_engine.generate([_greedy("blue river", 12, "s", temperature=1.5, top_k=1, seed=3)]).completions[0]
    assert top1.token_ids == greedy.token_ids


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (GenerationRequest("empty", prompt="", params=SamplingParams(max_new_tokens=4)), "prompt is empty"),
        (GenerationRequest("long", prompt="cat " * 300, params=SamplingParams(max_new_tokens=4)), "max_context_tokens 256"),
        (GenerationRequest("zero", prompt="cat", params=SamplingParams(max_new_tokens=0)), "max_new_tokens must be between 1 and 64"),
        (GenerationRequest("huge", prompt="cat", params=SamplingParams(max_new_tokens=65)), "max_new_tokens must be between 1 and 64"),
        (GenerationRequest("temp", prompt="cat", params=SamplingParams(temperature=-1)), "temperature"),
        (GenerationRequest("topp", prompt="cat", params=SamplingParams(top_p=0.0)), "top_p"),
        (GenerationRequest("chat", messages=(), params=SamplingParams()), "messages is empty"),
    ],
)
def test_bad_request_fails_alone(tiny_engine: Engine, request_: GenerationRequest, message: str) -> None:
    good = _greedy("the cat sat", 5, "good")
    result = tiny_engine.generate([good, request_])
    bad_completion = result.completions[1]
    assert bad_completion.finish_reason is FinishReason.ERROR
    assert message in bad_completion.error
    assert result.completions[0].finish_reason is FinishReason.LENGTH
    assert len(result.completions[0].token_ids) == 5


def test_a_batch_of_only_bad_requests_returns_errors(tiny_engine: Engine) -> None:
    result = tiny_engine.generate([GenerationRequest("e", prompt="", params=SamplingParams())])
    assert result.completions[0].finish_reason is FinishReason.ERROR
    assert result.timings.num_rows_per_step == ()


def test_stop_string_ends_the_row_and_cuts_the_text(tiny_engine: Engine) -> None:
    free = tiny_engine.generate([_greedy("seven blue", 20, "free")]).completions[0]
    assert len(free.text) > 6, free.text
    stop = free.text[3:6]
    cut = tiny_engine.generate([_greedy("seven blue", 20, "cut", stop=(stop,))]).completions[0]
    assert cut.finish_reason is FinishReason.STOP
    assert cut.text == free.text[: free.text.find(stop)]
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]


def test_eos_ends_the_row_with_stop(tiny_engine: Engine) -> None:
    free = tiny_engine.generate([_greedy("house", 8, "free")]).completions[0]
    eos_ids = tiny_engine.eos_token_ids
    tiny_engine.eos_token_ids = {free.token_ids[3]}
    try:
        stopped = tiny_engine.generate([_greedy("house", 8, "eos")]).completions[0]
    finally:
        tiny_engine.eos_token_ids = eos_ids
    first_hit = free.token_ids.index(free.token_ids[3])
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == free.token_ids[: first_hit + 1]


def test_timings_are_ordered_per_request(tiny_engine: Engine) -> None:
    result = tiny_engine.generate([_greedy("the cat", 6, "a"), _greedy("a mat", 3, "b")])
    for completion in result.completions:
        times = completion.token_times_ms
        assert 0 < completion.ttft_ms == times[0] <= times[-1] == completion.e2e_ms
        assert all(b >= a for a, b in zip(times, times[1:]))
        assert len(completion.itl_ms) == len(times) - 1
    assert result.timings.prefill_ms > 0 and result.timings.decode_ms > 0


@pytest.mark.slow
def test_bundled_model_batched_equals_naive(bundled_engine: Engine) -> None:
    prompts = ["The capital of France is", "Water boils at", "def fibonacci(n):", "One, two, three,"]
    result = bundled_engine.generate([_greedy(p, 10) for p in prompts])
    for prompt, completion in zip(prompts, result.completions):
        prompt_ids = bundled_engine.encode(_greedy(prompt, 10))
        expected = naive_greedy(bundled_engine.model, prompt_ids, 10, bundled_engine.eos_token_ids)
        assert list(completion.token_ids) == expected, prompt


@pytest.mark.slow
def test_bundled_model_answers_in_sensible_english(bundled_engine: Engine) -> None:
    chat = GenerationRequest("chat", messages=(ChatMessage("user", "What is the capital of France?"),),
                             params=SamplingParams(max_new_tokens=30))
    completion = bundled_engine.generate([chat, _greedy("The capital of France is", 4)]).completions
    assert "Paris" in completion[0].text
    assert completion[0].finish_reason is FinishReason.STOP  # it ends its answer with EOS
    assert completion[1].text.strip().startswith("Paris")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_on_cuda_matches_naive(tiny_folder, settings) -> None:
    from tests.engine.conftest import make_config

    engine = Engine.from_config(make_config(str(tiny_folder), device="cuda"), settings)
    requests = [_greedy("the cat sat on the mat", 8, "a"), _greedy("blue", 8, "b")]
    result = engine.generate(requests)
    assert result.memory.device.startswith("cuda")
    for request, completion in zip(requests, result.completions):
        expected = naive_greedy(engine.model, engine.encode(request), 8, engine.eos_token_ids)
        assert list(completion.token_ids) == expected


def test_a_narrower_kv_cache_halves_its_bytes_and_still_decodes(tiny_engine: Engine, tiny_folder, settings) -> None:
    from tests.engine.conftest import make_config

    engine = Engine.from_config(make_config(str(tiny_folder), kv_cache_dtype="bf16"), settings)
    requests = [_greedy("the cat sat on the mat " * 3, 6, "a"), _greedy("blue", 12, "b")]
    result = engine.generate(requests)
    full = tiny_engine.generate(requests).memory  # the same batch with the fp32 cache
    assert engine.kv_bytes_per_element == 2 and tiny_engine.kv_bytes_per_element == 4
    assert result.memory.kv_cache_bytes * 2 == full.kv_cache_bytes
    # NOTE: bf16 tensors really stored: 2 bytes per element
    assert engine.runner.cache(engine.scheduler.pool).keys[0].dtype == torch.bfloat16
    assert result.memory.kv_cache_allocated_bytes == engine.runner.cache(engine.scheduler.pool).num_allocated_blocks * engine.runner.cache(engine.scheduler.pool).block_bytes
    assert [c.num_generated_tokens for c in result.completions] == [6, 12]  # rows retire as with fp32
    assert result.timings.num_rows_per_step[-1] == 1


@pytest.mark.slow
def test_weight_bytes_are_what_a_serving_process_holds_in_resident_memory(settings) -> None:
    """The lab's weight figure is what loading the bundled fp32 model adds to a fresh process's resident memory (one
    copy: transformers' emptied, the checkpoint's file pages let go), and serving 16 rows peaks within weights, KV
    cache and working memory plus a quarter."""
    import json
    import subprocess
    import sys

    from tests.engine.conftest import REPO

    run = subprocess.run([sys.executable, "-m", "tests.engine.resident_memory", "configs/fp32.yaml",
                          str(settings.cache_dir)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert 0.9 * seen["weights"] <= seen["growth"] <= 1.1 * seen["weights"] + (32 << 20), seen
    assert seen["peak"] <= 1.25 * (seen["weights"] + seen["kv"] + seen["working"]), seen
