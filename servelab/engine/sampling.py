"""Picks the next token of every row from its logits, each row by its own sampling parameters, and reads the
log-probabilities a row asked for.

Knows greedy, vLLM's repetition penalty (over prompt and output), presence and frequency penalties (over the
row's own generated tokens), tokens a row may not pick yet (min_tokens), the tokens a row's grammar allows
(structured output: llguidance's bitmask, unpacked here), temperature, min_p, top-k and top-p,
and per-row seeded generators, so a row's samples depend only on its seed, its logits and its own
tokens, never on its batch-mates. Rows that ask for no penalty, no constraint and no sampling cost one argmax over
the batch.
Log-probabilities are the model's: the raw log-softmax of the logits, before penalties and temperature.
Does not know the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from servelab.request import SamplingParams


@dataclass(frozen=True)
class Allowed:
    """The tokens constrained rows may pick: for each listed row (an index into the batch), one bit per token,
    packed in int32 words as llguidance writes them (R, ceil(V / 32)), on the CPU."""

    rows: list[int]
    bitmask: torch.Tensor

    def allows(self, k: int, token_id: int) -> bool:
        return bool((int(self.bitmask[k, token_id >> 5]) >> (token_id & 31)) & 1)

    def unpacked(self, ks: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
        """(len(ks), V) bool on `device`: True where listed row k's token is allowed (numpy unpacks the bits
        little-endian, as llguidance packs them, about 10x faster than shifts in torch)."""
        words = self.bitmask[ks].numpy().view(np.uint8)  # (K, 4W) little-endian bytes
        bits = np.unpackbits(words, axis=-1, bitorder="little")[:, :vocab_size]
        return torch.from_numpy(bits).view(torch.bool).to(device)


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.is_greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def kernel_argmax(module) -> Callable[[torch.Tensor], torch.Tensor]:
    """torch.argmax(logits, dim=-1) through servelab's kernel (argmax_rows in blocked.cpp) for fp32 logits on the
    CPU: the same indices (the first of tied maxima). For 49,152-token rows on a 2-core AVX2 EPYC at one thread, torch
    took 51 us for one row and 3.2 ms for 64 (one value at a time), the kernel 10 us and 0.57 ms (x4.9, x5.6). A row
    holding NaN or an infinity, and any other tensor, goes to torch."""

    def argmax(logits: torch.Tensor) -> torch.Tensor:
        if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or not logits.shape[1]:
            return logits.argmax(dim=-1)
        ids, not_finite = module.argmax_rows(logits.contiguous())
        if not_finite:
            bad = ids < 0
            ids[bad] = logits[bad].argmax(dim=-1)
        return ids

    return argmax


def sample_next(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
    generated: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]] | None = None,
    suppressed: Sequence[Sequence[int]] | None = None, allowed: Allowed | None = None,
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """logits (B, V), each row's generated token ids so far (and its prompt's, for repetition_penalty), the token
    ids a row may not pick now (min_tokens: EOS and stop_token_ids), the tokens constrained rows may pick (their
    grammars') -> next token ids (B,). `logits` is not changed. vLLM's order: the grammar's mask, suppressed
    tokens, penalties (repetition, then frequency and presence), temperature, min_p, top-k, top-p. `argmax`
    (kernel_argmax) takes torch.argmax's place over the whole batch."""
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators) == len(generated), logits.shape
    next_ids = (argmax or _torch_argmax)(logits)  # (B,) NOTE: most rows are greedy and unpenalised: this is their token
    constrained = dict(zip(allowed.rows, range(len(allowed.rows)))) if allowed is not None else {}
    rows = [i for i, p in enumerate(params)
            if p.has_penalties or (suppressed is not None and suppressed[i]) or i in constrained]
    if rows:
        adjusted = penalised(logits, rows, params, generated, prompts)  # (R, V)
        if constrained:
            _mask(adjusted, rows, allowed, generators)
        for j, i in enumerate(rows):
            if suppressed is not None and suppressed[i]:
                adjusted[j, list(suppressed[i])] = float("-inf")
        next_ids[rows] = adjusted.argmax(dim=-1)  # the greedy ones' tokens; sampled ones are drawn below
    where = {i: j for j, i in enumerate(rows)}
    for i, generator in enumerate(generators):
        if generator is not None:
            row = adjusted[where[i]] if i in where else logits[i]  # (V,)
            next_ids[i] = _sample_row(row.float(), params[i], generator)
    return next_ids


def _mask(adjusted: torch.Tensor, rows: list[int], allowed: Allowed, generators: list[torch.Generator | None]
          ) -> None:
    """Disallowed tokens to -inf in the constrained rows of `adjusted` (R, V), in place. A greedy row whose best token
    its grammar allows is left as it is: masking cannot change its argmax (most steps of a model that writes the
    JSON it was asked for), so only the others pay for the full-vocabulary mask."""
    at = {i: j for j, i in enumerate(rows)}
    need = [k for k, i in enumerate(allowed.rows)
            if generators[i] is not None or not allowed.allows(k, int(adjusted[at[i]].argmax()))]
    if not need:
        return
    picked = torch.tensor([at[allowed.rows[k]] for k in need], device=adjusted.device)
    keep = allowed.unpacked(need, adjusted.shape[-1], adjusted.device)  # (K, V)
    adjusted[picked] = adjusted.index_select(0, picked).masked_fill_(keep.logical_not_(), float("-inf"))


def penalised(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
              generated: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """These rows' logits (R, V) with vLLM's repetition penalty over each row's prompt and generated tokens
    (logit / rp where positive, logit * rp where not), then OpenAI's penalties over its generated tokens:
    logits[t] - presence * (count[t] > 0) - frequency * count[t]. A copy: the batch's logits stay raw (the
    log-probabilities read them). One set of operations for all the rows: a copy, and an update at the
    (row, token) pairs they generated."""
    vocab = logits.shape[-1]
    out = logits.index_select(0, torch.tensor(rows, device=logits.device))  # (R, V)
    for j, i in enumerate(rows):
        rp = params[i].repetition_penalty
        if rp != 1.0:
            seen = torch.tensor(sorted({*generated[i], *(prompts[i] if prompts is not None else ())}),
                                dtype=torch.long, device=out.device)  # (S,)
            values = out[j, seen]
            out[j, seen] = torch.where(values > 0, values / rp, values * rp)
    flat = [j * vocab + t for j, i in enumerate(rows) for t in generated[i]]
    if not flat:
        return out
    keys, counts = torch.tensor(flat, device=logits.device).unique(return_counts=True)  # (U,) (row, token) pairs
    presence = torch.tensor([params[i].presence_penalty for i in rows], dtype=out.dtype, device=out.device)
    frequency = torch.tensor([params[i].frequency_penalty for i in rows], dtype=out.dtype, device=out.device)
    owner = keys // vocab  # (U,)
    out.view(-1)[keys] -= presence[owner] + frequency[owner] * counts.to(out.dtype)
    return out


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    logits = logits / p.temperature  # (V,)
    if p.min_p > 0.0:  # NOTE: vLLM's: keep tokens with p >= min_p * (the likeliest token's p)
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
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
