"""servelab's decoder on each model family it covers (families.py): Llama with every rope type Llama 2/3 use, Mistral
(a sliding window shorter than the prompts), Qwen2, Qwen3, Phi-3, Gemma 2 and Gemma 3 (alternating sliding-window
layers, soft caps), each a tiny random model made from transformers' own config class, served through the paged
cache (rows joining and leaving, prompts in chunks, a prefix from cached blocks, int8 blocks, window eviction) and each
kernel (fp32, bf16, AWQ int4, an int8 output layer) against naive greedy decoding with transformers' forward; and
what is refused, by name.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import (AutoTokenizer, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM,
                          Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from servelab.config import ServingConfig
from servelab.engine.decoder import LlamaDecoder, build_decoder
from servelab.engine.engine import Engine
from servelab.engine.families import layer_windows, rope_positions, unsupported_reason
from servelab.engine.kernels import ISAS, isa_reason, load_blocked_kernel
from servelab.request import GenerationRequest, SamplingParams
from servelab.settings import Settings
from tests.engine.conftest import make_config, with_built_kernels
from tests.engine.naive import naive_decode, naive_greedy, naive_window_greedy
from tests.engine.test_stepping import _run_schedule

BS, SINK, WINDOW = 4, 1, 2  # blocks of 4 tokens; window eviction keeps 1 sink block and the 2 behind each token's
SLIDING = 8  # the sliding-window layers' tokens: shorter than most prompts here
TEXT = "the quick brown fox jumps over the lazy dog"
ROPE_THETA = {"rope_theta": 10000.0}
MODELS = {  # name: (config class, model class, what differs from the common tiny shape)
    "llama-linear": (LlamaConfig, LlamaForCausalLM, {"rope_parameters": {**ROPE_THETA, "rope_type": "linear",
                                                                         "factor": 2.0}}),
    "llama-llama3": (LlamaConfig, LlamaForCausalLM, {"rope_parameters": {
        **ROPE_THETA, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "llama-yarn": (LlamaConfig, LlamaForCausalLM, {"rope_parameters": {**ROPE_THETA, "rope_type": "yarn", "factor": 4.0,
                                                                       "original_max_position_embeddings": 128}}),
    "llama-dynamic": (LlamaConfig, LlamaForCausalLM, {"rope_parameters": {**ROPE_THETA, "rope_type": "dynamic",
                                                                          "factor": 2.0}}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": SLIDING}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "phi3": (Phi3Config, Phi3ForCausalLM, {}),
    # NOTE: Gemma 2's layers alternate sliding, full; soft caps that bite (scores and logits reach past them), an
    # attention scale other than head_dim's
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {"head_dim": 16, "sliding_window": SLIDING, "query_pre_attn_scalar": 24,
                                                 "attn_logit_softcapping": 2.0, "final_logit_softcapping": 8.0}),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {
        "head_dim": 16, "sliding_window": SLIDING, "query_pre_attn_scalar": 24, "final_logit_softcapping": 8.0,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0}}}),
}
# NOTE: the rope types differ from Llama only in the rotary tables, and Mistral's block is Llama's (families.py): the
# cache features and kernels run on one of them and on each block that differs
BLOCKS = ["llama-llama3", "qwen2", "qwen3", "phi3"]
GEMMAS = ["gemma2", "gemma3"]
PROMPTS = ["The capital of France is", "A man is sitting on a roof. He", " ".join([TEXT] * 3)]
LOGPROB_ATOL = 1e-4  # fp32: the same products in another order
LOGIT_ATOL = 1e-4
INT8_LOGPROB_ATOL = 0.2  # an int8 pool against its own fp32 run, first tokens
INT4_LOGPROB_ATOL = 0.25  # the same int4 kernel on both sides, bf16 activations (2^-8 of logits near 20)


def _kernel() -> str:
    """The first servelab build this CPU runs (its fused attention kernels serve), else torch's matmul."""
    return next((f"servelab-{isa.name}" for isa in ISAS if isa_reason(isa) is None), "torch")


