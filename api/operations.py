"""Routes for operators and clients' discovery: GET /v1/models[/{id}], /healthz, /readyz and /metrics (Prometheus).

Knows which configs count as served (a live worker) and what is exported: request counts by status,
queue depth per stream, TTFT / TPOT / E2E histograms and tokens generated, read at scrape time.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from pydantic import BaseModel
from sqlalchemy import text

from api.deps import ApiState, State, Tenant
from api.errors import ApiError
from servelab.store.requests import serving_stats
from servelab.store.db import session_scope

router = APIRouter()
BOUNDS_MS = (5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000)


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


class ServingCollector:
    def __init__(self, state: ApiState) -> None:
        self.state = state

    def collect(self):
        with session_scope(self.state.runtime.sessions) as session:
            stats = serving_stats(session, bounds_ms=BOUNDS_MS)
        requests = GaugeMetricFamily("servelab_requests", "stored requests by status", labels=["status"])
        for status, n in stats.num_requests_by_status.items():
            requests.add_metric([status], n)
        yield requests
        yield CounterMetricFamily("servelab_generated_tokens", "tokens generated, all requests",
                                  value=stats.num_generated_tokens)
        for h in stats.histograms:
            seconds = [(str(b / 1e3), n) for b, n in h.bucket_counts] + [("+Inf", h.count)]
            yield HistogramMetricFamily(f"servelab_{h.name.removesuffix('_ms')}_seconds", f"{h.name} per request",
                                        buckets=seconds, sum_value=h.sum_ms / 1e3)
        depth = GaugeMetricFamily("servelab_queue_depth", "stream entries not yet acknowledged",
                                  labels=["config", "stream"])
        for name in sorted(self.state.catalog().configs):
            for kind, n in self.state.streams(name).depth().items():
                depth.add_metric([name, kind], n)
        yield depth


@router.get("/metrics", tags=["operations"], response_class=Response,
            responses={200: {"content": {"text/plain": {}}}})
def metrics(state: State) -> Response:
    registry = CollectorRegistry()
    registry.register(ServingCollector(state))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
