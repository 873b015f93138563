"""The scheduler: a worker's waiting and running requests and its KV pool, and at each step the plan.

Pure, in the shape of vLLM v1's and nano-vllm's schedulers: no Redis, no SQL, no torch, no clock of its own
(time and arrivals are handed in). It owns the paged pool's bookkeeping (blocks.py) and is the only place that
decides admission, preemption, chunking and which blocks a request takes or gives back; a runner executes its plan
and nothing else. The worker is the shell around it: it hands in the requests it read (`add`), asks what to read
next (`next_read`), runs each plan on a runner, reports it done (`update`), and hands back the rows that ended
(`finish`). The admission rules (window, continuous, the order of service) are BatchPolicy's.
Does not know streams, the store, the runner or what a request's tokens mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

from servelab.scheduler.blocks import BlockManager, OutOfBlocks
from servelab.scheduler.policy import BatchPolicy
from servelab.scheduler.state import ScheduledRequest, ScheduledStatus

IDLE_READ_S = 1.0  # how long an idle worker blocks on its streams before it looks again (a stop, a take-over)
PreemptionCause = Literal["priority", "pool"]


@dataclass(frozen=True)
class NextRead:
    """What the worker reads from its streams before the next plan."""

    count: int
    block_s: float | None  # None: do not wait (rows are running)
    is_interactive_only: bool = False  # the batch is full: only an interactive request can get in (by preemption)


@dataclass(frozen=True)
class Preemption:
    """A running row the plan took out unfinished: why, and the computed tokens it lost (computed again when it
    returns)."""

    request: ScheduledRequest
    cause: PreemptionCause
    num_lost_tokens: int


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan. Every row of `decode` computes one token (its last) and samples the next; every row of
    `chunks` computes its next `n` tokens from its num_computed_tokens (a prompt's chunk, or a returning row's
    prompt and generated tokens), and samples a token when the chunk completes them. Rows keep the block tables the
    plan gave them until `update`. `admitted` rows joined the batch this step (the fresh ones are for the worker to
    claim), `preempted` left it unfinished, with the cause; they keep their tokens and recompute them when they
    return. The figures are the pool's after the plan: what the runner reports for the step."""

    decode: tuple[ScheduledRequest, ...] = ()
    chunks: tuple[tuple[ScheduledRequest, int], ...] = ()
    admitted: tuple[ScheduledRequest, ...] = ()
    preempted: tuple[Preemption, ...] = ()
    pool: BlockManager | None = None  # the pool the tables index: a runner keeps one set of KV tensors per pool
    num_expected_blocks: int = 0  # blocks the running rows will reach by their end (the runner grows its tensors once)
    num_used_blocks: int = 0
    num_shared_blocks: int = 0
    num_prefix_query_tokens: int = 0  # first admissions' prompt tokens looked up in the prefix cache, and found
    num_prefix_hit_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not (self.decode or self.chunks or self.preempted)

    @property
    def rows(self) -> tuple[ScheduledRequest, ...]:
        """The rows that compute in this step: decode rows, then chunk rows."""
        return (*self.decode, *(r for r, _ in self.chunks))

    def preempted_by(self, cause: PreemptionCause) -> list[Preemption]:
        return [p for p in self.preempted if p.cause == cause]

    def without(self, request_ids: set[str]) -> SchedulerOutput:
        """The plan less these rows (their claim failed: they left the scheduler before the step ran)."""
        keep = lambda r: r.request_id not in request_ids  # noqa: E731
        return SchedulerOutput(tuple(filter(keep, self.decode)), tuple(c for c in self.chunks if keep(c[0])),
                               tuple(filter(keep, self.admitted)), self.preempted, self.pool, self.num_expected_blocks,
                               self.num_used_blocks, self.num_shared_blocks, self.num_prefix_query_tokens,
                               self.num_prefix_hit_tokens)