def save_tiny_family(folder: Path, tokenizer_folder: str, name: str) -> Path:
    """A 2-layer model of the family with random weights (biases and norm weights too, so that a dropped bias or norm
    shows) and the bundled tokenizer."""
    config_class, model_class, extra = MODELS[name]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    config = config_class(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True, **extra)
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif "norm" in param_name:
                param.normal_(1.0, 0.3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def family_folders(tmp_path_factory, bundled_folder: str) -> dict[str, Path]:
    return {name: save_tiny_family(tmp_path_factory.mktemp(name), bundled_folder, name) for name in MODELS}


def _config(folder: Path, **overrides) -> ServingConfig:
    """Blocks of 4 and at most 8 tokens a step: every prompt here is prefilled in chunks, beside decode rows."""
    return make_config(str(folder), linear_kernel=_kernel(), kv_cache={"block_size": BS, **overrides.pop("kv", {})},
                       batching={"max_prefill_tokens": 8}, **overrides)


_ENGINES: dict[tuple, Engine] = {}


def _engine(folders: dict[str, Path], settings: Settings, name: str, **overrides) -> Engine:
    key = (name, repr(sorted(overrides.items())))
    if key not in _ENGINES:
        _ENGINES[key] = Engine.from_config(_config(folders[name], **overrides), settings)
    return _ENGINES[key]


def _greedy(request_id: str, prompt: str, max_new_tokens: int, **params) -> GenerationRequest:
    return GenerationRequest(request_id, prompt=prompt, params=SamplingParams(max_new_tokens=max_new_tokens, **params))


@pytest.mark.parametrize("name", list(MODELS))
def test_each_family_decodes_like_naive_greedy_with_rows_joining_and_leaving(family_folders, settings: Settings,
                                                                             name: str) -> None:
    engine = _engine(family_folders, settings, name)
    assert isinstance(engine.decoder, LlamaDecoder) and engine.decoder.name == "servelab"
    assert engine.kernel.startswith("servelab decoder")
    engine.reset()
    arrivals = {0: [_greedy("r0", PROMPTS[2], 10, logprobs=1)],  # prefilled in 4 chunks, then decoding
                3: [_greedy("r1", PROMPTS[0], 3, logprobs=1), _greedy("r2", PROMPTS[1], 7, logprobs=1)]}
    done = _run_schedule(engine, arrivals)
    for request in (r for group in arrivals.values() for r in group):
        expected = naive_decode(engine.model, engine.encode(request), request.params.max_new_tokens,
                                engine.eos_token_ids)
        completion = done[request.request_id]
        assert list(completion.token_ids) == [t for t, _ in expected], (name, request.request_id)
        got = torch.tensor([lp.chosen.logprob for lp in completion.logprobs])
        want = torch.stack([logprobs[t] for t, logprobs in expected])
        torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0)
    # a prompt whose first blocks are cached: only its tail is computed, and the tokens are the same
    again = engine.generate([_greedy("again", PROMPTS[2] + " and more", 5)]).completions[0]
    assert again.num_cached_tokens >= 2 * BS
    assert list(again.token_ids) == naive_greedy(engine.model, engine.encode(_greedy("x", PROMPTS[2] + " and more", 5)),
                                                 5, engine.eos_token_ids)


def test_the_fused_kernels_serve_where_they_compute_what_the_family_needs(family_folders, settings: Settings) -> None:
    """The one-call decode step (DecodeStack) knows no bias, no q/k norm, no sliding window and none of Gemma's
    differences: off for Mistral with its short window, Qwen2, Qwen3 and Gemma, on for the others; the per-layer fused
    attention steps take every layer but the sliding-window and soft-capped ones (Qwen3's and Gemma 3's q/k norm
    applied before them)."""
    if load_blocked_kernel(settings.cache_dir).module is None:
        pytest.skip("this CPU runs no servelab build")
    torch_layers = {"mistral": [False, False], "gemma2": [False, False], "gemma3": [False, True]}  # fused or not
    for name in ("mistral", *BLOCKS, *GEMMAS):
        decoder = _engine(family_folders, settings, name).decoder
        assert decoder.decode_step_attention is not None, name
        assert (decoder._decode_stack() is None) == (name in ("mistral", "qwen2", "qwen3", *GEMMAS)), name
        assert (decoder.layers[0].q_norm is not None) == (name in ("qwen3", "gemma3"))
        assert [layer.fused for layer in decoder.layers] == torch_layers.get(name, [True, True]), name


