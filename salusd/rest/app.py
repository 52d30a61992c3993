"""The FastAPI application: routers, error mapping, request bounds, health and metrics."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from salus.daemon import installed_version
from salus.daemon.rest import routes_jobs, routes_node, routes_tokens
from salus.daemon.rest.auth import Auth
from salus.daemon.rest.context import Context
from salus.daemon.rest.models import Health
from salus.daemon.wire.errors import SalusError

log = logging.getLogger("salusd.rest")
MAX_BODY_BYTES = 64 * 1024
STATUS = {"bad_request": 422, "unknown_job": 404, "not_owner": 403, "conflict": 409,
          "does_not_fit": 409, "job_failed": 409, "job_cancelled": 409, "busy": 409,
          "shutting_down": 503, "timeout": 503, "state_disk_full": 507}

health = APIRouter(tags=["health"])


@health.get("/healthz", response_model=Health, summary="Liveness (no token)")
async def healthz() -> Health:
    return Health(status="ok")


@health.get("/metrics", summary="Prometheus metrics (no token)",
            response_class=Response)
async def metrics(request: Request) -> Response:
    body, content_type = request.app.state.ctx.metrics.render()
    return Response(body, media_type=content_type)


class RequestLimit:
    """Runs at most `limit` requests at once; the others wait their turn, holding only their
    connection (which `connections.ConnectionGuard` bounds), rather than getting a 503.
    `/healthz` is served ahead of the limit, so health checks answer while the API is
    saturated."""

    def __init__(self, app: ASGIApp, limit: int = 64,
                 ahead: frozenset[str] = frozenset({"/healthz"})) -> None:
        self.app, self.ahead = app, ahead
        self.running = asyncio.Semaphore(limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.ahead:
            await self.app(scope, receive, send)
            return
        async with self.running:
            await self.app(scope, receive, send)


class BodyLimit:
    """Refuses request bodies over `limit` bytes (413), announced or streamed."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for key, value in scope.get("headers", []):
            if key == b"content-length" and (not value.isdigit() or int(value) > self.limit):
                await _too_large(self.limit, send)
                return
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge
            return message

        try:
            await self.app(scope, bounded, send)
        except _TooLarge:
            await _too_large(self.limit, send)


class _TooLarge(Exception):
    pass


async def _too_large(limit: int, send: Send) -> None:
    response = JSONResponse({"code": "too_large", "detail": f"request bodies are at most "
                             f"{limit} bytes"}, status_code=413)
    await response({"type": "http"}, _nothing, send)


async def _nothing() -> Message:
    return {"type": "http.disconnect"}


def make_app(ctx: Context, auth: Auth) -> FastAPI:
    app = FastAPI(title="salusd", version=installed_version(),
                  description="The control plane of one salusd node: jobs, devices, lanes, "
                  "policy and tokens. Every /v1 route needs `Authorization: Bearer <token>`.")
    app.state.ctx, app.state.auth = ctx, auth
    for router in (health, routes_jobs.router, routes_node.router, routes_tokens.router):
        app.include_router(router)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # The errors without the input they echo, which JSON may not carry (NaN, Infinity, a
        # lone surrogate), and every string made encodable.
        errors = [{"loc": [_printable(p) for p in e.get("loc", ())],
                   "msg": _printable(e.get("msg", "")), "type": _printable(e.get("type", ""))}
                  for e in exc.errors()]
        return JSONResponse({"code": "bad_request", "detail": errors}, status_code=422)

    @app.exception_handler(SalusError)
    async def salus_error(_: Request, exc: SalusError) -> JSONResponse:
        return JSONResponse({"code": exc.code, "detail": str(exc)},
                            status_code=STATUS.get(exc.code, 409))

    app.add_middleware(BodyLimit)
    app.add_middleware(RequestLimit)  # outermost: /healthz passes before anything else runs
    return app


def _printable(value: object) -> object:
    """`value` as a JSON response can carry it: an int as it is, anything else as text with
    what UTF-8 cannot encode escaped."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return str(value).encode("utf-8", "backslashreplace").decode("utf-8")


__all__ = ["Any", "make_app"]
