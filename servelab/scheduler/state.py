"""One request's state in a worker, from the moment it is admitted to its end (nano-vllm's `Sequence`, vLLM's
`Request`): the request (tokenised once, its seed drawn), its token ids (the prompt, then every token generated),
how many of them the KV cache holds, its block table, and what the scheduler's rules read (class, priority, age,
retries, preemptions, its claim).

Pure: no Redis, no SQL, no torch. Does not know the engine's per-request decoding state (sampler, detokeniser,
grammar): the runner keeps that by request id.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import UTC, datetime

from servelab.request import GenerationRequest


class ScheduledStatus(enum.IntEnum):
    """Ordered: a request waits, runs (and may be preempted, then wait to run again), then has finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # left the batch unfinished: it waits again, its tokens kept, and recomputes them when it returns
    FINISHED = 3


@dataclass(eq=False)  # NOTE: identity: two states of one id never coexist, and lists remove by identity
class ScheduledRequest:
    request: GenerationRequest  # tokenised (prompt_token_ids set) and with its seed drawn
    entry_key: str = ""  # its stream entry (unique among the config's streams); the worker acknowledges it at the end
    is_interactive: bool = True
    enqueued_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    priority: int = 0
    is_retry: bool = False  # started before and not finished: maybe it crashed its worker
    is_claimed: bool = False  # running in the store under this worker (claimed; a preempted row stays claimed)
    num_attempts: int = 0  # started executions, as the claim counted them
    num_preemptions: int = 0  # by priority (an interactive request took its place); at most one
    num_pool_preemptions: int = 0  # by the pool running out mid-decode
    status: ScheduledStatus = ScheduledStatus.WAITING
    token_ids: list[int] = field(default_factory=list)  # the prompt, then the tokens generated so far
    num_computed_tokens: int = 0  # tokens whose keys and values the cache holds (the rest run in the next steps)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first admission
    num_recomputed_tokens: int = 0  # computed tokens its preemptions threw away (computed again when it returned)
    # the paged pool's bookkeeping (blocks.py): its blocks in token order, the chain hash of each full block keyed so
    # far, and (window) the logical blocks dropped after its sink blocks
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_evicted_blocks: int = 0

    def __post_init__(self) -> None:
        assert self.request.is_tokenized, f"request {self.request.request_id} is scheduled before it is tokenised"
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_token_ids)
        if not self.entry_key:
            self.entry_key = self.request.request_id

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run through the model before its next token: 1 when it decodes."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_pending_tokens == 1 and self.num_generated_tokens > 0

    @property
    def max_new_tokens(self) -> int:
        return self.request.params.max_new_tokens

    @property
    def num_columns(self) -> int:
        """KV-cache columns the row may hold by its end."""
        return self.num_prompt_tokens + self.max_new_tokens

    @property
    def num_logical_blocks(self) -> int:
        return len(self.block_table) + self.num_evicted_blocks

    @property
    def enqueued_s(self) -> float:
        """Unix time it was enqueued: its age, for the order of service."""
        return self.enqueued_at.timestamp()