class Scheduler:
    def __init__(self, policy: BatchPolicy, pool: BlockManager | None = None) -> None:
        """pool: the paged KV cache's bookkeeping, when the runner serves from one: admission then counts the blocks a
        newcomer takes (its cached prefix shared) against the blocks free, and prompts are computed in chunks."""
        assert (pool is not None) == policy.paged, "a paged pool and a paged policy go together"
        self.policy, self.pool = policy, pool
        self.waiting: list[ScheduledRequest] = []  # in order of arrival; the policy orders them for service
        self.running: list[ScheduledRequest] = []  # in order of admission: the newest last (preempted first)
        self._first_seen_s: float | None = None  # when an idle scheduler first had a batch to form (the window)
        # NOTE: a window batch's rows that formed it but wait (for a prefix another row computes, or for blocks): they
        # belong to the closed batch and join it as soon as they can
        self._formed: set[str] = set()

    # --- what comes in and goes out ---

    def add(self, requests: list[ScheduledRequest]) -> None:
        for r in requests:
            assert r.status is ScheduledStatus.WAITING, f"{r.request_id} is added while {r.status.name}"
        self.waiting += requests

    def finish(self, request_ids: list[str]) -> list[ScheduledRequest]:
        """Requests that ended (finished, cancelled, failed, or served elsewhere) leave, waiting or running, and give
        their blocks back (their computed prompt blocks stay cached); -> their states, in the order asked (ids this
        scheduler does not hold are skipped)."""
        wanted = set(request_ids)
        gone = {r.request_id: r for r in [*self.running, *self.waiting] if r.request_id in wanted}
        self.running = [r for r in self.running if r.request_id not in wanted]
        self.waiting = [r for r in self.waiting if r.request_id not in wanted]
        self._formed -= wanted
        for r in gone.values():
            if self.pool is not None:
                self.pool.free(r)
            r.status = ScheduledStatus.FINISHED
        return [gone[i] for i in request_ids if i in gone]

    def update(self, plan: SchedulerOutput) -> None:
        """The plan ran: each row's cache holds the tokens it computed (the runner appended the tokens it sampled),
        and the full blocks they completed are keyed for prefix sharing."""
        for r in plan.decode:
            r.num_computed_tokens += 1
        for r, n in plan.chunks:
            r.num_computed_tokens += n
        if self.pool is not None:
            for r in plan.rows:
                if r.status is ScheduledStatus.RUNNING:
                    self.pool.commit(r, r.token_ids[:r.num_computed_tokens])

    def holds(self, request_id: str) -> bool:
        """Whether a request of this id waits or runs here."""
        return any(r.request_id == request_id for r in [*self.running, *self.waiting])

    # --- the plan ---

    def next_read(self, now_s: float) -> NextRead | None:
        """How many entries the worker reads before the next plan, and how long it may block; None: none."""
        if self.running:
            if not self.policy.is_continuous:
                return None  # a window batch is closed until its last row ends
            free = self.policy.max_batch_size - len(self.running) - len(self.waiting)
            if free > 0:
                return NextRead(free, None)
            if not any(r.is_interactive for r in self.waiting):
                return NextRead(1, None, is_interactive_only=True)
            return None
        batch, rest = self._forming(now_s)
        if batch and self.policy.is_closed(batch, rest, first_seen_s=self._first_seen_s, now_s=now_s):
            return None
        block_s = self.policy.wait_left_s(first_seen_s=self._first_seen_s, now_s=now_s) if batch else IDLE_READ_S
        return NextRead(self.policy.max_batch_size - len(batch), block_s)

    def schedule(self, now_s: float, *, admit: bool = True) -> SchedulerOutput:
        """The plan for one step: which rows compute how many tokens in which blocks, who joins, who leaves.

        Who may join: when nothing runs, a batch forms from the waiting requests in order of service (interactive
        first, then higher priority, then age) within max_batch_size and the KV room; under `window` it starts when
        it is full, when the next request in order does not fit, or max_wait_ms after the scheduler first saw it,
        and then runs closed until its last row ends; under `continuous` it starts at once. While rows run under
        `continuous`, the running bulk rows that must leave for the interactive request at the head of the queue to
        fit (counted in the pool's real free blocks, what the leavers free included) are preempted first (the
        newest first, each at most once, bulk keeping `min_bulk_rows`), and then waiting requests join while rows
        and room allow; a bulk newcomer waits while an interactive row decodes. A retried request (it may have
        crashed its worker) runs alone. With admit=False (a stopping worker) only rows preempted from this batch
        return.
        What each row computes, with a pool: every decoding row takes a block for its next token (with a window,
        first giving back the blocks its token no longer sees); when the pool has none, the running row that gives
        way first (bulk before interactive, the newest first) gives its blocks back and waits again, keeping its
        tokens. Then rows still prefilling take the next chunk of their prompt, in order of admission, within the
        step's token budget (max_prefill_tokens less the decode rows); newcomers take their blocks (their cached
        prefix shared; each running row keeps one block in reserve for its next token) and their first chunk while
        the budget lasts (a batch that forms admits all its rows, its prompts computed over the next steps). A
        newcomer whose prompt starts with blocks another row is still prefilling waits for them to be cached; under
        `window`, a row of the batch that waits so (or for blocks) still belongs to it and joins it once it can.
        Without a pool, newcomers are prefilled whole and running rows decode one token.
        """
        plan = _Plan()
        joining = self._joining(now_s, admit, plan)
        if joining is None:
            return SchedulerOutput()
        if self.pool is None:
            return self._dense(joining, plan)
        return self._paged(joining, plan, forming=not self.running)

    @property
    def kv_cache_usage(self) -> float:
        """The share of the KV room the running rows hold: the pool's blocks held, or (no pool) the policy's tokens."""
        if self.pool is not None:
            return self.pool.usage
        return self.policy.batch_tokens(self.running) / self.policy.max_batch_tokens

    # --- who joins ---

    def _joining(self, now_s: float, admit: bool, plan: _Plan) -> list[ScheduledRequest] | None:
        """The waiting requests that may join now, in order of service (the room is checked after); None: nothing
        runs and no batch is ready to start."""
        returning = [r for r in self.policy.order(self.waiting) if r.status is ScheduledStatus.PREEMPTED]
        if not self.running:
            batch, rest = self._forming(now_s) if admit else ([], [])
            if not batch or not self.policy.is_closed(batch, rest, first_seen_s=self._first_seen_s, now_s=now_s):
                return returning or None
            self._first_seen_s = None
            self._formed = {r.request_id for r in batch}
            return batch
        if not admit:
            return returning
        if not self.policy.is_continuous:  # NOTE: rows the pool pushed out, and rows that formed it, belong to this batch
            return [r for r in self.policy.order(self.waiting)
                    if r.status is ScheduledStatus.PREEMPTED or r.request_id in self._formed]
        fits = self._fits_after if self.pool is not None else None
        for victim in self.policy.victims(self.waiting, self.running, fits):
            victim.num_preemptions += 1
            self._preempt(victim, "priority", plan)
        return self.policy.select(self.waiting, self.running)[0]

    def _fits_after(self, rows: list[ScheduledRequest], head: ScheduledRequest,
                    victims: list[ScheduledRequest]) -> bool:
        """Whether the head of the queue fits beside these rows once the victims gave their blocks back (the pool's
        real free blocks, one kept in reserve for each row's next token)."""
        if not self.policy.fits(rows, head):
            return False
        free = self.pool.num_free_blocks + sum(self.pool.private_blocks(v) for v in victims)
        return self.pool.blocks_to_admit(head.token_ids) + len(rows) <= free

    def _forming(self, now_s: float) -> tuple[list[ScheduledRequest], list[ScheduledRequest]]:
        """Idle: the batch the waiting requests would form now, and the rest; the window opens at the first."""
        batch, rest = self.policy.select(self.waiting)
        if not batch:
            self._first_seen_s = None
        elif self._first_seen_s is None:
            self._first_seen_s = now_s
        return batch, rest

    # --- what each row computes ---

    def _dense(self, joining: list[ScheduledRequest], plan: _Plan) -> SchedulerOutput:
        decode = tuple(self.running)
        for r in joining:
            self._start(r, cached=0, plan=plan)
        return plan.output(decode, tuple((r, r.num_pending_tokens) for r in joining))

    def _paged(self, joining: list[ScheduledRequest], plan: _Plan, *, forming: bool) -> SchedulerOutput:
        pool = self.pool
        decode = self._decode_room([r for r in self.running if r.num_pending_tokens == 1], plan)
        budget = max(self.policy.max_prefill_tokens - len(decode), 1)
        chunks: list[tuple[ScheduledRequest, int]] = []
        for r in self.running:
            if r.num_pending_tokens > 1 and budget > 0:
                n = min(r.num_pending_tokens, budget)
                chunks.append((r, n))
                budget -= n
        prefilling = [r for r in self.running if r.num_pending_tokens > 1]
        reserve = len(self.running)
        for r in joining:
            if not forming and budget <= 0:
                break
            if pool.prefix_caching and any(_waits_for_prefix(pool.block_size, r.token_ids, o) for o in prefilling):
                continue  # NOTE: it takes its blocks once they are computed and shared, not computed twice
            if pool.blocks_to_admit(r.token_ids) + reserve > pool.num_free_blocks and reserve:
                break  # NOTE: in order: a younger request never overtakes an older one for the pool
            try:
                cached = pool.allocate(r, r.token_ids)
            except OutOfBlocks:
                break
            reserve += 1
            self._start(r, cached=cached, plan=plan)
            if r.num_pending_tokens > 1:
                prefilling.append(r)
            if budget > 0:
                n = min(r.num_pending_tokens, budget)
                chunks.append((r, n))
                budget -= n
        if pool.window is not None:
            chunks = self._window_chunks(chunks, bool(decode), plan)
        decode = [r for r in decode if r.status is ScheduledStatus.RUNNING]  # NOTE: a chunk's room may have taken one
        return plan.output(tuple(decode), tuple(chunks), pool=pool, expected=self._expected_blocks())

    def _decode_room(self, decoding: list[ScheduledRequest], plan: _Plan) -> list[ScheduledRequest]:
        """Each decoding row's next column has a block; when the pool runs out, the row that gives way first gives its
        blocks back and waits -> the rows that still decode."""
        for r in decoding:
            if r.status is not ScheduledStatus.RUNNING:
                continue
            # NOTE: a window's middle blocks go back first: the row's next token no longer sees them
            self.pool.evict(r, r.num_computed_tokens, cached_tokens=r.num_prompt_tokens)
            while r.status is ScheduledStatus.RUNNING:
                try:
                    self.pool.grow(r, r.num_computed_tokens + 1)
                    break
                except OutOfBlocks:
                    self._preempt(self._pool_victim(), "pool", plan)
        return [r for r in decoding if r.status is ScheduledStatus.RUNNING]

    def _window_chunks(self, chunks: list[tuple[ScheduledRequest, int]], decoding: bool, plan: _Plan
                       ) -> list[tuple[ScheduledRequest, int]]:
        """With a window, each chunk's row drops the blocks its first token no longer sees, then takes the blocks the
        chunk writes (admission took only the first chunks' blocks of a long prompt). Where the pool has too few, the
        chunk is cut to the blocks the row holds; with no row decoding, the row that gives way first gives its
        blocks back (as a decode step does), so something always moves -> the chunks that run."""
        out = []
        bs = self.pool.block_size
        for r, n in chunks:
            self.pool.evict(r, r.num_computed_tokens, cached_tokens=r.num_prompt_tokens)
            while r.status is ScheduledStatus.RUNNING:
                try:
                    self.pool.grow(r, r.num_computed_tokens + n)
                    break
                except OutOfBlocks:
                    room = r.num_logical_blocks * bs
                    if room > r.num_computed_tokens or decoding:
                        n = room - r.num_computed_tokens
                        break
                    self._preempt(self._pool_victim(), "pool", plan)
            if r.status is ScheduledStatus.RUNNING and n > 0:
                out.append((r, n))
        return [(r, n) for r, n in out if r.status is ScheduledStatus.RUNNING]  # NOTE: cut above, then a victim

    def _pool_victim(self) -> ScheduledRequest:
        """The running row that gives its blocks back first when the pool runs out: bulk before interactive, the
        newest first."""
        return min(reversed(self.running), key=lambda r: r.is_interactive)

    def _expected_blocks(self) -> int:
        """Blocks the running rows will hold by their end (a window's cap per row): the runner's tensors grow to
        them at once, not in the middle of the decode steps."""
        pool = self.pool
        cap = pool.row_cap or pool.num_blocks
        growth = sum(max(0, min(pool.blocks_for(r.num_columns), cap) - len(r.block_table)) for r in self.running)
        return pool.num_used_blocks + growth

    # --- moves between the sets ---

    def _start(self, r: ScheduledRequest, *, cached: int, plan: _Plan) -> None:
        """A waiting request joins the running batch, `cached` of its tokens found in the prefix cache."""
        self.waiting.remove(r)
        self._formed.discard(r.request_id)
        if r.status is ScheduledStatus.WAITING:  # its first admission: what its prompt found is its cached tokens
            r.num_cached_tokens = cached
            if self.pool is not None and self.pool.prefix_caching:
                plan.num_prefix_query_tokens += r.num_tokens
                plan.num_prefix_hit_tokens += cached
        r.num_computed_tokens, r.status = cached, ScheduledStatus.RUNNING
        self.running.append(r)
        plan.admitted.append(r)

    def _preempt(self, r: ScheduledRequest, cause: PreemptionCause, plan: _Plan) -> None:
        """A running row leaves unfinished: its blocks go back, it waits again (still claimed), keeping its tokens, and
        computes them again when it returns (a seeded row then samples what it would have)."""
        if self.pool is not None:
            self.pool.free(r)
        if cause == "pool":
            r.num_pool_preemptions += 1
        self.running.remove(r)
        plan.preempted.append(Preemption(r, cause, r.num_computed_tokens))
        r.num_recomputed_tokens += r.num_computed_tokens
        r.num_computed_tokens, r.status = 0, ScheduledStatus.PREEMPTED
        self.waiting.append(r)


@dataclass
class _Plan:
    """What schedule() collects while it decides, turned into the frozen SchedulerOutput at its end."""

    admitted: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Preemption] = field(default_factory=list)
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0

    def output(self, decode: tuple[ScheduledRequest, ...], chunks: tuple[tuple[ScheduledRequest, int], ...], *,
               pool: BlockManager | None = None, expected: int = 0) -> SchedulerOutput:
        return SchedulerOutput(decode, chunks, tuple(self.admitted), tuple(self.preempted), pool, expected,
                               pool.num_used_blocks if pool else 0, pool.num_shared_blocks if pool else 0,
                               self.num_prefix_query_tokens, self.num_prefix_hit_tokens)


def _waits_for_prefix(block_size: int, tokens: Sequence[int], other: ScheduledRequest) -> bool:
    """Whether a newcomer starts with full blocks another row is still prefilling: it waits for them to be cached (a
    bulk job's lines sharing a system prompt admitted together prefill it once, not once each)."""
    prompt = other.token_ids
    limit = min(len(tokens) - 1, len(prompt))
    common = next((i for i, (a, b) in enumerate(zip(tokens[:limit], prompt[:limit])) if a != b), limit)
    return common >= block_size and other.num_computed_tokens < common // block_size * block_size
