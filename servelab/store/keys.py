"""API keys and tenants: create, look up and revoke keys; serialise a tenant's uses of idempotency keys;
count a tenant's queued requests the slow way (what the counter of store/admission.py must always equal);
set and read tenants' weights in the fair share of bulk work.

Knows that only a key's sha256 is stored, so a key is shown once, when created. Does not know HTTP:
the API turns "no tenant" into 401. Store functions take a session and never commit.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime

from sqlalchemy import delete, func, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from servelab.store.models import ApiKeyRow, RequestRow, RequestStatus, TenantQueueRow, TenantWeightRow

KEY_PREFIX = "sl-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(session: Session, *, tenant: str) -> str:
    """A new key for the tenant; the only time the key itself is seen."""
    assert tenant, "a key needs a tenant"
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiKeyRow(key_hash=hash_key(key), tenant=tenant))
    session.flush()
    return key


def tenant_of_key(session: Session, key: str) -> str | None:
    """The tenant of a live key; None for an unknown or revoked key."""
    return session.scalar(
        select(ApiKeyRow.tenant).where(ApiKeyRow.key_hash == hash_key(key), ApiKeyRow.revoked_at.is_(None))
    )


def revoke_key(session: Session, *, key: str, now: datetime) -> bool:
    result = session.execute(
        update(ApiKeyRow).where(ApiKeyRow.key_hash == hash_key(key), ApiKeyRow.revoked_at.is_(None))
        .values(revoked_at=now).returning(ApiKeyRow.id)
    )
    return result.first() is not None


def revoke_key_by_id(session: Session, *, key_id: int, now: datetime) -> bool:
    """Revoke a live key by its id (as `keys list` shows it), for when the key itself is not at hand."""
    result = session.execute(
        update(ApiKeyRow).where(ApiKeyRow.id == key_id, ApiKeyRow.revoked_at.is_(None))
        .values(revoked_at=now).returning(ApiKeyRow.id)
    )
    return result.first() is not None


def list_keys(session: Session, *, tenant: str | None = None) -> list[ApiKeyRow]:
    """Every key (live and revoked), oldest first; a key is known by its id and its hash's first characters."""
    query = select(ApiKeyRow).order_by(ApiKeyRow.id)
    if tenant is not None:
        query = query.where(ApiKeyRow.tenant == tenant)
    return list(session.scalars(query))


def set_tenant_weight(session: Session, *, tenant: str, weight: float) -> None:
    """A tenant's weight in the fair share of bulk work (1 when never set)."""
    assert weight > 0, f"a tenant's weight must be positive, got {weight}"
    statement = insert(TenantWeightRow).values(tenant=tenant, weight=weight)
    session.execute(statement.on_conflict_do_update(index_elements=["tenant"],
                                                    set_={"weight": weight, "updated_at": func.now()}))


def tenant_weights(session: Session, *, tenants: list[str] | None = None) -> dict[str, float]:
    """Tenants' weights as set (None: every tenant with one); a tenant left out weighs 1."""
    query = select(TenantWeightRow.tenant, TenantWeightRow.weight)
    if tenants is not None:
        query = query.where(TenantWeightRow.tenant.in_(tenants))
    return {tenant: weight for tenant, weight in session.execute(query.order_by(TenantWeightRow.tenant))}


def lock_tenant(session: Session, tenant: str) -> None:
    """Serialise one tenant's uses of idempotency keys until the transaction ends (a key is found, or saved,
    by one submission at a time)."""
    session.execute(text("SELECT pg_advisory_xact_lock(hashtext(:tenant))"), {"tenant": f"tenant:{tenant}"})


def num_queued_requests(session: Session, tenant: str) -> int:
    """Queued interactive requests of a tenant (bulk jobs have their own back-pressure), counted row by row:
    the reference for tenant_queues, never the hot path."""
    return session.scalar(
        select(func.count()).select_from(RequestRow).where(
            RequestRow.tenant == tenant, RequestRow.status == RequestStatus.QUEUED, RequestRow.batch_job_id.is_(None)
        )
    ) or 0


def delete_tenant(session: Session, *, tenant: str) -> int:
    """Remove a tenant's keys, interactive requests (with what hangs off them) and queue counter: a bench's
    tenant of its own, after its run. -> the requests removed."""
    num_requests = session.execute(delete(RequestRow).where(RequestRow.tenant == tenant,
                                                            RequestRow.batch_job_id.is_(None))).rowcount
    session.execute(delete(ApiKeyRow).where(ApiKeyRow.tenant == tenant))
    session.execute(delete(TenantQueueRow).where(TenantQueueRow.tenant == tenant, TenantQueueRow.num_queued == 0))
    return num_requests
