"""Engines for the engine tests: a tiny randomly initialised Llama (fast) and the real bundled model."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from servelab.config import ServingConfig
from servelab.engine.decoder import PagedBatch
from servelab.engine.engine import Engine
from servelab.engine.kernels import ISAS, isa_reason, load_blocked_kernel
from servelab.engine.loader import resolve_model_folder
from servelab.request import GenerationRequest, SamplingParams
from servelab.settings import Settings

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def settings() -> Settings:
    # NOTE: the converted bundled model is cached in the repo's .cache, shared across test runs.
    return Settings(cache_dir=REPO / ".cache")


def amx_kernel(cache_dir: Path):
    """The AVX-512 build where bf16 runs on AMX tiles, else the test skips with the reason."""
    if isa_reason(ISAS[0]) is not None:
        pytest.skip(isa_reason(ISAS[0]))
    kernel = load_blocked_kernel(cache_dir, "avx512").module
    if kernel.amx_rows() == 0:
        pytest.skip("this CPU (or this build, or the OS) runs no AMX bf16 tiles (amx_tile, amx_bf16)")
    return kernel


@contextlib.contextmanager
def amx_path(kernel, on: bool):
    """bf16 matmuls on AMX tiles from one row (on) or never (off) inside the block; the threshold restored after.
    A build without AMX ignores it."""
    old = kernel.amx_rows(1 if on else 1 << 30)
    try:
        yield
    finally:
        kernel.amx_rows(old)


def with_built_kernels(cache_dir: Path) -> Path:
    """cache_dir with the suite's compiled kernels linked in (REPO/.cache's builds, this CPU's best built there
    first): a test that needs a cache of its own (its measured choices, its quantised checkpoints) reads the
    same build instead of compiling its own, about 50 s each."""
    shared = REPO / ".cache" / "kernels"
    load_blocked_kernel(REPO / ".cache")
    (cache_dir / "kernels").mkdir(parents=True, exist_ok=True)
    for built in shared.iterdir() if shared.is_dir() else ():
        link = cache_dir / "kernels" / built.name
        if built.is_dir() and built.name != "choices" and not link.exists():
            link.symlink_to(built, target_is_directory=True)
    return cache_dir


@pytest.fixture(scope="session")
def bundled_folder(settings: Settings) -> str:
    return resolve_model_folder("bundled:smollm2-135m-instruct", settings)


def save_tiny_llama(folder: Path, tokenizer_folder: str, *, hidden_size: int = 64,
                    intermediate_size: int = 128, tie_word_embeddings: bool = True) -> Path:
    """A 2-layer Llama with random weights and the bundled tokenizer (its 49,152-token vocabulary); its 2,048
    positions take a config's default max_context_tokens."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        initializer_range=0.2,  # NOTE: spread-out logits, so greedy picks are not float-noise ties
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie_word_embeddings,
    )
    return save_random_model(folder, LlamaForCausalLM, config, tokenizer)


def save_random_model(folder: Path, model_class, config, tokenizer) -> Path:
    """A model of this class and config with seeded random weights, saved with the tokenizer's files."""
    torch.manual_seed(0)
    model_class(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, bundled_folder: str) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), bundled_folder)


def save_tiny_gpt2(folder: Path, tokenizer_folder: str) -> Path:
    """A 2-layer GPT-2 with random weights and the bundled tokenizer: an architecture servelab's decoder does not
    cover, so transformers' forward serves it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=512,
                        initializer_range=0.2, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return save_random_model(folder, GPT2LMHeadModel, config, tokenizer)


@pytest.fixture(scope="session")
def tiny_gpt2_folder(tmp_path_factory, bundled_folder: str) -> Path:
    return save_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2"), bundled_folder)


def make_config(model: str, **overrides) -> ServingConfig:
    data = {"name": "test", "model": model, "weights": "fp32", "device": "cpu",
            "decoding": {"max_new_tokens": 64, "max_context_tokens": 256}}
    return ServingConfig.from_dict({**data, **overrides})


@pytest.fixture(scope="session")
def tiny_engine(tiny_folder: Path, settings: Settings) -> Engine:
    return Engine.from_config(make_config(str(tiny_folder)), settings)


@pytest.fixture(scope="session")
def bundled_engine(settings: Settings) -> Engine:
    return Engine.from_config(make_config("bundled:smollm2-135m-instruct"), settings)


@pytest.fixture(scope="session")
def tiny_transformers_engine(tiny_folder: Path, settings: Settings) -> Engine:
    """The same tiny model served through transformers' forward and dynamic cache."""
    return Engine.from_config(make_config(str(tiny_folder), decoder="transformers"), settings)