@pytest.mark.parametrize("name", [*BLOCKS, "gemma3"])  # NOTE: Gemma 3 reads int8 blocks in torch's and the fused path
def test_an_int8_pool_stays_near_its_own_fp32_run(family_folders, settings: Settings, name: str) -> None:
    fp32, int8 = _engine(family_folders, settings, name), _engine(family_folders, settings, name, kv_cache_dtype="int8")
    requests = [_greedy(f"q{i}", p, 4, logprobs=1) for i, p in enumerate(PROMPTS)]
    for engine in (fp32, int8):
        engine.reset()
    want, got = (e.generate(requests).completions for e in (fp32, int8))
    assert int8.runner.cache(int8.scheduler.pool).keys[0].dtype == torch.int8
    assert fp32.runner.cache(fp32.scheduler.pool).keys[0].dtype == torch.float32  # auto: the fp32 weights' dtype
    moved = [abs(a.logprobs[0].chosen.logprob - b.logprobs[0].chosen.logprob) for a, b in zip(want, got)]
    # NOTE: the first token reads every prompt column back from int8 blocks: int8's rounding (half of 1/127 of each
    # head's largest value) moves its log-probability, far less than the spread of this model's logits (several nats)
    assert 0 < max(moved) < INT8_LOGPROB_ATOL, (name, moved)
    assert [a.token_ids[0] for a in want] == [b.token_ids[0] for b in got], name


@pytest.mark.parametrize("name", [*BLOCKS, "gemma2"])  # NOTE: the eviction window and Gemma 2's token window together
def test_window_eviction_decodes_like_a_naive_reference_with_the_same_mask(family_folders, settings: Settings,
                                                                          name: str) -> None:
    engine = _engine(family_folders, settings, name,
                     kv={"eviction": "window", "sink_tokens": SINK * BS, "window_tokens": WINDOW * BS})
    engine.reset()
    request = _greedy("w", PROMPTS[2] + " " + TEXT, 12)  # longer than sink + window: its middle blocks leave
    completion = engine.generate([request]).completions[0]
    assert list(completion.token_ids) == naive_window_greedy(engine.model, engine.encode(request), 12,
                                                             engine.eos_token_ids, block_size=BS, sink_blocks=SINK,
                                                             window_blocks=WINDOW)


@pytest.mark.parametrize("name", BLOCKS[1:] + GEMMAS)  # NOTE: Gemma's norms scale in fp32 and cast after
def test_bf16_weights_follow_transformers_in_bf16(family_folders, settings: Settings, name: str) -> None:
    engine = _engine(family_folders, settings, name, weights="bf16")
    assert isinstance(engine.decoder, LlamaDecoder) and engine.decoder.dtype == torch.bfloat16
    engine.reset()
    request = _greedy("b", PROMPTS[1], 1, logprobs=1)
    completion = engine.generate([request]).completions[0]
    [(token_id, logprobs)] = naive_decode(engine.model, engine.encode(request), 1, engine.eos_token_ids)
    # NOTE: bf16 rounds each operation's output to 8 bits: the two orders of operations part by about 2^-8 relative
    assert abs(completion.logprobs[0].chosen.logprob - float(logprobs[completion.token_ids[0]])) < 0.1
    assert completion.token_ids[0] == token_id or logprobs.topk(2).values.diff().abs() < 0.1


@pytest.mark.parametrize("name", ["mistral", *GEMMAS])
@torch.inference_mode()
def test_a_left_padded_prefill_scores_like_transformers_forward(family_folders, settings: Settings, name: str) -> None:
    """The unpaged forward the quality lab scores with (decoder.logits), its sliding windows keyed by position: each
    row's logits at every position, the shorter row left-padded, equal transformers' forward over that row alone."""
    engine = _engine(family_folders, settings, name)
    rows = [engine.encode(_greedy("p", prompt, 1)) for prompt in (PROMPTS[2], PROMPTS[1])]
    T = len(rows[0])
    ids = torch.tensor([[engine.pad_token_id] * (T - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (T - len(row)) + [1] * len(row) for row in rows])
    got = engine.decoder.logits(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), T)  # (2, T, V)
    for b, row in enumerate(rows):
        want = engine.model(input_ids=torch.tensor([row])).logits[0]
        torch.testing.assert_close(got[b, T - len(row):], want, atol=LOGIT_ATOL, rtol=0)


class _Head(torch.nn.Module):
    def __init__(self, head) -> None:
        super().__init__()
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


@pytest.mark.parametrize("name", ["qwen3", "gemma2"])  # NOTE: the same head in every family; Gemma 2 soft-caps after it
@torch.inference_mode()
def test_an_int8_output_layer_decodes_like_naive_greedy_with_that_head(family_folders, settings: Settings,
                                                                       name: str) -> None:
    if load_blocked_kernel(settings.cache_dir).module is None:
        pytest.skip("this CPU runs no servelab build")
    engine = _engine(family_folders, settings, name, lm_head_weights="int8")
    head = engine.decoder.lm_head
    reference = copy.deepcopy(engine.model)  # its head and tied embedding the int8 table's
    reference.model.embed_tokens.weight = torch.nn.Parameter(head.rows(torch.arange(head.out_features)),
                                                             requires_grad=False)
    reference.lm_head = _Head(head)
    engine.reset()
    requests = [_greedy(f"h{i}", p, 5) for i, p in enumerate(PROMPTS[:2])]
    for request, completion in zip(requests, engine.generate(requests).completions):
        assert list(completion.token_ids) == naive_greedy(reference, engine.encode(request), 5, engine.eos_token_ids)


