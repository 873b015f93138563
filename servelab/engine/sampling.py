"""Picks the next token of every row from its logits, each row by its own sampling parameters.

Knows greedy, temperature, top-k and top-p, and per-row seeded generators, so a row's samples
depend only on its seed and its logits, never on its batch-mates. Does not know the model.
"""

from __future__ import annotations

import torch

from servelab.request import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.is_greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


def sample_next(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """logits (B, V) -> next token ids (B,)."""
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators), logits.shape
    next_ids = logits.argmax(dim=-1)  # (B,)
    for i, (p, generator) in enumerate(zip(params, generators)):
        if generator is not None:
            next_ids[i] = _sample_row(logits[i].float(), p, generator)
    return next_ids


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    logits = logits / p.temperature  # (V,)
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - sorted_logits.softmax(dim=-1) >= p.top_p  # keep the first token past top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[0]
