"""The slow reference the engine is checked against: one prompt, no cache, no padding, greedy; with OpenAI's
presence and frequency penalties and vLLM's repetition penalty, min_tokens, stop_token_ids and ignore_eos written
out as their definitions, and each chosen token's log-softmax."""

from __future__ import annotations

from collections import Counter

import torch


@torch.inference_mode()
def naive_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: set[int], **penalties
                 ) -> list[int]:
    return [token_id for token_id, _ in naive_decode(model, prompt_ids, max_new_tokens, eos_token_ids, **penalties)]


@torch.inference_mode()
def naive_decode(model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: set[int], *,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                 min_tokens: int = 0, stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False
                 ) -> list[tuple[int, torch.Tensor]]:
    """[(greedy token id, the raw model's log-softmax at its position (V,))]."""
    stops = {*stop_token_ids, *(() if ignore_eos else eos_token_ids)}
    ids = list(prompt_ids)
    generated: list[tuple[int, torch.Tensor]] = []
    counts: Counter[int] = Counter()
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids], device=model.device), use_cache=False).logits  # (1, T, V)
        raw = logits[0, -1].float()
        penalised = raw.clone()
        for token_id in set(ids):  # NOTE: vLLM's repetition penalty, over the prompt and the output
            value = float(penalised[token_id])
            penalised[token_id] = value / repetition_penalty if value > 0 else value * repetition_penalty
        for token_id, count in counts.items():  # NOTE: the definition, token by token
            penalised[token_id] -= presence_penalty * (count > 0) + frequency_penalty * count
        if len(generated) < min_tokens:  # vLLM's min_tokens: no stop token until then
            for token_id in stops:
                penalised[token_id] = float("-inf")
        token_id = int(penalised.argmax())
        generated.append((token_id, raw.log_softmax(-1).cpu()))
        counts[token_id] += 1
        ids.append(token_id)
        if token_id in stops and len(generated) >= min_tokens:
            break
    return generated


def window_mask(length: int, block_size: int, sink_blocks: int, window_blocks: int) -> torch.Tensor:
    """(length, length) bool, True where the query (row) attends to the key (column) under kv_cache.eviction: window:
    causal, and the key in the first sink_blocks blocks or in the window_blocks blocks behind the query's own block
    (or in it). The definition, on positions."""
    query = torch.arange(length)[:, None]
    key = torch.arange(length)[None, :]
    return (key <= query) & ((key // block_size < sink_blocks) | (key // block_size >= query // block_size - window_blocks))


def layer_type_masks(model, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """A (1, 1, L, L) bool mask as transformers takes masks ready made per layer type: on sliding-window layers also
    the model's token window (a query sees keys at positions > its own - sliding_window); additive (0 or the dtype's
    lowest), as its eager attention adds them to the scores."""
    length = mask.shape[-1]
    position = torch.arange(length, device=mask.device)
    near = position[None, :] > position[:, None] - model.config.sliding_window
    lowest = torch.finfo(model.dtype).min
    return {kind: torch.zeros(mask.shape, dtype=model.dtype, device=mask.device).masked_fill(~seen, lowest)
            for kind, seen in (("full_attention", mask), ("sliding_attention", mask & near))}


@torch.inference_mode()
def naive_window_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: set[int], *,
                        block_size: int, sink_blocks: int, window_blocks: int) -> list[int]:
    """Greedy decoding with every position's attention limited to the window's mask: the whole sequence through
    transformers' forward at each step (no cache), a custom 4D mask, each token at its own position."""
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        mask = window_mask(len(ids), block_size, sink_blocks, window_blocks)[None, None].to(model.device)
        if "sliding_attention" in (getattr(model.config, "layer_types", None) or ()):
            mask = layer_type_masks(model, mask)
        logits = model(input_ids=torch.tensor([ids], device=model.device), attention_mask=mask,
                       position_ids=torch.arange(len(ids), device=model.device)[None], use_cache=False,
                       logits_to_keep=1).logits
        token_id = int(logits[0, -1].float().argmax())
        out.append(token_id)
        ids.append(token_id)
        if token_id in eos_token_ids:
            break
    return out