# --- AWQ int4 (round-to-nearest, the layout and kernel AWQ checkpoints use) ---

needs_gptqmodel = pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None, reason="needs gptqmodel==7.6.0")


@pytest.fixture(scope="module")
def awq_settings(tmp_path_factory) -> Settings:
    return Settings(cache_dir=with_built_kernels(tmp_path_factory.mktemp("families-awq")))


def _rtn_config(folder: Path) -> ServingConfig:
    return ServingConfig.from_dict({"name": "tiny-rtn", "model": str(folder), "weights": "awq-int4", "device": "cpu",
                                    "decoding": {"max_new_tokens": 8, "max_context_tokens": 128},
                                    "awq": {"method": "rtn", "group_size": 64}})


@needs_gptqmodel
@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen3", "gemma2", "gemma3"])
@torch.inference_mode()
def test_an_rtn_int4_model_decodes_like_naive_greedy_with_the_same_kernel(family_folders, awq_settings: Settings,
                                                                          name: str) -> None:
    """servelab's int4 kernel in the engine and in each of transformers' layers (as test_awq.py checks Llama): the
    same greedy tokens."""
    from servelab.engine import awq
    from servelab.engine.linear import ServelabInt4Linear
    from tests.engine.test_awq import _OwnKernel

    config = _rtn_config(family_folders[name])
    awq.quantize_rtn(config, awq_settings, progress=lambda _: None)
    engine = Engine.from_config(config, awq_settings)
    assert isinstance(engine.decoder, LlamaDecoder)
    blocked = load_blocked_kernel(awq_settings.cache_dir)
    reference = engine.model
    if blocked.module is not None:
        assert isinstance(engine.decoder.layers[0].qkv, ServelabInt4Linear)
        assert (engine.decoder._decode_stack() is None) == (name in ("mistral", "qwen2", "qwen3", *GEMMAS))
        for layer in engine.decoder.layers:  # the integer path at every row count, in both
            for p in (layer.qkv, layer.o, layer.gate_up, layer.down):
                p.int_rows = 1 << 30
        engine.decoder._stack = None  # NOTE: rebuilt with the rows just set
        for module_name, module in list(reference.named_modules()):
            if hasattr(module, "qweight"):
                parent, _, child = module_name.rpartition(".")
                setattr(reference.get_submodule(parent), child, _OwnKernel(ServelabInt4Linear(blocked, [module], 1 << 30)))
    # NOTE: bf16 activations around the int4 layers (AWQ's serving dtype) and attention in another order than SDPA's:
    # two near-equal logits may swap a token, and everything after it differs. So the first token is checked against
    # greedy, and each token the engine chose against the reference's log-probability of it, fed the engine's own
    # tokens (a dropped bias or norm moves it by nats)
    requests = [_greedy(f"a{i}", p, 6, logprobs=1) for i, p in enumerate(PROMPTS)]
    for request, completion in zip(requests, engine.generate(requests).completions):
        prompt_ids = engine.encode(request)
        assert completion.token_ids[0] == naive_greedy(reference, prompt_ids, 1, engine.eos_token_ids)[0]
        ids = torch.tensor([prompt_ids + list(completion.token_ids)])
        logprobs = reference(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float().log_softmax(-1)  # (new, V)
        want = logprobs.gather(1, torch.tensor(completion.token_ids).view(-1, 1)).view(-1)
        got = torch.tensor([lp.chosen.logprob for lp in completion.logprobs])
        torch.testing.assert_close(got, want, atol=INT4_LOGPROB_ATOL, rtol=0)


@needs_gptqmodel
def test_phi3_int4_quantising_is_refused_with_the_module_gptqmodel_does_not_write(family_folders,
                                                                                 awq_settings: Settings) -> None:
    """gptqmodel 7.6 quantises Phi-3's MLP as gate_proj / up_proj; transformers' Phi-3 holds one gate_up_proj."""
    from servelab.engine import awq

    with pytest.raises(awq.AWQCheckpointError, match="gate_up_proj.qweight is missing"):
        awq.quantize_rtn(_rtn_config(family_folders["phi3"]), awq_settings, progress=lambda _: None)


# --- what is refused, by name ---


def _tiny(config_class, model_class, **extra):
    config = config_class(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, pad_token_id=0,
                          **extra)
    return model_class(config).eval()


@pytest.mark.parametrize(("model", "reason"), [
    (lambda: _tiny(Gemma3TextConfig, Gemma3ForCausalLM, head_dim=16, use_bidirectional_attention=True),
     "bidirectional attention"),
    (lambda: _tiny(Gemma2Config, Gemma2ForCausalLM, head_dim=16, hidden_activation="gelu"), "activation 'gelu'"),
    (lambda: _tiny(Phi3Config, Phi3ForCausalLM, partial_rotary_factor=0.5), "partial rotary positions"),
    (lambda: _tiny(LlamaConfig, LlamaForCausalLM, hidden_act="gelu"), "activation 'gelu'"),
])
def test_what_the_decoder_cannot_match_is_refused_by_name_and_served_by_transformers(model, reason: str,
                                                                                    settings: Settings) -> None:
    model = model()
    assert reason in unsupported_reason(model)
    decoder = build_decoder(model, choice="auto", kv_cache_dtype="auto", dtype=torch.float32,
                            device=torch.device("cpu"), linear_kernel="torch", cache_dir=settings.cache_dir)
    assert decoder.name == "transformers"


def test_transformers_own_forward_runs_the_attention_each_model_class_takes(family_folders, settings: Settings) -> None:
    """Gemma 2 has no SDPA (no soft cap in it), and transformers refuses it: the loader asks for its eager attention
    (the reference and the transformers decoder run it); the others keep SDPA."""
    for name in ("gemma2", "gemma3"):
        model = _engine(family_folders, settings, name).model
        assert model.config._attn_implementation == ("eager" if name == "gemma2" else "sdpa"), name


def test_sliding_windows_are_served_and_applied_where_they_hide_keys() -> None:
    for window, applied in ((64, [64]), (256, [None]), (None, [None])):  # 256: it reaches every position served
        model = _tiny(MistralConfig, MistralForCausalLM, sliding_window=window)
        assert unsupported_reason(model) is None and layer_windows(model) == applied, window
    qwen2 = _tiny(Qwen2Config, Qwen2ForCausalLM, use_sliding_window=True, sliding_window=32, max_window_layers=0)
    assert unsupported_reason(qwen2) is None and layer_windows(qwen2) == [32]


def test_dynamic_rope_is_served_within_its_original_length_and_refused_by_name_past_it(family_folders,
                                                                                       settings: Settings) -> None:
    engine = _engine(family_folders, settings, "llama-dynamic")
    assert rope_positions(engine.loaded.model) == engine.decoder.cos.shape[0] == 512
    with pytest.raises(ValueError, match="position 512 is past the 512 positions .*rope type 'dynamic'"):
        engine.decoder._check_positions(torch.tensor([3, 512]))


def test_longrope_is_served_within_its_original_length() -> None:
    factors = {"short_factor": [1.0 + i / 10 for i in range(8)], "long_factor": [2.0 + i for i in range(8)]}
    model = _tiny(Phi3Config, Phi3ForCausalLM, original_max_position_embeddings=64,
                  rope_scaling={"rope_type": "longrope", **factors})
    assert unsupported_reason(model) is None and rope_positions(model) == 64


def test_a_context_past_longropes_original_length_is_refused_when_the_engine_loads(tmp_path: Path, bundled_folder: str,
                                                                                  settings: Settings) -> None:
    """Not at the step a row reaches there (which would fail its whole batch): at load, naming the reason."""
    from servelab.engine.model_files import ModelLoadError

    tokenizer = AutoTokenizer.from_pretrained(bundled_folder)
    factors = {"short_factor": [1.0 + i / 10 for i in range(8)], "long_factor": [2.0 + i for i in range(8)]}
    model = Phi3ForCausalLM(Phi3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                       max_position_embeddings=256, original_max_position_embeddings=64,
                                       pad_token_id=tokenizer.pad_token_id,
                                       rope_scaling={"rope_type": "longrope", **factors}))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"max_context_tokens is 128, past the 64 positions .*'longrope'"):
        Engine.from_config(make_config(str(tmp_path), decoding={"max_new_tokens": 16, "max_context_tokens": 128}),
                           settings)
    served = Engine.from_config(make_config(str(tmp_path), decoding={"max_new_tokens": 16, "max_context_tokens": 64}),
                                settings)
    assert served.decoder.name == "servelab"
