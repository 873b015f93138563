"""The request contract: one set of bounds for every edge and the engine, and stored sampling that loads back,
rows written before a field existed included."""

from __future__ import annotations

import pytest

from servelab.config import DecodingConfig
from servelab.request import RequestError, SamplingParams, check_num_choices, choice_seed

LIMITS = DecodingConfig(max_new_tokens=64, max_context_tokens=256)


def test_sampling_round_trips_through_its_stored_form() -> None:
    params = SamplingParams(max_new_tokens=5, temperature=0.7, seed=3, stop=("x",), presence_penalty=-1.5,
                            frequency_penalty=0.25, logprobs=4)
    assert SamplingParams.from_stored(params.to_stored()) == params


def test_a_row_stored_before_penalties_and_logprobs_existed_loads_asking_for_neither() -> None:
    old = {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": ["\n"],
           "ignore_eos": False}
    params = SamplingParams.from_stored(old)
    assert params.stop == ("\n",) and not params.has_penalties and params.logprobs is None


@pytest.mark.parametrize(("field", "value", "named"), [
    ("presence_penalty", 2.5, "presence_penalty must be between -2 and 2"),
    ("frequency_penalty", -2.01, "frequency_penalty must be between -2 and 2"),
    ("logprobs", 21, "logprobs (alternatives per token) must be between 0 and 20"),
    ("logprobs", -1, "logprobs"),
])
def test_out_of_bounds_sampling_is_refused_naming_the_field(field: str, value, named: str) -> None:
    SamplingParams(**{field: 2.0 if "penalty" in field else 20}).check(LIMITS)  # the bound itself is allowed
    with pytest.raises(RequestError, match=named.replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(**{field: value}).check(LIMITS)


def test_n_is_bounded_by_the_configs_batch_and_each_choice_has_its_own_seed() -> None:
    check_num_choices(8, max_batch_size=8)
    with pytest.raises(RequestError, match="n must be between 1 and 8"):
        check_num_choices(9, max_batch_size=8)
    with pytest.raises(RequestError, match="n must be between 1 and 128"):
        check_num_choices(129, max_batch_size=1000)
    assert [choice_seed(5, i) for i in range(3)] == [5, 6, 7] and choice_seed(None, 2) is None
    assert choice_seed(2**63 - 1, 1) == 0, "wraps within the seed's bounds"


def test_stored_sampling_leaves_out_newer_fields_at_their_default_so_an_older_worker_reads_it() -> None:
    """A rolling deploy upgrades the API first: a request that uses only older fields stores only those."""
    from servelab.request import STORED_ALWAYS

    params = SamplingParams(max_new_tokens=5, temperature=0.5, stop=("x",))
    assert set(params.to_stored()) == STORED_ALWAYS and params.to_stored()["stop"] == ["x"]
    assert SamplingParams.from_stored(SamplingParams().to_stored()) == SamplingParams()
    used = SamplingParams(stop_token_ids=(3, 4), min_p=0.1)
    assert set(used.to_stored()) == STORED_ALWAYS | {"stop_token_ids", "min_p"}
    assert used.to_stored()["stop_token_ids"] == [3, 4] and SamplingParams.from_stored(used.to_stored()) == used
