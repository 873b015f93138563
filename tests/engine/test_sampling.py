"""Sampling draws from the distribution its parameters define: temperature, top-k and top-p, each checked with a
chi-square goodness-of-fit test over many seeded draws on a tiny vocabulary, and tokens the filters exclude never
drawn. Knows sample_next only (no model): the expected probabilities are computed here, in numpy, on their own.

NOTE: each goodness-of-fit check fails a correct sampler with probability ALPHA = 0.001 (its false-failure rate).
The draws are seeded, so a run is repeatable; ALPHA is why the seed is not one picked for passing: a correct
sampler passes with any seed 999 times in 1,000, while a wrong one is far past the critical value (tried: the
temperature ignored gives p below 1e-50 in every case that sets one).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from servelab.engine.sampling import make_generator, sample_next
from servelab.request import SamplingParams

ALPHA = 0.001
NUM_DRAWS = 6_000
LOGITS = (2.0, 1.2, 0.7, 0.3, -0.4, -1.1)  # distinct, so no filter boundary falls on a tie


def expected_probs(params: SamplingParams) -> np.ndarray:
    """softmax(logits / T), keep the top_k most likely, renormalise, then keep the smallest most-likely set
    whose probability reaches top_p (the token that crosses it included), renormalise."""
    logits = np.asarray(LOGITS) / params.temperature
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    if 0 < params.top_k < len(probs):
        probs[order[params.top_k:]] = 0.0
        probs /= probs.sum()
    if params.top_p < 1.0:
        before = np.cumsum(probs[order]) - probs[order]  # probability of the more likely tokens
        probs[order[before >= params.top_p]] = 0.0
        probs /= probs.sum()
    return probs


def draw_counts(params: SamplingParams) -> np.ndarray:
    generator = make_generator(params, torch.device("cpu"))
    logits = torch.tensor([LOGITS])  # (1, V)
    counts = np.zeros(len(LOGITS), dtype=int)
    for _ in range(NUM_DRAWS):
        counts[int(sample_next(logits, [params], [generator], [[]])[0])] += 1
    return counts


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=11),
    SamplingParams(temperature=0.5, seed=12),
    SamplingParams(temperature=2.0, seed=13),
    SamplingParams(temperature=1.0, top_k=3, seed=14),
    SamplingParams(temperature=1.0, top_p=0.8, seed=15),
    SamplingParams(temperature=1.5, top_k=5, top_p=0.9, seed=16),
], ids=["t1", "t0.5", "t2", "top_k3", "top_p0.8", "t1.5-k5-p0.9"])
def test_sampling_draws_from_the_distribution_its_temperature_top_k_and_top_p_define(params) -> None:
    counts, probs = draw_counts(params), expected_probs(params)
    kept = probs > 0
    assert not counts[~kept].any(), f"drew filtered-out tokens: {counts} (expected probabilities {probs.round(3)})"
    assert kept.sum() >= 2, "the case must leave a choice to test"
    result = chisquare(counts[kept], NUM_DRAWS * probs[kept])
    assert result.pvalue >= ALPHA, (f"counts {counts} against expected {(NUM_DRAWS * probs).round(1)}: "
                                    f"chi-square {result.statistic:.1f}, p = {result.pvalue:.2g}")


def test_the_filters_keep_what_their_definition_says() -> None:
    """The expected distributions themselves, checked by hand: so the test above is not one wrong formula
    compared with another."""
    assert (expected_probs(SamplingParams(temperature=1.0, top_k=3)) > 0).tolist() == [True] * 3 + [False] * 3
    p = np.exp(LOGITS) / np.exp(LOGITS).sum()  # 0.47, 0.21, 0.13, 0.087, 0.043, 0.021
    # top_p 0.8: 0.47 + 0.21 = 0.68 < 0.8, so the third token (which crosses 0.8) is kept and the rest go
    assert p[0] + p[1] < 0.8 <= p[0] + p[1] + p[2]
    assert (expected_probs(SamplingParams(temperature=1.0, top_p=0.8)) > 0).tolist() == [True] * 3 + [False] * 3
    cooled = expected_probs(SamplingParams(temperature=0.5))
    assert cooled[0] == pytest.approx(p[0] ** 2 / (p**2).sum())  # temperature 1/2 squares the probabilities
