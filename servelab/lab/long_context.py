"""Long-context quality: perplexity over long texts, scored far into each text, so that what a config does to
distant context (window eviction drops it) shows, paired text by text between two configs.

The texts are CPython's own reference documentation as the standard library ships it (`pydoc_data.topics`, PSF
licence: what `help('topics')` reads), so nothing is downloaded and nothing is added to install: the topics of at
least `length` tokens, a topic whose opening is inside a longer chosen one left out (the special-method names hold
"customization", "attribute-access"...), cut into non-overlapping segments of `length` tokens, taken topic by topic
(each one's first segment, then each one's second...). Each segment is
scored on its tokens from `scored_from` on (by default the second half: every scored token has 1,024 tokens behind
it, beyond a 64 + 512 window), through the serving decoder's own forward with the config's attention window
applied (the mask the paged cache applies; docs/engine.md, "Window eviction"). The texts change with Python's
patch release, so a result carries a fingerprint of its segments and only results with the same one are paired.
Does not know runs, stores or verdicts.
"""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass

import numpy as np
import torch

from servelab.analysis.stats import Estimate, bootstrap, paired_perplexity_ratio
from servelab.engine.engine import Engine, kv_window


@dataclass(frozen=True)
class Segment:
    topic: str  # the pydoc topic it is cut from
    index: int  # its place among the topic's segments
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class LongContextResult:
    """Per-segment summed NLL (nats) of the scored tokens, in segment order, so two configs compare paired."""

    config: str
    fingerprint: str  # of the segments' tokens: two results pair only on the same one
    segments: tuple[str, ...]  # "topic#index"
    nll: tuple[float, ...]
    num_tokens: tuple[int, ...]

    @property
    def perplexity(self) -> Estimate:
        nll, num = np.array(self.nll), np.array(self.num_tokens, dtype=float)
        return bootstrap(np.arange(len(nll)), lambda idx: np.exp(nll[idx.astype(int)].sum(axis=-1)
                                                                 / num[idx.astype(int)].sum(axis=-1)))

    def as_dict(self) -> dict:
        return {"task": "long-context", "fingerprint": self.fingerprint, "segments": list(self.segments),
                "nll": list(self.nll), "num_tokens": list(self.num_tokens), "perplexity": self.perplexity.as_dict()}


def long_texts() -> dict[str, str]:
    """pydoc's topics, by name (the standard library's copy of the reference documentation)."""
    return dict(importlib.import_module("pydoc_data.topics").topics)


def long_segments(tokenizer, *, length: int = 2048, num_segments: int = 16) -> list[Segment]:
    """num_segments segments of `length` tokens: every chosen topic's first segment (longest topics first), then
    every one's second, and so on."""
    if length < 2:
        raise ValueError(f"a segment needs at least 2 tokens, got length {length}")
    encoded = {name: tokenizer.encode(text, add_special_tokens=False) for name, text in long_texts().items()}
    chosen: list[str] = []
    texts = long_texts()
    for name in sorted(encoded, key=lambda n: (-len(encoded[n]), n)):
        if len(encoded[name]) < length:
            break
        opening = texts[name].split("\n", 3)[-1][:200]  # NOTE: past the title, which a containing topic words apart
        if not any(opening in texts[other] for other in chosen):
            chosen.append(name)
    # NOTE: each topic's first segment, then each one's second...: a few segments already span several topics
    segments = [Segment(name, i, tuple(encoded[name][i * length:(i + 1) * length]))
                for i in range(len(encoded[chosen[0]]) // length if chosen else 0)
                for name in chosen if i < len(encoded[name]) // length]
    if len(segments) < num_segments:
        raise ValueError(f"only {len(segments)} segments of {length} tokens in this Python's pydoc topics; ask for "
                         f"at most that many (or shorter segments)")
    return segments[:num_segments]


def fingerprint(segments: list[Segment]) -> str:
    digest = hashlib.sha256()
    for s in segments:
        digest.update(f"{s.topic}#{s.index}:".encode() + np.asarray(s.token_ids, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


@torch.inference_mode()
def evaluate_long_context(engine: Engine, segments: list[Segment], *, scored_from: int = 1024,
                          batch_size: int = 1) -> LongContextResult:
    """Summed NLL of each segment's tokens from scored_from on, given every token before it as the config attends:
    the serving decoder's forward (servelab's or transformers'), with the window mask under eviction: window."""
    assert segments, "no segments to score"
    length = len(segments[0].token_ids)
    if not 1 <= scored_from < length or any(len(s.token_ids) != length for s in segments):
        raise ValueError(f"scored_from ({scored_from}) must be within segments of one length ({length})")
    kv = kv_window(engine.config)
    window = (*kv, engine.config.kv_cache.block_size) if kv is not None else None
    nll: list[float] = []
    for start in range(0, len(segments), batch_size):
        batch = segments[start:start + batch_size]
        input_ids = torch.tensor([s.token_ids for s in batch], dtype=torch.long, device=engine.device)
        mask = torch.ones_like(input_ids)
        positions = torch.arange(length, device=engine.device).expand(len(batch), -1)
        keep = length - scored_from + 1  # the logits before each scored token
        if window is not None:
            logits = engine.decoder.logits(input_ids, mask, positions, keep, window=window)
        else:
            logits = engine.decoder.logits(input_ids, mask, positions, keep)
        log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, length - scored_from, V)
        picked = log_probs.gather(-1, input_ids[:, scored_from:, None])[..., 0]
        nll += [-float(x) for x in picked.sum(dim=-1)]
    return LongContextResult(engine.config.name, fingerprint(segments), tuple(f"{s.topic}#{s.index}" for s in segments),
                             tuple(nll), tuple([length - scored_from] * len(segments)))


def long_context_ratio(baseline: LongContextResult | dict, candidate: LongContextResult | dict) -> Estimate:
    """candidate perplexity / baseline perplexity over the same segments (above 1: worse), paired bootstrap."""
    b = baseline.as_dict() if isinstance(baseline, LongContextResult) else baseline
    c = candidate.as_dict() if isinstance(candidate, LongContextResult) else candidate
    if b["fingerprint"] != c["fingerprint"]:
        raise ValueError("long-context results pair only on the same segments (another Python's pydoc topics, "
                         "another length or count): measure both configs on one machine")
    return paired_perplexity_ratio(c["nll"], b["nll"], c["num_tokens"], b["num_tokens"])
