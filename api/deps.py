"""What every route needs: the process's connections, settings, caches and submission collector, and the
caller's tenant from its key.

Knows the Authorization header (Bearer <key>) and that a missing, unknown or revoked key is 401 (a revoked
one within key_cache_s: api/caches.py). Does not know the routes; built once by api/app.py and handed to them
through app.state. The tenant is found on the event loop when cached, else in the thread pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated

from anyio.to_thread import run_sync
from fastapi import Depends, Header, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.caches import CatalogCache, KeyCache
from api.collector import Collector
from api.errors import ApiError
from servelab.idempotency import HEADER, KEY_PATTERN, MAX_KEY_CHARS
from servelab.catalog import Catalog, load_catalog
from servelab.queue.streams import RequestStreams
from servelab.queue.submit import Outcome, Posted, submit_group
from servelab.runtime import Runtime
from servelab.settings import ServiceSettings
from servelab.store import keys
from servelab.store.db import session_scope

# NOTE: groups written at once by one process. One: while a group is written the next gathers, so groups grow
# with the load (group commit). Measured with 32 clients on 2 cores: 1 in flight ~800-1000 submissions/s,
# 2 ~770-850, 4 ~470-600 (smaller groups, each with the same fixed cost, meeting at the tenant's counter).
MAX_GROUPS_IN_FLIGHT = 1


@dataclass(frozen=True)
class ApiState:
    runtime: Runtime
    settings: ServiceSettings
    tenants: KeyCache
    catalogs: CatalogCache
    submissions: Collector[Posted, Outcome]

    @classmethod
    def of(cls, runtime: Runtime, settings: ServiceSettings) -> ApiState:
        tenants = KeyCache(ttl_s=settings.key_cache_s)
        catalogs = CatalogCache(lambda: _load_catalog(runtime, settings), ttl_s=settings.catalog_cache_s)
        submissions: Collector[Posted, Outcome] = Collector(
            lambda posts: _submit_group(runtime, settings, posts), max_wait_ms=settings.submit_wait_ms,
            max_group_size=settings.max_submit_group, max_in_flight=MAX_GROUPS_IN_FLIGHT)
        return cls(runtime, settings, tenants, catalogs, submissions)

    def streams(self, config_name: str) -> RequestStreams:
        return RequestStreams(self.runtime.redis, prefix=self.settings.key_prefix, config_name=config_name)

    @property
    def key_ttl(self) -> timedelta:
        return timedelta(seconds=self.settings.idempotency_ttl_s)

    def catalog(self) -> Catalog:
        """Blocking (thread pool): the catalog, at most catalog_cache_s old."""
        return self.catalogs.get()

    def tenant_of_key(self, key: str) -> str | None:
        """Blocking: the tenant of a live key, from PostgreSQL."""
        with session_scope(self.runtime.sessions) as session:
            return keys.tenant_of_key(session, key)


def _load_catalog(runtime: Runtime, settings: ServiceSettings) -> Catalog:
    live_since = datetime.now(UTC) - timedelta(seconds=settings.worker_live_s)
    with session_scope(runtime.sessions) as session:
        return load_catalog(session, configs_dir=settings.configs_dir, live_since=live_since)


def _submit_group(runtime: Runtime, settings: ServiceSettings, posts: Sequence[Posted]) -> list[Outcome]:
    return submit_group(posts, sessions=runtime.sessions, redis_client=runtime.redis, prefix=settings.key_prefix,
                        max_queued=settings.max_queued_requests,
                        key_ttl=timedelta(seconds=settings.idempotency_ttl_s), now=datetime.now(UTC))


async def get_state(request: Request) -> ApiState:
    """NOTE: async, so FastAPI calls it on the event loop: a sync dependency costs a trip to the thread pool."""
    return request.app.state.servelab


State = Annotated[ApiState, Depends(get_state)]
_bearer = HTTPBearer(auto_error=False, description="an API key made with `servelab keys create --tenant NAME`")


async def get_tenant(state: State,
                     credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> str:
    if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
        raise ApiError(401, "no API key: send the header 'Authorization: Bearer <key>'", code="missing_api_key")
    key = credentials.credentials
    tenant = state.tenants.get(key)
    if tenant is None:
        tenant = await run_sync(state.tenant_of_key, key)
        if tenant is None:
            raise ApiError(401, "the API key is not valid (unknown or revoked)", code="invalid_api_key")
        state.tenants.put(key, tenant)
    return tenant


Tenant = Annotated[str, Depends(get_tenant)]

IdempotencyKey = Annotated[str | None, Header(
    alias=HEADER, max_length=MAX_KEY_CHARS, pattern=KEY_PATTERN,
    description="a retry with the same key gets the first submission's request (or batch), never a second one; "
                "kept per tenant for SERVELAB_IDEMPOTENCY_TTL_S (default 24 h)")]
