"""What every route needs: the process's connections and settings, and the caller's tenant from its key.

Knows the Authorization header (Bearer <key>) and that a missing, unknown or revoked key is 401.
Does not know the routes; built once by api/app.py and handed to them through app.state.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.errors import ApiError
from servelab.idempotency import HEADER, KEY_PATTERN, MAX_KEY_CHARS
from servelab.jobs.catalog import Catalog, load_catalog
from servelab.queue.streams import RequestStreams
from servelab.runtime import Runtime
from servelab.settings import ServiceSettings
from servelab.store import keys
from servelab.store.db import session_scope


@dataclass(frozen=True)
class ApiState:
    runtime: Runtime
    settings: ServiceSettings

    def streams(self, config_name: str) -> RequestStreams:
        return RequestStreams(self.runtime.redis, prefix=self.settings.key_prefix, config_name=config_name)

    @property
    def key_ttl(self) -> timedelta:
        return timedelta(seconds=self.settings.idempotency_ttl_s)

    def catalog(self) -> Catalog:
        live_since = datetime.now(UTC) - timedelta(seconds=self.settings.worker_live_s)
        with session_scope(self.runtime.sessions) as session:
            return load_catalog(session, configs_dir=self.settings.configs_dir, live_since=live_since)


def get_state(request: Request) -> ApiState:
    return request.app.state.servelab


State = Annotated[ApiState, Depends(get_state)]
_bearer = HTTPBearer(auto_error=False, description="an API key made with `servelab keys create --tenant NAME`")


def get_tenant(state: State, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> str:
    if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
        raise ApiError(401, "no API key: send the header 'Authorization: Bearer <key>'", code="missing_api_key")
    with session_scope(state.runtime.sessions) as session:
        tenant = keys.tenant_of_key(session, credentials.credentials)
    if tenant is None:
        raise ApiError(401, "the API key is not valid (unknown or revoked)", code="invalid_api_key")
    return tenant


Tenant = Annotated[str, Depends(get_tenant)]

IdempotencyKey = Annotated[str | None, Header(
    alias=HEADER, max_length=MAX_KEY_CHARS, pattern=KEY_PATTERN,
    description="a retry with the same key gets the first submission's request (or batch), never a second one; "
                "kept per tenant for SERVELAB_IDEMPOTENCY_TTL_S (default 24 h)")]
