"""The scheduler on its own, on a fake clock: what it reads, when a batch starts, who joins, who is preempted,
and that no request is in two places or started more often than it was preempted. No server, no model."""

from __future__ import annotations

import random
from dataclasses import replace

from servelab.scheduler.policy import BatchPolicy
from servelab.scheduler.scheduler import IDLE_READ_S, NextRead, Scheduler
from servelab.scheduler.state import ScheduledStatus
from tests.scheduler.test_policy import cand


def run_plan(s: Scheduler, plan) -> None:
    """What a runner does with a plan, as far as the scheduler sees: a token for every row whose step samples."""
    for r in plan.decode:
        r.token_ids.append(7)
    for r, n in plan.chunks:
        if n == r.num_pending_tokens:
            r.token_ids.append(7)
    s.update(plan)

WINDOW = BatchPolicy(max_batch_size=3, max_wait_ms=50, max_batch_tokens=10_000)
CONTINUOUS = replace(WINDOW, policy="continuous")


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_an_idle_scheduler_blocks_for_a_whole_batch_then_waits_out_the_window() -> None:
    s = Scheduler(WINDOW)
    assert s.next_read(0.0) == NextRead(3, IDLE_READ_S)
    assert s.schedule(0.0).is_empty
    s.add([cand(0)])
    assert s.schedule(10.0).is_empty  # the window opens at 10.0
    read = s.next_read(10.03)
    assert read.count == 2 and abs(read.block_s - 0.02) < 1e-9  # two more rows, 20 ms left
    plan = s.schedule(10.05)
    assert ids(plan.admitted) == ["r0"] and ids(plan.rows) == ["r0"] and plan.preempted == ()
    assert s.waiting == [] and s.running[0].status is ScheduledStatus.RUNNING


def test_a_full_window_batch_starts_at_once_and_runs_closed() -> None:
    s = Scheduler(WINDOW)
    s.add([cand(i) for i in range(5)])
    assert s.next_read(0.0) is None  # nothing to wait for: the batch is full
    plan = s.schedule(0.0)
    assert ids(plan.admitted) == ["r0", "r1", "r2"]
    assert s.next_read(0.0) is None  # closed: nothing is read while it runs
    s.finish(["r1"])
    plan = s.schedule(1.0)
    assert plan.admitted == () and ids(plan.rows) == ["r0", "r2"]  # r3 waits for the batch to end
    s.finish(["r0", "r2"])
    assert s.schedule(1.0).is_empty  # two rows of three: the window opens now
    assert ids(s.schedule(1.05).admitted) == ["r3", "r4"]


def test_continuous_reads_for_its_free_rows_and_newcomers_join_at_the_next_step() -> None:
    s = Scheduler(CONTINUOUS)
    s.add([cand(0, interactive=False)])
    assert ids(s.schedule(0.0).admitted) == ["r0"]  # no window under continuous
    assert s.next_read(0.0) == NextRead(2, None)  # running: never block
    s.add([cand(1, interactive=False), cand(2, interactive=False)])
    plan = s.schedule(0.01)
    assert ids(plan.admitted) == ["r1", "r2"] and ids(plan.rows) == ["r0", "r1", "r2"]
    assert s.next_read(0.02) == NextRead(1, None, is_interactive_only=True)  # full: only interactive may come in


def test_an_interactive_request_preempts_the_newest_bulk_row_which_waits_again_claimed() -> None:
    s = Scheduler(replace(CONTINUOUS, min_bulk_rows=0))
    s.add([cand(i, interactive=False) for i in range(3)])
    for r in s.schedule(0.0).admitted:
        r.is_claimed = True  # what the worker's claim does
    s.add([cand(9)])
    plan = s.schedule(1.0)
    assert [p.request.request_id for p in plan.preempted] == ["r2"] and ids(plan.admitted) == ["r9"]
    victim = plan.preempted[0].request
    assert plan.preempted[0].cause == "priority"
    assert victim.status is ScheduledStatus.PREEMPTED and victim.num_preemptions == 1 and victim.is_claimed
    assert ids(s.running) == ["r0", "r1", "r9"] and ids(s.waiting) == ["r2"]
    assert s.next_read(1.0) == NextRead(1, None, is_interactive_only=True)  # full again: only interactive gets in
    s.finish(["r9"])
    assert ids(s.schedule(2.0).admitted) == ["r2"]  # the preempted row goes back in


def test_finish_takes_requests_from_either_set_in_the_order_asked() -> None:
    s = Scheduler(CONTINUOUS)
    s.add([cand(0), cand(1)])
    s.schedule(0.0)
    s.add([cand(2)])
    ended = s.finish(["r2", "missing", "r0"])
    assert ids(ended) == ["r2", "r0"] and all(r.status is ScheduledStatus.FINISHED for r in ended)
    assert ids(s.running) == ["r1"] and s.waiting == []


def test_a_stopping_scheduler_admits_nothing_and_decodes_what_runs() -> None:
    s = Scheduler(CONTINUOUS)
    s.add([cand(0)])
    s.schedule(0.0)
    s.add([cand(1)])
    plan = s.schedule(1.0, admit=False)
    assert plan.admitted == () and ids(plan.rows) == ["r0"] and ids(s.waiting) == ["r1"]


def test_kv_cache_usage_is_the_running_rows_room_over_the_budget() -> None:
    s = Scheduler(replace(CONTINUOUS, max_batch_tokens=100))
    s.add([cand(0, prompt=10, new=10), cand(1, prompt=20, new=5)])
    s.schedule(0.0)
    assert s.kv_cache_usage == 2 * 25 / 100


def test_random_arrivals_and_endings_never_put_a_request_in_two_places() -> None:
    """A seeded simulation: requests arrive, rows end, interactive ones preempt; at every step each request is
    in one set, and it was prefilled once more than it was preempted, never more."""
    rng = random.Random(7)
    for policy in (WINDOW, CONTINUOUS, replace(CONTINUOUS, min_bulk_rows=0, max_batch_size=4)):
        s, prefilled, preempted, i = Scheduler(policy), {}, {}, 0
        for step in range(400):
            now = step * 0.01
            for _ in range(rng.choice([0, 0, 1, 2])):
                s.add([cand(i, prompt=rng.randint(1, 50), interactive=rng.random() < 0.3)])
                i += 1
            plan = s.schedule(now)
            for r in plan.admitted:
                prefilled[r.request_id] = prefilled.get(r.request_id, 0) + 1
                r.is_claimed = True
            for p in plan.preempted:
                preempted[p.request.request_id] = preempted.get(p.request.request_id, 0) + 1
            running, waiting = set(ids(s.running)), set(ids(s.waiting))
            assert not running & waiting
            assert ids(plan.rows) == ids(s.running)
            run_plan(s, plan)
            for rid, n in prefilled.items():
                assert n == preempted.get(rid, 0) + (rid in running or rid not in waiting), rid
            s.finish([r for r in ids(s.running) if rng.random() < 0.2])
        assert sum(prefilled.values()) > 50, "the simulation ran too little to mean anything"


def test_it_holds_a_request_while_it_waits_or_runs_and_not_after_it_ends() -> None:
    s = Scheduler(CONTINUOUS)
    s.add([cand(0)])
    assert s.holds("r0") and not s.holds("r1")
    s.schedule(0.0)
    assert s.holds("r0")
    s.finish(["r0"])
    assert not s.holds("r0")


