"""The verdict on an engine's greedy tokens against a reference's: a near tie passes, a real parting or a drifting
log-probability does not."""

from __future__ import annotations

from servelab.analysis.token_match import compare_tokens


def test_tokens_that_part_pass_only_at_a_near_tie_and_log_probabilities_within_the_tolerance() -> None:
    ours = [(5, -0.5), (7, -1.0), (9, -2.0)]
    parting = [(5, -0.5004), (7, -1.0), (8, -2.0)]  # the reference picks 8 where ours picked 9
    tie = compare_tokens(ours, parting, [0.0, 0.0, 0.0005], tolerance=1e-3)
    apart = compare_tokens(ours, parting, [0.0, 0.0, 0.7], tolerance=1e-3)
    assert tie.first_difference == 2 and tie.is_near_tie and tie.passed
    assert abs(tie.max_logprob_diff - 0.0004) < 1e-9, "compared up to and at the first difference"
    assert apart.first_difference == 2 and not apart.is_near_tie and not apart.passed
    drifted = compare_tokens(ours, [(5, -0.5), (7, -1.2), (9, -2.0)], [0.0] * 3, tolerance=1e-3)
    assert drifted.first_difference is None and abs(drifted.max_logprob_diff - 0.2) < 1e-9 and not drifted.passed
    same = compare_tokens(ours, list(ours), [0.0] * 3, tolerance=1e-3)
    assert same.first_difference is None and same.max_logprob_diff == 0.0 and same.passed
