"""Routes for operators and clients' discovery: GET /v1/models[/{id}], /healthz, /readyz, /metrics (Prometheus), and
vLLM's /health and /version (benchmark clients check them).

Knows which configs count as served (a live worker) and what /metrics adds to the counts servelab.telemetry
keeps: the queue depth per config and stream, read from Redis at scrape time. Nothing here reads the
requests history: each count was made when its event happened.
"""

from __future__ import annotations

import time
from importlib.metadata import PackageNotFoundError, version as package_version
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from pydantic import BaseModel
from sqlalchemy import text

from api.deps import ApiState, State, Tenant
from api.errors import ApiError, TextCheckedRoute
from servelab.store.db import session_scope
from servelab.telemetry import QUEUE_DEPTH, exposition

router = APIRouter(route_class=TextCheckedRoute)


class ModelOut(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "servelab"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelOut]


@router.get("/v1/models", response_model=ModelList, tags=["openai"])
def list_models(state: State, _tenant: Tenant) -> ModelList:
    """The serving configs that have a live worker."""
    return ModelList(data=[ModelOut(id=name) for name in sorted(state.catalog().live_names)])


@router.get("/v1/models/{model_id}", response_model=ModelOut, tags=["openai"])
def read_model(model_id: Annotated[str, Path(max_length=256)], state: State, _tenant: Tenant) -> ModelOut:
    """A serving config with a live worker, as the list shows it; any other name is 404 (model_not_found)."""
    catalog = state.catalog()
    if model_id in catalog.live_names:
        return ModelOut(id=model_id)
    live = ", ".join(sorted(catalog.live_names)) or "(none)"
    why = "is a serving config, but no worker serves it now" if model_id in catalog.configs else "does not exist"
    raise ApiError(404, f"the model {model_id!r} {why}; models served now: {live}", code="model_not_found",
                   param="model")


@router.get("/healthz", tags=["operations"])
async def healthz() -> dict[str, str]:
    """The process answers. NOTE: async, so it runs on the event loop, never behind blocking waits in the pool."""
    return {"status": "ok"}


def servelab_version() -> str:
    try:
        return package_version("servelab")
    except PackageNotFoundError:
        return "unknown"


@router.get("/health", tags=["operations"])
async def health() -> Response:
    """vLLM's liveness route (benchmark clients check it first): 200 with an empty body while the process answers."""
    return Response(status_code=200)


@router.get("/version", tags=["operations"])
async def version() -> dict[str, str]:
    """vLLM's version route: servelab's version."""
    return {"version": servelab_version()}


@router.get("/readyz", tags=["operations"], responses={503: {"description": "Redis or PostgreSQL unreachable"}})
def readyz(state: State) -> JSONResponse:
    """Redis and PostgreSQL both answer."""
    problems = {}
    try:
        state.runtime.redis.ping()
    except Exception as exc:  # NOTE: any failure means not ready; the reason is reported, not raised
        problems["redis"] = str(exc)
    try:
        with session_scope(state.runtime.sessions) as session:
            session.execute(text("SELECT 1"))
    except Exception as exc:
        problems["postgres"] = str(exc)
    return JSONResponse({"status": "unready", **problems} if problems else {"status": "ready"},
                        status_code=503 if problems else 200)


CONFIG_NAMES_TTL_S = 30.0  # NOTE: the catalog parses every config file; a new config's depth shows within this


class QueueDepth:
    """The one figure read at scrape time: entries not yet acknowledged per config and stream (XLEN), a Redis
    call per stream, whatever the history. NOTE: every api process reads the same global figure: take max()."""

    def __init__(self, state: ApiState, names_cache: dict[str, tuple[float, list[str]]]) -> None:
        self.state, self.names_cache = state, names_cache  # the cache: "names" -> (read at, monotonic s; names)

    def collect(self):
        depth = GaugeMetricFamily(QUEUE_DEPTH, "Stream entries not yet acknowledged (waiting or being served).",
                                  labels=["model_name", "stream"])
        for name in self.config_names():
            for kind, n in self.state.streams(name).depth().items():
                depth.add_metric([name, kind], n)
        yield depth

    def config_names(self) -> list[str]:
        read_at, names = self.names_cache.get("names", (-CONFIG_NAMES_TTL_S, []))
        if time.monotonic() - read_at >= CONFIG_NAMES_TTL_S:
            names = sorted(self.state.catalog().configs)
            self.names_cache["names"] = (time.monotonic(), names)
        return names


@router.get("/metrics", tags=["operations"], response_class=Response,
            responses={200: {"content": {"text/plain": {}}}})
def metrics(state: State, http: Request) -> Response:
    """Counts made where the events happened (this api's processes; each worker serves its own /metrics), and
    the queue depth read now. Costs the same with 1,000 or 1,000,000 stored requests."""
    if not hasattr(http.app.state, "metrics_config_names"):
        http.app.state.metrics_config_names = {}
    read_now = CollectorRegistry(auto_describe=False)
    read_now.register(QueueDepth(state, http.app.state.metrics_config_names))
    return Response(exposition() + generate_latest(read_now), media_type=CONTENT_TYPE_PLAIN_0_0_4)
