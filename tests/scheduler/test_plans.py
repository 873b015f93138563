"""The scheduler's plans over a real paged pool, with no model: how many tokens each row computes (chunk budgets),
the blocks it takes (block-table growth, window eviction), who gives blocks back when the pool runs out and in what
order, an interactive request preempting bulk rows when generated tokens fill the pool, and a seeded simulation in
which no request is in two sets, no block is held twice unless shared by prefix, and every block comes back."""

from __future__ import annotations

import random
from dataclasses import replace

from servelab.scheduler.blocks import BlockManager
from servelab.scheduler.policy import BatchPolicy
from servelab.scheduler.scheduler import Scheduler, SchedulerOutput
from servelab.scheduler.state import ScheduledStatus
from tests.scheduler.test_policy import cand
from tests.scheduler.test_scheduler import ids, run_plan

PAGED = BatchPolicy(max_batch_size=8, max_wait_ms=0, max_batch_tokens=1 << 20, policy="continuous", min_bulk_rows=0,
                    max_prefill_tokens=8, paged=True)


def scheduler(num_blocks: int = 64, block_size: int = 4, *, prefix_caching: bool = False, window=None,
              **policy) -> Scheduler:
    pool = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching, window=window,
                        chunk_tokens=policy.get("max_prefill_tokens", PAGED.max_prefill_tokens))
    return Scheduler(replace(PAGED, **policy), pool)


def step(s: Scheduler, now: float = 0.0) -> SchedulerOutput:
    """One plan, run as a runner would (a token for each row whose step samples), and its finished rows gone."""
    plan = s.schedule(now)
    run_plan(s, plan)
    s.finish([r.request_id for r in s.running if r.num_generated_tokens >= r.max_new_tokens])
    return plan


def chunks(plan: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in plan.chunks]


def test_a_long_prompt_is_computed_in_chunks_within_the_steps_token_budget() -> None:
    s = scheduler()
    s.add([cand(0, prompt=20, new=5)])
    assert chunks(step(s)) == [("r0", 8)]
    assert chunks(step(s)) == [("r0", 8)]
    last = step(s)
    assert chunks(last) == [("r0", 4)] and s.running[0].num_generated_tokens == 1  # the prompt completes: a token
    s.add([cand(1, prompt=20, new=5)])
    plan = step(s)
    # r0 decodes one token; the newcomer's first chunk takes the rest of the budget
    assert ids(plan.decode) == ["r0"] and chunks(plan) == [("r1", 7)]


def test_newcomers_joining_a_running_batch_wait_when_the_budget_is_spent() -> None:
    s = scheduler(max_prefill_tokens=4)
    s.add([cand(0, prompt=3, new=9)])
    step(s)
    s.add([cand(1, prompt=3), cand(2, prompt=3)])
    plan = step(s)
    assert ids(plan.decode) == ["r0"] and chunks(plan) == [("r1", 3)] and ids(plan.admitted) == ["r1"]
    assert ids(s.waiting) == ["r2"]  # no budget left this step: no blocks taken for it either


def test_a_decoding_row_takes_a_block_when_its_next_token_crosses_into_one() -> None:
    s = scheduler(block_size=4)
    s.add([cand(0, prompt=7, new=9)])
    step(s)
    r0 = s.running[0]
    assert len(r0.block_table) == 2 and r0.num_computed_tokens == 7  # 7 prompt columns; its token 8 not yet computed
    step(s)
    assert len(r0.block_table) == 2  # column 8 fills the second block
    step(s)
    assert len(r0.block_table) == 3 and r0.num_computed_tokens == 9


def test_when_the_pool_runs_out_mid_decode_bulk_rows_give_their_blocks_back_newest_first() -> None:
    s = scheduler(num_blocks=8, block_size=4, max_batch_size=4)
    s.add([cand(0, prompt=3, new=20, interactive=False), cand(2, prompt=3, new=20, interactive=False)])
    step(s)
    s.add([cand(1, prompt=3, new=20, interactive=True), cand(3, prompt=3, new=20, interactive=True)])
    causes = []
    for _ in range(40):
        plan = step(s)
        causes += [(p.request.request_id, p.cause) for p in plan.preempted]
        if len(causes) >= 3:
            break
    assert causes[:3] == [("r2", "pool"), ("r0", "pool"), ("r3", "pool")]  # bulk first, each newest first
    r2 = next(r for r in s.waiting if r.request_id == "r2")
    assert r2.status is ScheduledStatus.PREEMPTED and r2.num_computed_tokens == 0 and r2.block_table == []
    assert r2.num_generated_tokens > 0 and r2.num_recomputed_tokens > r2.num_prompt_tokens  # its tokens are kept
    s.finish(["r1"])  # room returns: the preempted rows recompute prompt and generated tokens, in chunks
    plan = step(s)
    returning = dict(chunks(plan))
    assert returning and all(r in ("r0", "r2", "r3") for r in returning)


def test_an_interactive_request_preempts_bulk_rows_when_generated_tokens_fill_the_pool() -> None:
    """The pool is full of generated tokens while the batch is below max_batch_size: the interactive newcomer is
    counted in the pool's real free blocks, so the newest bulk row gives way at once (not when a row finishes)."""
    s = scheduler(num_blocks=12, block_size=4, max_batch_size=8)
    s.add([cand(i, prompt=4, new=40, interactive=False) for i in range(3)])
    while s.pool.num_free_blocks > 3:  # decode until generated tokens fill the pool (3 rows of 8 possible)
        step(s)
    assert len(s.running) == 3 and not s.waiting
    s.add([cand(9, prompt=12, new=4, interactive=True)])  # needs 4 blocks (12 tokens and its first): 3 are free
    plan = step(s)
    assert [(p.request.request_id, p.cause) for p in plan.preempted] == [("r2", "priority")]
    assert ids(plan.admitted) == ["r9"] and chunks(plan) == [("r9", 8 - 2)]  # beside r0 and r1's decode tokens


