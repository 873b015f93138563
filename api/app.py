"""The api process: the FastAPI app, built from a Runtime and ServiceSettings; never imports torch.

`create_app` wires the routers, errors, the body-size limit and the thread limit (waiting routes hold a
thread each); `build` is the uvicorn factory, reading Settings once: `uvicorn --factory api.app:build`. With
SERVELAB_METRICS_DIR set, the process counts into that folder beside the other api processes (its launcher,
`servelab api`, empties it first).
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from api import batches, generation, operations
from api.deps import ApiState
from api.errors import BodySizeLimit, install_error_handlers
from servelab.runtime import Runtime, connect
from servelab.settings import ServiceSettings
from servelab.telemetry import record_in_files, release_process


def create_app(runtime: Runtime, settings: ServiceSettings, *, close_runtime: bool = False) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        # NOTE: each waiting completion call holds one thread while it blocks on Redis (1 s at a time)
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.api_threads
        yield
        release_process()
        if close_runtime:
            runtime.close()

    # NOTE: FastAPI's own OpenTelemetry hooks off: servelab exports Prometheus metrics (/metrics), and the hooks
    # look up the tracer, meter and logger providers on every request.
    app = FastAPI(title="servelab", version="0.1.0", lifespan=lifespan,
                  description="LLM generation through a queue: requests, OpenAI-compatible completions, batches.",
                  telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False})
    app.state.servelab = ApiState.of(runtime, settings)
    for module in (generation, batches, operations):
        app.include_router(module.router)
    install_error_handlers(app)
    # NOTE: multipart framing around an upload is small; 64 KiB of slack keeps a file at the limit acceptable.
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes,
                       max_upload_bytes=settings.max_file_bytes + 65_536)
    app.add_middleware(StampArrival)  # NOTE: added last, so it runs first
    return app


class StampArrival:
    """Stamps each HTTP request's arrival (wall clock, `request.state.arrived_s`) before its body is read, its key
    checked or its fields validated: a stream's time to first token (stream_metrics.ttft_ms) counts from there, as
    its client's does (checked against AIPerf's and GuideLLM's in tests/api/test_bench_clients.py)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrived_s"] = time.time()
        await self.app(scope, receive, send)


def build() -> FastAPI:
    settings = ServiceSettings()
    if settings.metrics_dir is not None:
        record_in_files(settings.metrics_dir)
    return create_app(connect(settings), settings, close_runtime=True)