@pytest.fixture(params=["servelab", "transformers"])
def either_engine(request, tiny_engine: Engine, tiny_transformers_engine: Engine) -> Engine:
    """Each decoder in turn: both must serve identically."""
    return tiny_engine if request.param == "servelab" else tiny_transformers_engine


def _decode_steps(engine: Engine, prompts: list[str], team: bool | None, num_threads: int):
    """Three decode steps of these prompts through the decoder's DecodeStack (team on or off) or its Python loop
    (team None), at this thread count -> (each step's logits, the cache after them, steps the stack ran as a team)."""
    decoder = engine.decoder
    torch.set_num_threads(num_threads)
    decoder._stack = None if team is not None else False  # None: built on first use; False: the Python loop
    if team is not None:
        decoder._decode_stack().team = team
    before = decoder._stack.team_steps if team is not None else 0
    engine.reset()  # NOTE: every run starts from an empty pool, so each writes the same blocks
    engine.add([GenerationRequest(f"r{i}", prompt=p, params=SamplingParams(max_new_tokens=6))
                for i, p in enumerate(prompts)])
    pool = engine.scheduler.pool
    cache = engine.runner.cache(pool)
    steps = []
    for _ in range(3):
        rows = engine.scheduler.running
        for row in rows:
            pool.grow(row, row.num_computed_tokens + 1)
        tables = [r.block_table for r in rows]
        cache.reach(tables)
        batch = PagedBatch(torch.tensor([r.token_ids[-1] for r in rows]),
                           torch.tensor([r.num_computed_tokens for r in rows]),
                           cache.table_tensor(tables), len(rows), (), torch.arange(len(rows)))
        steps.append(decoder.forward_paged(batch, cache))
        for row, token in zip(rows, steps[-1].argmax(-1).tolist()):
            row.token_ids.append(token)
            row.num_computed_tokens += 1
    keys = [k.clone() for k in (*cache.keys, *cache.key_scales, *cache.value_scales)]
    team_steps = decoder._stack.team_steps - before if team is not None else 0
    engine.cancel(engine.live_request_ids)
    engine.reset()  # NOTE: every run prefills whole too, into the same blocks
    return steps, keys, team_steps


def assert_stack_equals_the_layer_loop(engine: Engine, prompts: list[str], *, team_serves: bool) -> None:
    """The decoder's one-call decode step (DecodeStack) gives the logits and the cache of its Python loop to the bit,
    over three rows (the team splits the rows' norms) and two (each thread repeats them for itself): as one parallel
    region (its team; team_serves: the stack takes these rows as one) at 1, 2 and 3 threads, and with a region per
    kernel. The kernels' grain is 0 meanwhile, so every kernel splits its work over the threads it has."""
    module = engine.decoder.kernel.blocked.module
    threads, grain = torch.get_num_threads(), module.thread_grain(0)
    runs = [(None, 1), (True, 1), (True, 2), (True, 3), (False, 2)]
    try:
        for rows in (prompts[:3], prompts[:2]):
            (first, first_keys, _), *others = [_decode_steps(engine, rows, team, n) for team, n in runs]
            for (steps, keys, team_steps), run in zip(others, runs[1:]):
                assert team_steps == (3 if run[0] and team_serves else 0), (len(rows), run, team_steps)
                for a, b in zip([*steps, *keys], [*first, *first_keys]):
                    torch.testing.assert_close(a, b, atol=0, rtol=0, msg=lambda m: f"{len(rows)} rows, {run}: {m}")
    finally:
        module.thread_grain(grain)
        torch.set_num_threads(threads)


