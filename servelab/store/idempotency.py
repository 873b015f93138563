"""Idempotency keys as rows: find a tenant's live key, remember (or re-point) one, purge the expired.

Knows the idempotency_keys table; a key is per tenant, and an expired key is as good as absent (a new use
replaces it). Does not know what a resource id points at, or HTTP. Callers serialise a tenant's uses of
keys (keys.lock_tenant) and own the transaction: nothing here commits.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, select, tuple_
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from servelab.idempotency import Fingerprint, KeyUse
from servelab.store.models import IdempotencyKeyRow


def find_key(session: Session, *, tenant: str, key: str, now: datetime) -> KeyUse | None:
    row = session.scalar(select(IdempotencyKeyRow).where(
        IdempotencyKeyRow.tenant == tenant, IdempotencyKeyRow.key == key, IdempotencyKeyRow.expires_at > now))
    if row is None:
        return None
    return KeyUse(row.key, Fingerprint(row.endpoint, row.body_digest), row.resource_id, row.created_at,
                  row.expires_at)


def find_keys(session: Session, *, tenant_keys: list[tuple[str, str]], now: datetime) -> dict[tuple[str, str], KeyUse]:
    """Live keys among these (tenant, key) pairs, in one query; -> (tenant, key) -> its first use."""
    if not tenant_keys:
        return {}
    rows = session.scalars(select(IdempotencyKeyRow).where(
        tuple_(IdempotencyKeyRow.tenant, IdempotencyKeyRow.key).in_(tenant_keys), IdempotencyKeyRow.expires_at > now))
    return {(row.tenant, row.key): KeyUse(row.key, Fingerprint(row.endpoint, row.body_digest), row.resource_id,
                                          row.created_at, row.expires_at) for row in rows}


def save_key(session: Session, *, tenant: str, key: str, fingerprint: Fingerprint, resource_id: str,
             now: datetime, ttl: timedelta) -> None:
    """Remember the key's first use; an expired row of the same key, or one being re-pointed, is replaced."""
    save_keys(session, uses=[(tenant, key, fingerprint, resource_id)], now=now, ttl=ttl)


def save_keys(session: Session, *, uses: list[tuple[str, str, Fingerprint, str]], now: datetime,
              ttl: timedelta) -> None:
    """save_key for many (tenant, key, fingerprint, resource id), each pair once, in one statement."""
    if not uses:
        return
    rows = [dict(tenant=tenant, key=key, endpoint=fingerprint.endpoint, body_digest=fingerprint.digest,
                 resource_id=resource_id, created_at=now, expires_at=now + ttl)
            for tenant, key, fingerprint, resource_id in uses]
    statement = insert(IdempotencyKeyRow).values(rows)
    replaced = {name: statement.excluded[name] for name in ("endpoint", "body_digest", "resource_id", "created_at",
                                                             "expires_at")}
    session.execute(statement.on_conflict_do_update(index_elements=["tenant", "key"], set_=replaced))


def purge_expired_keys(session: Session, *, now: datetime) -> int:
    return session.execute(delete(IdempotencyKeyRow).where(IdempotencyKeyRow.expires_at <= now)).rowcount
