"""The slow reference the engine is checked against: one prompt, no cache, no padding, greedy."""

from __future__ import annotations

import torch


@torch.inference_mode()
def naive_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: set[int]) -> list[int]:
    ids = list(prompt_ids)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids], device=model.device), use_cache=False).logits  # (1, T, V)
        token_id = int(logits[0, -1].argmax())
        generated.append(token_id)
        ids.append(token_id)
        if token_id in eos_token_ids:
            break
    return generated
