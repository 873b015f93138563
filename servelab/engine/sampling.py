"""Picks the next token of every row from its logits, each row by its own sampling parameters, and reads the
log-probabilities a row asked for.

Knows greedy, presence and frequency penalties (over the row's own generated tokens), temperature, top-k and
top-p, and per-row seeded generators, so a row's samples depend only on its seed, its logits and its own
tokens, never on its batch-mates. Rows that ask for no penalty and no sampling cost one argmax over the batch.
Log-probabilities are the model's: the raw log-softmax of the logits, before penalties and temperature.
Does not know the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from servelab.request import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.is_greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


def sample_next(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
    generated: Sequence[Sequence[int]],
) -> torch.Tensor:
    """logits (B, V), each row's generated token ids so far -> next token ids (B,). `logits` is not changed."""
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators) == len(generated), logits.shape
    next_ids = logits.argmax(dim=-1)  # (B,)
    for i, (p, generator) in enumerate(zip(params, generators)):
        if generator is None and not p.has_penalties:
            continue  # NOTE: most rows: greedy and unpenalised, the batch's argmax stands
        row = penalised(logits[i], p, generated[i]) if p.has_penalties else logits[i]  # (V,)
        next_ids[i] = row.argmax() if generator is None else _sample_row(row.float(), p, generator)
    return next_ids


def penalised(logits: torch.Tensor, p: SamplingParams, generated: Sequence[int]) -> torch.Tensor:
    """One row's logits (V,) with OpenAI's penalties: logits[t] - presence * (count[t] > 0) - frequency * count[t]
    over the tokens the row generated; a new tensor (the batch's logits stay raw, for log-probabilities)."""
    if not generated:
        return logits
    ids, counts = torch.tensor(list(generated), device=logits.device).unique(return_counts=True)
    row = logits.clone()
    row[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(row.dtype)
    return row


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


def read_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, rows: list[int], num_top: list[int]
                  ) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each listed row: the chosen token's log-probability and its num_top most likely (token, log-probability),
    most likely first, under the raw model (log-softmax of the logits, in fp32); one transfer to the host."""
    assert len(rows) == len(num_top) and rows, (rows, num_top)
    index = torch.tensor(rows, device=logits.device)
    logprobs = logits.index_select(0, index).float().log_softmax(dim=-1)  # (R, V)
    chosen = logprobs.gather(1, next_ids.index_select(0, index).view(-1, 1)).view(-1)  # (R,)
    k = max(num_top)
    if k == 0:
        return [(lp, []) for lp in chosen.tolist()]
    top = logprobs.topk(k, dim=-1)  # (R, k), sorted
    values, ids = top.values.tolist(), top.indices.tolist()
    return [(lp, list(zip(ids[r][:n], values[r][:n]))) for r, (lp, n) in enumerate(zip(chosen.tolist(), num_top))]