class _CountingStack:
    """A DecodeStack that counts the steps with prompt chunks it ran in one call."""

    def __init__(self, stack) -> None:
        self.stack, self.mixed_steps = stack, 0

    def mixed(self, *args, **kwargs):
        self.mixed_steps += 1
        return self.stack.mixed(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.stack, name)


def _prompt_steps(engine: Engine, prompts: list[str], stack: bool, num_threads: int):
    """The first prompt prefills and decodes; the others join while it decodes, their prompts in chunks beside its
    decode rows (the engine's max_prefill_tokens is small), through every layer in one call (stack) or the decoder's
    Python loop -> (each forward's (decode rows, chunks, logits), the cache after them, the steps the stack ran)."""
    decoder = engine.decoder
    torch.set_num_threads(num_threads)
    decoder._stack = None if stack else False  # None: built on first use; False: the Python loop
    counting = None
    if stack:
        assert decoder._decode_stack() is not None, "the stack serves this engine"
        decoder._stack = counting = _CountingStack(decoder._stack)
    forward, steps = decoder.forward_paged, []

    def recording(batch, cache):
        logits = forward(batch, cache)
        steps.append((batch.num_decode, len(batch.chunks), logits.clone()))
        return logits

    decoder.forward_paged = recording
    engine.reset()  # NOTE: every run starts from an empty pool, so each writes the same blocks
    try:
        engine.add([GenerationRequest("r0", prompt=prompts[0], params=SamplingParams(max_new_tokens=12))])
        for _ in range(3):
            engine.step()
        engine.add([GenerationRequest(f"r{i}", prompt=p, params=SamplingParams(max_new_tokens=3))
                    for i, p in enumerate(prompts[1:], start=1)])
        while engine.num_live:
            engine.step()
    finally:
        del decoder.forward_paged  # NOTE: the class's method again
        decoder._stack = None
    cache = engine.runner.cache(engine.scheduler.pool)
    kept = [t.clone() for t in (*cache.keys, *cache.values, *cache.key_scales, *cache.value_scales)]
    engine.reset()  # NOTE: every run prefills whole too, into the same blocks
    return steps, kept, counting.mixed_steps if counting else 0


def assert_prompt_steps_equal_the_layer_loop(engine: Engine, prompts: list[str]) -> None:
    """Steps with prompt chunks (alone, beside decode rows, two in one step) through every layer in one call
    (DecodeStack.mixed) give the decoder's Python loop's logits and cache to the bit, at 1, 2 and 3 threads, every
    kernel splitting its work over the threads it has (grain 0)."""
    module = engine.decoder.kernel.blocked.module
    threads, grain = torch.get_num_threads(), module.thread_grain(0)
    try:
        reference, reference_cache, _ = _prompt_steps(engine, prompts, False, 1)
        kinds = {(decode > 0, chunks) for decode, chunks, _ in reference}
        assert {(False, 1), (True, 1), (True, 2)} <= kinds, f"the steps ran no such mix: {sorted(kinds)}"
        for n in (1, 2, 3):
            steps, cache, mixed_steps = _prompt_steps(engine, prompts, True, n)
            assert mixed_steps == sum(chunks > 0 for _, chunks, _ in reference), (n, mixed_steps)
            assert [s[:2] for s in steps] == [s[:2] for s in reference]
            for a, b in zip([s[2] for s in steps] + cache, [s[2] for s in reference] + reference_cache):
                torch.testing.assert_close(a, b, atol=0, rtol=0, msg=lambda m: f"{n} thread(s): {m}")
    finally:
        module.thread_grain(grain)
        torch.set_num_threads(threads)
