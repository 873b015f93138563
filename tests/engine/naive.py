"""The slow reference the engine is checked against: one prompt, no cache, no padding, greedy; with OpenAI's
presence and frequency penalties written out as their definition, and each chosen token's log-softmax."""

from __future__ import annotations

from collections import Counter

import torch


@torch.inference_mode()
def naive_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: set[int], *,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> list[int]:
    return [token_id for token_id, _ in naive_decode(model, prompt_ids, max_new_tokens, eos_token_ids,
                                                     presence_penalty=presence_penalty,
                                                     frequency_penalty=frequency_penalty)]


@torch.inference_mode()
def naive_decode(model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: set[int], *,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0
                 ) -> list[tuple[int, torch.Tensor]]:
    """[(greedy token id, the raw model's log-softmax at its position (V,))]."""
    ids = list(prompt_ids)
    generated: list[tuple[int, torch.Tensor]] = []
    counts: Counter[int] = Counter()
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids], device=model.device), use_cache=False).logits  # (1, T, V)
        raw = logits[0, -1].float()
        penalised = raw.clone()
        for token_id, count in counts.items():  # NOTE: the definition, token by token
            penalised[token_id] -= presence_penalty * (count > 0) + frequency_penalty * count
        token_id = int(penalised.argmax())
        generated.append((token_id, raw.log_softmax(-1).cpu()))
        counts[token_id] += 1
        ids.append(token_id)
        if token_id in eos_token_ids:
            break
    return generated
