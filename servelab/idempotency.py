"""Idempotency keys: when a retried submission is the first one again, and when reusing a key is an error.

Knows the key's bounds, how long a key is kept by default, and a submission's fingerprint: its endpoint and a
digest of each top-level body field, so a key reused with another body can be refused naming the fields that
differ, without storing the body. Pure: no HTTP, SQL or clock (the caller passes the time).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

HEADER = "Idempotency-Key"
MAX_KEY_CHARS = 255
KEY_PATTERN = r"^[\x21-\x7e]+$"  # visible ASCII: a UUID, or any token a client makes
DEFAULT_TTL = timedelta(hours=24)  # as Stripe keeps them; ServiceSettings.idempotency_ttl_s sets it
ENDPOINT_FIELD = "(endpoint)"


class KeyReused(ValueError):
    """The key came first with another endpoint or body; the message names what differs."""


@dataclass(frozen=True)
class Fingerprint:
    """One submission as a key remembers it."""

    endpoint: str
    digest: dict[str, str]  # field -> a short sha256 of its canonical JSON

    @classmethod
    def of(cls, endpoint: str, body: Mapping[str, Any]) -> Fingerprint:
        return cls(endpoint, {name: _digest(value) for name, value in body.items()})

    def differing_fields(self, first: Fingerprint) -> list[str]:
        """The fields whose values differ from the first submission's (the endpoint first, if it does)."""
        fields = sorted(name for name in set(self.digest) | set(first.digest)
                        if self.digest.get(name) != first.digest.get(name))
        return ([ENDPOINT_FIELD] if self.endpoint != first.endpoint else []) + fields


@dataclass(frozen=True)
class KeyUse:
    """A stored key: what it was first used for, and what that made."""

    key: str
    fingerprint: Fingerprint
    resource_id: str
    created_at: datetime
    expires_at: datetime


def check_reuse(first: KeyUse, retry: Fingerprint) -> None:
    """Raise KeyReused unless the retry is the same submission as the key's first one."""
    differing = retry.differing_fields(first.fingerprint)
    if not differing:
        return
    what = (f"POST {first.fingerprint.endpoint}, not POST {retry.endpoint}" if ENDPOINT_FIELD in differing
            else "a body whose fields differ: " + ", ".join(differing))
    raise KeyReused(f"{HEADER} {first.key!r} was first used at {first.created_at.isoformat(timespec='seconds')} "
                    f"for {what}; a key names one submission until {first.expires_at.isoformat(timespec='seconds')}"
                    ": send a new key for a new request")


def _digest(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
