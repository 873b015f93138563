"""Admitting interactive requests under their tenant's queue limit, many in one transaction.

Knows tenant_queues (each tenant's queued count, kept exact by triggers on requests, migration 0008): in one
statement, lock the tenants' rows in name order, take what fits, and insert the admitted rows (the trigger
adds them to the count). Does not know HTTP, Redis or idempotency keys. Takes a session, never commits.
NOTE: the counter row's lock is held from the admission to the commit, so a tenant's groups queue behind
each other there; the lock is per group, not per request, and nothing is counted (no COUNT over requests).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from servelab.request import SamplingParams, choice_seed
from servelab.store.models import StreamKind, TenantQueueRow
from servelab.store.pgtext import json_to_column, to_column


class QueueFull(Exception):
    """The tenant has its limit of queued requests; the message says how many."""

    @classmethod
    def of(cls, tenant: str, *, max_queued: int, num_choices: int = 1) -> QueueFull:
        what = "another queued request" if num_choices == 1 else f"{num_choices} more (one per choice)"
        return cls(f"tenant {tenant!r} has no room for {what}: the limit is {max_queued} queued requests; "
                   "wait for some to finish, or use the Batch API for bulk work")


@dataclass(frozen=True)
class NewRequest:
    """An interactive request about to be admitted, with its n choices (a row each); its ids are made here, so a
    group knows them before the INSERT (and an idempotency key can point at the first before it is written)."""

    tenant: str
    serving_config_name: str
    stream: StreamKind
    prompt: str | None
    messages: list[dict[str, Any]] | None
    sampling: SamplingParams
    priority: int = 0
    num_choices: int = 1
    id: str = field(default_factory=lambda: str(uuid.uuid4()))  # the first choice's: the request's id

    @property
    def ids(self) -> tuple[str, ...]:
        """Every choice's id, in order; the first is `id`, the others derived from it (the same on every call)."""
        return (self.id, *(str(uuid.uuid5(uuid.UUID(self.id), str(i))) for i in range(1, self.num_choices)))

    def rows(self) -> list[dict[str, Any]]:
        """The rows' values as JSON can carry them: choice i seeded choice_seed(seed, i), each naming the first.
        NOTE: the statement below reads them from jsonb, past the column types: their text is kept by hand."""
        first = self.id if self.num_choices > 1 else None
        return [dict(id=request_id, tenant=self.tenant, serving_config_name=self.serving_config_name,
                     stream=self.stream.value, prompt=None if self.prompt is None else to_column(self.prompt),
                     messages=json_to_column(self.messages),
                     sampling=json_to_column(replace(self.sampling, seed=choice_seed(self.sampling.seed, i)).to_stored()),
                     priority=self.priority, first_choice_id=first, choice_index=i)
                for i, request_id in enumerate(self.ids)]


# NOTE: one statement: lock the tenants' counters (an upsert that writes the same count, which also makes a
# missing row; tenants in name order), insert each request whose rows, with those of the tenant's requests before
# it in the group (`need`, counted by the caller), fit in the room left: a request's choices go in together or
# not at all, and a tenant's requests in a group go in arrival order up to the first that does not fit. The statement trigger then adds them to the counters. The counters stay locked until the commit.
ADMIT = text("""
WITH wanted AS (
    SELECT r.*
    FROM jsonb_to_recordset(CAST(:rows AS jsonb)) AS r(
        place int, need int, id uuid, tenant text, serving_config_name text, stream stream_kind, prompt text,
        messages jsonb, sampling jsonb, priority int, first_choice_id uuid, choice_index int)
), locked AS (
    INSERT INTO tenant_queues AS q (tenant)
    SELECT DISTINCT tenant FROM wanted ORDER BY tenant
    ON CONFLICT (tenant) DO UPDATE SET num_queued = q.num_queued
    RETURNING q.tenant, q.num_queued
)
INSERT INTO requests (id, tenant, serving_config_name, stream, prompt, messages, sampling, priority,
                      first_choice_id, choice_index)
SELECT w.id, w.tenant, w.serving_config_name, w.stream, w.prompt, w.messages, w.sampling, w.priority,
       w.first_choice_id, w.choice_index
FROM wanted AS w JOIN locked AS l ON l.tenant = w.tenant
WHERE w.need <= :max_queued - l.num_queued
ORDER BY w.place
RETURNING id
""")


def admit_requests(session: Session, requests: Sequence[NewRequest], *, max_queued: int) -> set[str]:
    """Admit what fits under each tenant's limit, in order, in one round trip; -> the ids admitted (inserted; a
    request's choices all or none). The tenants' counter rows stay locked until the caller's commit."""
    if not requests:
        return set()
    need: dict[str, int] = {}  # tenant -> rows of its requests so far, this one's included
    rows = []
    for r in requests:
        need[r.tenant] = need.get(r.tenant, 0) + r.num_choices
        rows += [{"place": len(rows), "need": need[r.tenant], **row} for row in r.rows()]
    result = session.execute(ADMIT, {"rows": json.dumps(rows), "max_queued": max_queued})
    return {str(request_id) for (request_id,) in result}


def num_queued(session: Session, tenant: str) -> int:
    """The tenant's count as the counter holds it (no lock): what admission would read."""
    return session.scalar(select(TenantQueueRow.num_queued).where(TenantQueueRow.tenant == tenant)) or 0
