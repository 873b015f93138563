"""OpenAI-style errors, the request-size limit of the API, and the text a JSON body may carry.

Knows the error body every client of this API reads ({"error": {"message", "type", "param", "code"}}) and
turns validation failures, missing resources, oversized bodies and bodies holding text no UTF-8 can carry (lone
surrogates, found by servelab.request.find_non_text before any route reads the body) into it. Does not know the
routes.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servelab.config import describe_validation_error
from servelab.request import UNKNOWN_BODY_FIELD, find_non_text

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         409: "conflict_error", 413: "request_too_large", 422: "idempotency_error", 429: "rate_limit_error",
         503: "service_unavailable", 504: "timeout"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}


def error_response(status: int, message: str, *, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": TYPES.get(status, "api_error"), "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer", **exc.headers} if exc.status == 401 else exc.headers
        return error_response(exc.status, exc.message, code=exc.code, param=exc.param, headers=headers or None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # NOTE: 400, not FastAPI's 422: OpenAI clients expect 400 for a bad parameter.
        errors = exc.errors()
        param = ".".join(str(p) for p in errors[0]["loc"][1:]) if errors else None
        return error_response(400, describe_validation_error(_AsValidationError(errors), unknown_hint=UNKNOWN_BODY_FIELD),
                              code="invalid_request",
                              param=param or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))


class TextCheckedRoute(APIRoute):
    """A route whose JSON body is refused (400, naming the field) when a string in it is not Unicode text, before
    validation or any message could echo it (a lone surrogate cannot be encoded into an answer either)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            return await handler(_TextCheckedRequest(request.scope, request.receive))

        return checked


class _TextCheckedRequest(Request):
    async def json(self) -> Any:
        value = await super().json()
        found = find_non_text(value)
        if found is not None:
            raise ApiError(400, found.message, code="invalid_text", param=found.where)
        return value


class _AsValidationError:
    """Just enough of pydantic's ValidationError for describe_validation_error."""

    def __init__(self, errors) -> None:
        self._errors = [{**e, "loc": tuple(e["loc"][1:]) or e["loc"]} for e in errors]

    def errors(self):
        return self._errors


class BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    """Refuse request bodies over a size before the app reads them (Content-Length), or as they stream in."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, max_upload_bytes: int, upload_path: str = "/v1/files"):
        self.app, self.max_bytes, self.max_upload_bytes, self.upload_path = app, max_bytes, max_upload_bytes, upload_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_upload_bytes if scope["path"] == self.upload_path else self.max_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _too_large(limit)(scope, receive, send)
        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await _too_large(limit)(scope, receive, send)


def _too_large(limit: int) -> JSONResponse:
    return error_response(413, f"the request body is larger than {limit} bytes; send less per request",
                          code="request_too_large")
