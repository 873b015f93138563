"""Idempotency keys and file lifetimes as rows on a real PostgreSQL: a key is per tenant and expires; a key reused
for another submission names what differs; an expired or deleted file is gone for every read."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select, update

from servelab.idempotency import Fingerprint, KeyReused, KeyUse, check_reuse
from servelab.store import files
from servelab.store import idempotency as idempotency_keys
from servelab.store.models import FilePartRow, FileRow

NOW = datetime(2000, 1, 1, 12, 0, tzinfo=UTC)  # NOTE: long past: the purge below touches no other test's keys
BODY = {"model": "fp32", "prompt": "the cat", "max_tokens": 4}


def test_a_key_is_per_tenant_and_forgotten_when_it_expires(session) -> None:
    first = Fingerprint.of("/v1/completions", BODY)
    idempotency_keys.save_key(session, tenant="acme", key="k-1", fingerprint=first, resource_id="r-1", now=NOW,
                              ttl=timedelta(hours=24))
    found = idempotency_keys.find_key(session, tenant="acme", key="k-1", now=NOW + timedelta(hours=23))
    assert found.resource_id == "r-1" and found.fingerprint == first
    assert found.expires_at == NOW + timedelta(hours=24)
    assert idempotency_keys.find_key(session, tenant="globex", key="k-1", now=NOW) is None
    later = NOW + timedelta(hours=25)
    assert idempotency_keys.find_key(session, tenant="acme", key="k-1", now=later) is None
    other = Fingerprint.of("/v1/completions", {**BODY, "max_tokens": 8})
    idempotency_keys.save_key(session, tenant="acme", key="k-1", fingerprint=other, resource_id="r-2", now=later,
                              ttl=timedelta(hours=24))  # an expired key is a new key
    assert idempotency_keys.find_key(session, tenant="acme", key="k-1", now=later).resource_id == "r-2"
    idempotency_keys.save_key(session, tenant="acme", key="k-old", fingerprint=first, resource_id="r-3", now=NOW,
                              ttl=timedelta(hours=1))
    assert idempotency_keys.purge_expired_keys(session, now=later) == 1
    assert idempotency_keys.find_key(session, tenant="acme", key="k-1", now=later) is not None


def test_a_key_reused_for_another_submission_names_what_differs() -> None:
    first = KeyUse("k-1", Fingerprint.of("/v1/completions", BODY), "r-1", NOW, NOW + timedelta(hours=24))
    check_reuse(first, Fingerprint.of("/v1/completions", dict(reversed(BODY.items()))))  # the same body
    with pytest.raises(KeyReused, match=r"fields differ: max_tokens, temperature; .*2000-01-02T12:00:00"):
        check_reuse(first, Fingerprint.of("/v1/completions", {**BODY, "max_tokens": 5, "temperature": 0}))
    with pytest.raises(KeyReused, match="POST /v1/completions, not POST /v1/chat/completions"):
        check_reuse(first, Fingerprint.of("/v1/chat/completions", BODY))


def test_an_expired_or_deleted_file_is_gone_for_every_read(session) -> None:
    kept = files.create_file(session, tenant="acme", purpose="batch", filename="a.jsonl", content=b"{}\n")
    expiring = files.create_file(session, tenant="acme", purpose="batch", filename="b.jsonl", content=b"{}\n",
                                 expires_after=timedelta(hours=1))
    created = session.scalar(select(FileRow.created_at).where(FileRow.id == expiring.id))
    assert expiring.expires_at == created + timedelta(hours=1) and kept.expires_at is None
    assert {f.id for f in files.list_files(session, tenant="acme")} >= {kept.id, expiring.id}

    session.execute(update(FileRow).where(FileRow.id == expiring.id).values(expires_at=func.now() - timedelta(seconds=1)))
    files.delete_file(session, file_id=kept.id, now=NOW)
    for gone in (kept.id, expiring.id):
        assert files.get_file(session, file_id=gone, tenant="acme") is None
        assert files.read_content(session, file_id=gone, tenant="acme") is None
        assert gone not in {f.id for f in files.list_files(session, tenant="acme")}
    assert _num_parts(session, kept.id) == 0, "deleting erases the content"
    assert files.purge_expired_files(session, now=datetime.now(UTC)) >= 1
    assert _num_parts(session, expiring.id) == 0


def _num_parts(session, file_id: str) -> int:
    return session.scalar(select(func.count()).select_from(FilePartRow).where(FilePartRow.file_id == file_id))
