"""Admitting interactive requests under their tenant's queue limit, many in one transaction.

Knows tenant_queues (each tenant's queued count, kept exact by triggers on requests, migration 0008): lock
the tenants' rows in name order, take what fits, and insert the admitted rows in one multi-row INSERT (the
triggers add them to the count). Does not know HTTP, Redis or idempotency keys. Takes a session, never commits.
NOTE: the counter row's lock is held from the admission to the commit, so a tenant's groups queue behind
each other there; the lock is per group, not per request, and nothing is counted (no COUNT over requests).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from servelab.request import SamplingParams
from servelab.store.models import RequestRow, StreamKind, TenantQueueRow


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
        return dict(id=uuid.UUID(self.id), tenant=self.tenant, serving_config_name=self.serving_config_name,
                    stream=self.stream, prompt=self.prompt, messages=self.messages,
                    sampling=self.sampling.to_stored(), priority=self.priority)


def lock_queues(session: Session, tenants: Iterable[str]) -> dict[str, int]:
    """Lock each tenant's counter row until the transaction ends (made at 0 if missing), in name order so that
    two groups never wait for each other crosswise; -> each tenant's queued requests now."""
    names = sorted(set(tenants))
    if not names:
        return {}
    # NOTE: an upsert that writes the same count: it locks an existing row and makes a missing one, in one
    # round trip; a plain SELECT FOR UPDATE could not lock a row that is not there yet.
    rows = session.execute(
        insert(TenantQueueRow).values([{"tenant": t} for t in names])
        .on_conflict_do_update(index_elements=["tenant"], set_={"num_queued": TenantQueueRow.num_queued})
        .returning(TenantQueueRow.tenant, TenantQueueRow.num_queued)
    ).all()
    return {tenant: num_queued for tenant, num_queued in rows}


def queue_room(session: Session, *, tenants: Iterable[str], max_queued: int) -> dict[str, int]:
    """How many more requests each tenant may queue now; the rows stay locked until the commit."""
    return {tenant: max(0, max_queued - n) for tenant, n in lock_queues(session, tenants).items()}


def insert_requests(session: Session, requests: Sequence[NewRequest]) -> None:
    """One multi-row INSERT; the triggers count the rows in (and the caller had room for them)."""
    if requests:
        session.execute(insert(RequestRow), [r.row() for r in requests])


def admit_requests(session: Session, requests: Sequence[NewRequest], *, max_queued: int) -> list[bool]:
    """Admit what fits under each tenant's limit, in order; -> whether each was admitted (and inserted)."""
    room = queue_room(session, tenants=[r.tenant for r in requests], max_queued=max_queued)
    admitted = []
    for r in requests:
        admitted.append(room[r.tenant] > 0)
        room[r.tenant] -= 1
    insert_requests(session, [r for r, ok in zip(requests, admitted) if ok])
    return admitted


def num_queued(session: Session, tenant: str) -> int:
    """The tenant's count as the counter holds it (no lock): what admission would read."""
    return session.scalar(select(TenantQueueRow.num_queued).where(TenantQueueRow.tenant == tenant)) or 0