def test_with_a_window_a_decoding_row_holds_no_more_than_its_sinks_and_window() -> None:
    s = scheduler(block_size=4, window=(1, 2), max_prefill_tokens=8)
    s.add([cand(0, prompt=6, new=60)])
    held = []
    for _ in range(40):
        step(s)
        held.append(len(s.running[0].block_table))
    r0 = s.running[0]
    assert max(held) <= 1 + 2 + 1 and r0.num_evicted_blocks > 5
    assert s.pool.num_used_blocks == len(r0.block_table)  # the evicted blocks went back to the pool


def test_a_window_batch_keeps_the_rows_that_wait_for_a_shared_prefix_and_runs_them_once_it_is_cached() -> None:
    # NOTE: a bulk job's lines share their opening blocks: the first computes them, the others wait for them to be
    # cached. Under `window` they still belong to the batch that formed: they join it as soon as the blocks are
    # cached, never after the first row's last token (a closed batch of one)
    s = scheduler(prefix_caching=True, policy="window", max_prefill_tokens=64, max_batch_size=4)
    s.add([cand(i, prompt=9, new=6, interactive=False) for i in range(4)])
    first = step(s)
    assert ids(first.admitted) == ["r0"] and ids(s.waiting) == ["r1", "r2", "r3"]
    second = step(s)  # r0's two full blocks are cached: the rest of the batch joins, computing only its last token
    assert ids(second.admitted) == ["r1", "r2", "r3"] and chunks(second) == [("r1", 1), ("r2", 1), ("r3", 1)]
    assert all(r.num_cached_tokens == 8 for r in second.admitted)
    s.add([cand(9, prompt=9, new=6, interactive=False)])
    while s.running:
        assert "r9" not in ids(step(s).admitted)  # the batch stays closed to requests that came after it formed
    assert ids(step(s).admitted) == ["r9"]


def test_a_seeded_simulation_keeps_every_request_in_one_set_and_every_block_accounted_for() -> None:
    rng = random.Random(11)
    prompts = [[rng.randint(1, 9) for _ in range(rng.randint(1, 24))] for _ in range(5)]
    num_preempted = {"pool": 0, "priority": 0}
    for policy in (dict(policy="window"), dict(), dict(max_batch_size=3)):
        for window in (None, (1, 2)):
            s = scheduler(num_blocks=24, block_size=4, prefix_caching=True, window=window, **policy)
            num_planned, i, n = 0, 0, 0
            while n < 200 or (s.running or s.waiting) and n < 5000:  # arrivals for 200 steps, then drained
                n += 1
                if n < 200:
                    for _ in range(rng.choice([0, 0, 1, 2])):
                        head = rng.choice(prompts)  # shared heads: prefix hits
                        r = cand(i, prompt=1, new=rng.randint(1, 12), interactive=rng.random() < 0.3)
                        r.token_ids = head + [rng.randint(1, 9) for _ in range(rng.randint(0, 6))]
                        r.request = replace(r.request, prompt_token_ids=tuple(r.token_ids))
                        s.add([r])
                        i += 1
                plan = s.schedule(n * 0.01)
                _check(s, plan)
                num_planned += len(plan.rows)
                for p in plan.preempted:
                    num_preempted[p.cause] += 1
                run_plan(s, plan)
                s.finish([r.request_id for r in s.running
                          if r.num_generated_tokens >= r.max_new_tokens or rng.random() < 0.02])
            assert not s.running and not s.waiting, "every request ends"
            assert s.pool.num_free_blocks == s.pool.num_blocks, "every block comes back to the pool"
            assert num_planned > 300 and i > 100, "the simulation ran too little to mean anything"
    assert all(num_preempted.values()), f"some preemption never happened: {num_preempted}"


def _check(s: Scheduler, plan: SchedulerOutput) -> None:
    running, waiting = ids(s.running), ids(s.waiting)
    assert not set(running) & set(waiting) and len(set(running)) == len(running)
    assert all(r.status is ScheduledStatus.RUNNING for r in s.running)
    assert all(r.status in (ScheduledStatus.WAITING, ScheduledStatus.PREEMPTED) for r in s.waiting)
    assert set(ids(plan.rows)) <= set(running) and len(set(ids(plan.rows))) == len(plan.rows)
    assert all(r.num_pending_tokens == 1 for r in plan.decode)
    assert all(0 < n <= r.num_pending_tokens for r, n in plan.chunks)
    budget = max(s.policy.max_prefill_tokens - len(plan.decode), 1)
    assert sum(n for _, n in plan.chunks) <= budget
    bs = s.pool.block_size
    for r in plan.rows:  # the row's blocks hold every column the step writes
        n = 1 if r in plan.decode else dict((id(c), k) for c, k in plan.chunks)[id(r)]
        assert r.num_logical_blocks * bs >= r.num_computed_tokens + n
    holders: dict[int, list[tuple[object, int]]] = {}
    sink = s.pool.window[0] if s.pool.window else 0
    for r in s.running:
        for index, block in enumerate(r.block_table):  # NOTE: its logical block: past the sinks, the evicted ones skipped
            holders.setdefault(block, []).append((r, index if index < sink else index + r.num_evicted_blocks))
    for block, held in holders.items():
        if len(held) > 1:  # shared: the same prefix block, found by its hash, in every holder
            assert block in s.pool._hash_of, f"block {block} is held by two rows and is no cached prefix"
            assert len({index for _, index in held}) == 1
    assert len(holders) == s.pool.num_used_blocks
