"""The fair share of a config's bulk queue, alone: deficit round robin over jobs, weighted per tenant, exact."""

from __future__ import annotations

from fractions import Fraction

import pytest

from servelab.jobs.share import BulkJob, ShareState, quanta, share_round

A = frozenset({"a"})


def job(job_id: str, tenant: str, configs: frozenset[str] = A, max_lines: int = 5_000) -> BulkJob:
    return BulkJob(job_id, tenant, configs, max_lines)


def test_two_tenants_of_equal_weight_split_the_free_room_line_by_line() -> None:
    r = share_round([job("big", "t1"), job("small", "t2")], weights={}, free={"a": 11}, state=ShareState())
    assert r.rooms == {"big": 6, "small": 5}
    assert r.visits == (("big", 1), ("small", 1)) * 5 + (("big", 1),)
    assert r.state.next_job_id == "small", "the next round starts after the job given the last line"
    again = share_round([job("big", "t1"), job("small", "t2")], weights={}, free={"a": 3}, state=r.state)
    assert list(again.rooms) == ["small", "big"] and again.rooms == {"small": 2, "big": 1}


def test_a_heavier_tenant_gets_lines_in_proportion_to_its_weight() -> None:
    r = share_round([job("l", "t1"), job("s", "t2")], weights={"t1": 3.0, "t2": 1.0}, free={"a": 10},
                    state=ShareState())
    # passes: l 3, s 1 | l 3, s 1 | l gets the 2 left of its 3 and is owed 1
    assert r.rooms == {"l": 8, "s": 2}
    assert r.visits == (("l", 3), ("s", 1), ("l", 3), ("s", 1), ("l", 2))
    assert r.state.deficits == {"l": Fraction(1)} and r.state.next_job_id == "s"


def test_a_tenants_share_is_split_among_its_jobs() -> None:
    jobs = [job("a1", "many"), job("a2", "many"), job("b", "one")]
    assert quanta(jobs, {}) == {"a1": 1, "a2": 1, "b": 2}
    assert share_round(jobs, weights={}, free={"a": 8}, state=ShareState()).rooms == {"a1": 2, "a2": 2, "b": 4}


def test_a_full_queue_gives_nothing_and_banks_no_credit() -> None:
    state = ShareState({"l": Fraction(1, 2)}, "s")
    r = share_round([job("l", "t1"), job("s", "t2")], weights={}, free={"a": 0}, state=state)
    assert r.rooms == {} and r.state == state


def test_deficits_carry_over_so_fractional_weights_are_exact_over_rounds() -> None:
    jobs = [job("l", "t1"), job("s", "t2")]
    state, totals = ShareState(), {"l": 0, "s": 0}
    for _ in range(100):  # the worker frees 5 lines between two rounds
        r = share_round(jobs, weights={"t1": 1.0, "t2": 1.5}, free={"a": 5}, state=state)
        state = r.state
        for job_id, n in r.rooms.items():
            totals[job_id] += n
    assert totals == {"l": 200, "s": 300}


def test_long_run_shares_stay_within_one_quantum_of_the_weights_when_rounds_are_cut_short() -> None:
    jobs = [job("l", "t1"), job("s", "t2")]
    state, totals = ShareState(), {"l": 0, "s": 0}
    for i in range(1, 301):
        r = share_round(jobs, weights={"t1": 1.0, "t2": 1.5}, free={"a": 4}, state=state)
        state = r.state
        for job_id, n in r.rooms.items():
            totals[job_id] += n
        given = totals["l"] + totals["s"]
        assert given == 4 * i
        assert abs(totals["s"] - given * Fraction(3, 5)) <= Fraction(3, 2) + 1, (i, totals)


def test_a_line_takes_room_in_every_config_its_job_may_name() -> None:
    jobs = [job("on-a", "t1", frozenset({"a"})), job("on-b", "t2", frozenset({"b"})),
            job("new", "t3", frozenset())]  # nothing read yet: its lines take room in each config with room
    r = share_round(jobs, weights={}, free={"a": 3, "b": 6}, state=ShareState())
    # pass 1: on-a 1 (a 2), on-b 1 (b 5), new 1 (a 1, b 4); pass 2: on-a 1 (a 0), on-b 1 (b 3), new 1 in b only
    # (b 2); pass 3: on-a has no room, on-b 1 (b 1), new 1 (b 0)
    assert r.rooms == {"on-a": 2, "on-b": 3, "new": 3}


def test_a_full_config_never_holds_back_a_job_that_named_no_config_yet() -> None:
    r = share_round([job("y", "t", frozenset(), max_lines=256)], weights={}, free={"a": 0, "b": 64},
                    state=ShareState())
    assert r.rooms == {"y": 64}, "its probe takes room only in the configs that have some"
    assert share_round([job("y", "t", frozenset())], weights={}, free={"a": 0, "b": 0}, state=ShareState()).rooms == {}
    assert share_round([job("y", "t", frozenset(), max_lines=9)], weights={}, free={}, state=ShareState()).rooms == \
        {"y": 9}, "nothing bounded: nothing to share"
    r = share_round([job("on-a", "t1"), job("y", "t2", frozenset())], weights={}, free={"a": 0, "b": 2},
                    state=ShareState())
    assert r.rooms == {"y": 2}, "a job that named a full config waits; the probe does not"


def test_max_lines_caps_a_job_and_its_room_goes_to_the_others() -> None:
    r = share_round([job("l", "t1", max_lines=2), job("s", "t2"), job("done", "t3", max_lines=0)], weights={},
                    free={"a": 9}, state=ShareState())
    assert r.rooms == {"l": 2, "s": 7}


def test_jobs_whose_configs_are_unbounded_read_their_whole_cap() -> None:
    r = share_round([job("x", "t1", frozenset({"unbounded"}), max_lines=500), job("s", "t2")], weights={},
                    free={"a": 4}, state=ShareState())
    assert r.rooms == {"x": 500, "s": 4}


def test_an_ended_job_is_dropped_and_the_round_starts_at_the_first_job() -> None:
    state = ShareState({"gone": Fraction(1, 2)}, "gone")
    r = share_round([job("l", "t1"), job("s", "t2")], weights={}, free={"a": 3}, state=state)
    assert list(r.rooms) == ["l", "s"] and r.rooms == {"l": 2, "s": 1}
    assert "gone" not in r.state.deficits


def test_a_tenant_weight_must_be_positive() -> None:
    with pytest.raises(AssertionError, match="positive"):
        share_round([job("l", "t1")], weights={"t1": 0.0}, free={"a": 3}, state=ShareState())
