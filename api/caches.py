"""What the api process remembers between requests, and for how long: the tenant of each API key it has seen,
and the catalog of serving configs.

Knows the bounds on staleness, which docs/api.md states ("Submissions at a front end's rate"): a revoked key is
refused within key_cache_s of its revocation (a key's tenant is looked up again once its entry is that old); a
config changed on disk or by a newly registered worker is seen within catalog_cache_s, and a name the cached
catalog lacks reloads it (at most once per MIN_RELOAD_S), so a new worker's config is accepted within MIN_RELOAD_S
of its registration. Unknown and revoked keys are never remembered: each such call asks PostgreSQL. Does not know
HTTP or SQL: it is handed the look-ups. Thread-safe: sync routes read it from the thread pool.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from servelab.catalog import Catalog

MAX_KEYS = 100_000  # NOTE: a bound on memory; past it the oldest entries go first
MIN_RELOAD_S = 1.0  # a name missing from the catalog reloads it at most this often (a flood of bad names)

T = TypeVar("T")


@dataclass(frozen=True)
class _Entry(Generic[T]):
    value: T
    loaded_at_s: float  # monotonic


class KeyCache:
    """API key -> tenant, each entry trusted for ttl_s after it was read from PostgreSQL."""

    def __init__(self, *, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: dict[str, _Entry[str]] = {}  # NOTE: by the key's sha256, never the key itself

    def get(self, key: str) -> str | None:
        """The tenant if the key was found live less than ttl_s ago; None: ask PostgreSQL."""
        entry = self._entries.get(_digest(key))
        if entry is None or self.clock() - entry.loaded_at_s >= self.ttl_s:
            return None
        return entry.value

    def put(self, key: str, tenant: str) -> None:
        if self.ttl_s <= 0:
            return
        if len(self._entries) >= MAX_KEYS:
            for old in list(self._entries)[: MAX_KEYS // 10]:  # NOTE: dicts keep insertion order: oldest first
                self._entries.pop(old, None)
        self._entries[_digest(key)] = _Entry(tenant, self.clock())


class CatalogCache:
    """The catalog, loaded again once it is ttl_s old, or when a name it lacks is asked for."""

    def __init__(self, load: Callable[[], Catalog], *, ttl_s: float, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.load = load
        self.ttl_s = ttl_s
        self.clock = clock
        self._entry: _Entry[Catalog] | None = None
        self._lock = threading.Lock()

    def fresh(self) -> Catalog | None:
        """The cached catalog while it is younger than ttl_s; None: call get() (it reads PostgreSQL and files)."""
        entry = self._entry
        if entry is None or self.clock() - entry.loaded_at_s >= self.ttl_s:
            return None
        return entry.value

    def get(self) -> Catalog:
        """Blocking: the cached catalog, or a new one when it is too old."""
        with self._lock:  # NOTE: one load at a time; the threads that waited take its result
            cached = self.fresh()
            if cached is not None:
                return cached
            return self._reload()

    def with_name(self, name: str) -> Catalog:
        """Blocking: a catalog that knows `name` if the database or the files do now (reloaded if the cached
        one lacks it and was not loaded within MIN_RELOAD_S)."""
        catalog = self.get()
        if name in catalog.configs:
            return catalog
        with self._lock:
            entry = self._entry
            if entry is None:
                return self._reload()
            if name not in entry.value.configs and self.clock() - entry.loaded_at_s >= MIN_RELOAD_S:
                return self._reload()
            return entry.value

    def _reload(self) -> Catalog:
        catalog = self.load()
        self._entry = _Entry(catalog, self.clock())
        return catalog


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
