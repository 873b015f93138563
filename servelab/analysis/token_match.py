"""Whether an engine's greedy tokens match a reference's: where they part, whether that is a near tie, and the
largest log-probability difference, against a tolerance chosen by the weights' precision.

Pure (no torch): token ids and log-probabilities in, a verdict out. Does not decode anything:
servelab/lab/check_model.py runs the engine and transformers' forward.
"""

from __future__ import annotations

from dataclasses import dataclass

# The largest log-probability difference (nats) between servelab's engine and transformers' forward that passes, by
# weights. NOTE: fp32 differs in summation order only (1e-5 on the bundled model); in bf16 both round every layer's
# output to bf16, each its own way (up to 0.14 over 72 tokens of the bundled model), so only a bug exceeds 0.3
TOLERANCES = {"fp32": 1e-3, "bf16": 0.3}


@dataclass(frozen=True)
class TokenComparison:
    """Greedy tokens of the engine and of the reference from one prompt, and where they part. `logprob_diffs` holds,
    per position up to the first difference (the prefixes are equal there), the engine's log-probability of its token
    minus the reference's of that same token; past the first difference the two continue different texts."""

    token_ids: tuple[int, ...]  # servelab's engine
    reference_ids: tuple[int, ...]  # transformers' forward, no cache
    logprob_diffs: tuple[float, ...]
    first_difference: int | None  # the first position where the tokens differ; None: all equal
    gap_at_difference: float | None  # the reference's log-probability of its token minus of the engine's, there
    tolerance: float

    @property
    def max_logprob_diff(self) -> float:
        return max((abs(d) for d in self.logprob_diffs), default=0.0)

    @property
    def is_near_tie(self) -> bool:
        """The tokens part where the reference itself ranks the two within the tolerance: float noise, not a bug."""
        return self.gap_at_difference is not None and self.gap_at_difference <= self.tolerance

    @property
    def passed(self) -> bool:
        return (self.first_difference is None or self.is_near_tie) and self.max_logprob_diff <= self.tolerance


def compare_tokens(ours: list[tuple[int, float]], reference: list[tuple[int, float | None]],
                   reference_gaps: list[float | None], *, tolerance: float) -> TokenComparison:
    """ours: (token id, its log-probability) per position; reference: (token id, its log-probability of ours' token
    there, None past a difference); reference_gaps: its log-probability of its own token minus of ours' there."""
    assert len(ours) == len(reference) == len(reference_gaps), (len(ours), len(reference), len(reference_gaps))
    first = next((i for i, ((a, _), (b, _)) in enumerate(zip(ours, reference)) if a != b), None)
    compared = len(ours) if first is None else first + 1
    diffs = tuple(ours[i][1] - reference[i][1] for i in range(compared))
    gap = reference_gaps[first] if first is not None else None
    return TokenComparison(tuple(t for t, _ in ours), tuple(t for t, _ in reference), diffs, first, gap, tolerance)
