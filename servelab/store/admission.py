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
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from servelab.request import SamplingParams
from servelab.store.models import StreamKind, TenantQueueRow


class QueueFull(Exception):
    """The tenant has its limit of queued requests; the message says how many."""

    @classmethod
    def of(cls, tenant: str, *, max_queued: int) -> QueueFull:
        return cls(f"tenant {tenant!r} has {max_queued} queued requests, the limit is {max_queued}; "
                   "wait for some to finish, or use the Batch API for bulk work")


@dataclass(frozen=True)
class NewRequest:
    """An interactive request about to be admitted; its id is made here, so a group knows its ids before the
    INSERT (and an idempotency key can point at one before its row is written)."""

    tenant: str
    serving_config_name: str
    stream: StreamKind
    prompt: str | None
    messages: list[dict[str, Any]] | None
    sampling: SamplingParams
    priority: int = 0
    id: str = field(default_factory=lambda: str(uuid.uuid4()))

    def row(self) -> dict[str, Any]:
        """The row's values as JSON can carry them."""
        return dict(id=self.id, tenant=self.tenant, serving_config_name=self.serving_config_name,
                    stream=self.stream.value, prompt=self.prompt, messages=self.messages,
                    sampling=self.sampling.to_stored(), priority=self.priority)


# NOTE: one statement: lock the tenants' counters (an upsert that writes the same count, which also makes a
# missing row; tenants in name order), rank each tenant's requests in the group, insert those within the room
# left. The statement trigger then adds them to the counters. The counters stay locked until the commit.
ADMIT = text("""
WITH wanted AS (
    SELECT r.*, row_number() OVER (PARTITION BY r.tenant ORDER BY r.place) AS rank
    FROM jsonb_to_recordset(CAST(:rows AS jsonb)) AS r(
        place int, id uuid, tenant text, serving_config_name text, stream stream_kind, prompt text,
        messages jsonb, sampling jsonb, priority int)
), locked AS (
    INSERT INTO tenant_queues AS q (tenant)
    SELECT DISTINCT tenant FROM wanted ORDER BY tenant
    ON CONFLICT (tenant) DO UPDATE SET num_queued = q.num_queued
    RETURNING q.tenant, q.num_queued
)
INSERT INTO requests (id, tenant, serving_config_name, stream, prompt, messages, sampling, priority)
SELECT w.id, w.tenant, w.serving_config_name, w.stream, w.prompt, w.messages, w.sampling, w.priority
FROM wanted AS w JOIN locked AS l ON l.tenant = w.tenant
WHERE w.rank <= :max_queued - l.num_queued
ORDER BY w.place
RETURNING id
""")


def admit_requests(session: Session, requests: Sequence[NewRequest], *, max_queued: int) -> set[str]:
    """Admit what fits under each tenant's limit, in order, in one round trip; -> the ids admitted (inserted).
    The tenants' counter rows stay locked until the caller's commit."""
    if not requests:
        return set()
    rows = [{"place": i, **r.row()} for i, r in enumerate(requests)]
    result = session.execute(ADMIT, {"rows": json.dumps(rows), "max_queued": max_queued})
    return {str(request_id) for (request_id,) in result}


def num_queued(session: Session, tenant: str) -> int:
    """The tenant's count as the counter holds it (no lock): what admission would read."""
    return session.scalar(select(TenantQueueRow.num_queued).where(TenantQueueRow.tenant == tenant)) or 0
