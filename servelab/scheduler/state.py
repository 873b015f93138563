"""One request's state in a worker, from the moment its entry is read to its end: the request (tokenised once,
its seed drawn), where it waits or runs, and what the scheduler's rules read (class, priority, age, retries,
preemptions, its claim).

Pure: no Redis, no SQL, no torch. Does not know the engine's decoding state (sampler, detokeniser, cache row):
the engine keeps that per running request id.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime

from servelab.request import GenerationRequest


class ScheduledStatus(enum.IntEnum):
    """Ordered: a request waits, runs (and may wait again when preempted), then has finished."""

    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(eq=False)  # NOTE: identity: two states of one id never coexist, and lists remove by identity
class ScheduledRequest:
    request: GenerationRequest  # tokenised (prompt_token_ids set) and with its seed drawn
    entry_key: str  # its stream entry (unique among the config's streams); the worker acknowledges it at the end
    is_interactive: bool
    enqueued_at: datetime
    priority: int = 0
    is_retry: bool = False  # started before and not finished: maybe it crashed its worker
    is_claimed: bool = False  # running in the store under this worker (claimed; a preempted row stays claimed)
    num_attempts: int = 0  # started executions, as the claim counted them
    num_preemptions: int = 0
    status: ScheduledStatus = ScheduledStatus.WAITING

    def __post_init__(self) -> None:
        assert self.request.is_tokenized, f"request {self.request.request_id} is scheduled before it is tokenised"

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.request.params.max_new_tokens

    @property
    def num_columns(self) -> int:
        """KV-cache columns the row may hold by its end."""
        return self.num_prompt_tokens + self.max_new_tokens

    @property
    def enqueued_s(self) -> float:
        """Unix time it was enqueued: its age, for the order of service."""
        return self.enqueued_at.timestamp()
