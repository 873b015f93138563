"""`servelab check-model`: does servelab's fast path serve this model folder, and does it answer as transformers does?

Knows how to load a folder (or a bundled name) as a serving config of its own, which decoder serves it and why, a
few greedy tokens and their log-probabilities against transformers' own forward without cache on the same weights
(the slow reference), and decode tokens/s at a few batch sizes (timed as `servelab bench engine` times them,
servelab/lab/bench.py). Does not parse options or print (the CLI does), nor judge the tokens
(servelab/analysis/token_match.py does).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from servelab.analysis.token_match import TokenComparison, compare_tokens
from servelab.config import BUNDLED_PREFIX, ServingConfig
from servelab.engine.engine import Engine
from servelab.engine.loader import ModelLoadError
from servelab.request import GenerationRequest, SamplingParams
from servelab.settings import Settings

PROMPT = "The three primary colours are red, yellow and"


@dataclass(frozen=True)
class DecodeSpeed:
    batch_size: int
    decode_tokens_per_s: float  # decode steps only
    tokens_per_s: float  # output tokens over prefill + decode


@dataclass(frozen=True)
class ModelCheck:
    source: str
    folder: str
    architecture: str  # the model's config.model_type
    weights: str
    decoder: str  # "servelab" or "transformers"
    decoder_reason: str | None  # why transformers' forward serves it, and the cost; None: servelab's decoder
    kernel: str  # the engine's label: decoder, precision, linear-layer kernels
    num_threads: int
    prompt_ids: tuple[int, ...]
    tokens: TokenComparison
    speeds: tuple[DecodeSpeed, ...]
    num_prompt_tokens: int  # the speed prompts'
    num_new_tokens: int  # the speed rows'


def check_source(source: str) -> None:
    """A local folder must exist, hold a config.json and be a causal LM to transformers; ModelLoadError names what
    is missing. A bundled name is left to the loader."""
    if source.startswith(BUNDLED_PREFIX):
        return
    folder = Path(source).expanduser()
    if not folder.exists():
        raise ModelLoadError(f"{source}: no such folder (give a local model folder, or a bundled name such as "
                             f"{BUNDLED_PREFIX}smollm2-135m-instruct)")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder}: no config.json there, so not a transformers model folder")
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{folder}: transformers cannot read its config.json: {exc}") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        names = ", ".join(getattr(config, "architectures", None) or []) or "no architectures named"
        raise ModelLoadError(f"{folder}: a {config.model_type!r} model ({names}), not a causal LM: transformers has "
                             "no AutoModelForCausalLM for it, and servelab generates text with causal LMs only")


def check_config(source: str, *, weights: str, num_threads: int | None, max_new_tokens: int,
                 max_context_tokens: int) -> ServingConfig:
    """The serving config a check loads: the model on this machine's device, every other setting at its default."""
    return ServingConfig.from_dict({
        "name": "check-model", "model": source, "weights": weights, "num_threads": num_threads,
        "decoding": {"max_new_tokens": max_new_tokens, "max_context_tokens": max_context_tokens}})


def load_engine(config: ServingConfig, settings: Settings) -> Engine:
    """The engine as a worker would load it; ModelLoadError (or ValueError: a setting the model refuses) if not."""
    check_source(config.model)
    with_threads = settings.model_copy(update={"num_threads": config.num_threads}) if config.num_threads else settings
    return Engine.from_config(config, with_threads)


@torch.inference_mode()
def reference_greedy(model, prompt_ids: list[int], ours: list[int]) -> tuple[list[tuple[int, float | None]],
                                                                                list[float | None]]:
    """transformers' forward from the prompt, the whole sequence each step (no cache, no padding), greedy, as many
    tokens as `ours` -> ([(its token, its log-probability of ours' token there; None past a difference)], [its
    log-probability of its own token minus of ours' there])."""
    ids, tokens, gaps = list(prompt_ids), [], []
    same_prefix = True  # until the two part, both decode from the same ids
    for our_id in ours:
        logits = model(input_ids=torch.tensor([ids], device=model.device), use_cache=False, logits_to_keep=1).logits
        logprobs = logits[0, -1].float().log_softmax(-1)  # (V,)
        token_id = int(logprobs.argmax())
        tokens.append((token_id, float(logprobs[our_id]) if same_prefix else None))
        gaps.append(float(logprobs[token_id] - logprobs[our_id]) if same_prefix else None)
        same_prefix = same_prefix and token_id == our_id
        ids.append(token_id)
    return tokens, gaps


def compare_with_transformers(engine: Engine, *, prompt: str, num_tokens: int, tolerance: float) -> tuple[
        tuple[int, ...], TokenComparison]:
    """num_tokens greedy tokens of the engine (EOS ignored) and of transformers' forward on the same weights."""
    request = GenerationRequest("check", prompt=prompt,
                                params=SamplingParams(max_new_tokens=num_tokens, ignore_eos=True, logprobs=0))
    completion = engine.generate([request]).completions[0]
    if completion.error:
        raise ValueError(f"the engine could not serve the check's prompt: {completion.error}")
    ours = [(lp.chosen.token_id, lp.chosen.logprob) for lp in completion.logprobs or ()]
    prompt_ids = engine.encode(request)
    reference, gaps = reference_greedy(engine.model, prompt_ids, [t for t, _ in ours])
    return tuple(prompt_ids), compare_tokens(ours, reference, gaps, tolerance=tolerance)


def measure_decode(engine: Engine, *, batch_sizes: list[int], num_prompt_tokens: int,
                   num_new_tokens: int) -> tuple[DecodeSpeed, ...]:
    """One timed batch per size after a warm-up batch (first calls pay for lazy initialisation): a quick figure, not
    a benchmark; `servelab bench engine` interleaves rounds and compares with transformers' generate."""
    # NOTE: imported here: the bench brings the lab's statistics (scipy), which a GPU host's check, importing this
    # module for reference_greedy, has no need of and may not have
    from servelab.lab.bench import bench_requests, time_engine

    time_engine(engine, bench_requests(engine, 1, 8, 2))
    speeds = []
    for batch_size in batch_sizes:
        tokens_per_s, decode_tokens_per_s = time_engine(
            engine, bench_requests(engine, batch_size, num_prompt_tokens, num_new_tokens))
        speeds.append(DecodeSpeed(batch_size, decode_tokens_per_s, tokens_per_s))
    return tuple(speeds)


def check_model(engine: Engine, *, num_tokens: int, tolerance: float, batch_sizes: list[int], num_prompt_tokens: int,
                num_new_tokens: int, prompt: str = PROMPT) -> ModelCheck:
    """Which decoder and kernels serve the engine's model, its greedy tokens against transformers', its speed."""
    prompt_ids, tokens = compare_with_transformers(engine, prompt=prompt, num_tokens=num_tokens, tolerance=tolerance)
    speeds = measure_decode(engine, batch_sizes=batch_sizes, num_prompt_tokens=num_prompt_tokens,
                            num_new_tokens=num_new_tokens)
    config = engine.config
    return ModelCheck(config.model, str(engine.loaded.folder), engine.loaded.model.config.model_type, config.weights,
                      engine.decoder.name, engine.decoder_reason, engine.kernel, torch.get_num_threads(), prompt_ids,
                      tokens, speeds, num_prompt_tokens, num_new_tokens)
