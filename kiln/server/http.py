"""The HTTP server: the OpenAI-compatible API (kiln/server/openai_api.py, the Responses API in
kiln/server/responses_api.py), REST sessions
(kiln/server/rest.py), `GET /healthz` (also `/health`), `GET /metrics` and the OpenAPI document
`GET /openapi.json` (kiln/server/openapi.py; authenticated like the API) and the dashboard
`GET /dashboard` (kiln/server/dashboard.py), all over one RuntimeService.

Layers, outermost first: request metrics and the access log (every request, errors included, counted
by route template and Kiln status name; kiln/server/access_log.py), the Host and Origin checks and CORS
(kiln/server/http_guard.py), the request body limit, authentication (kiln/server/http_auth.py), then
the routes, whose errors leave as OpenAI error envelopes (kiln/server/http_errors.py). No redirects:
a path with a stray trailing slash is 404, never a Location built from the request.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence

from fastapi import APIRouter, FastAPI, HTTPException
from fastapi.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.server.access_log import AccessLog
from kiln.server.auth import ApiKeys
from kiln.server.dashboard import DashboardRoutes
from kiln.server.dashboard_state import DashboardState
from kiln.server.http_auth import AuthMiddleware
from kiln.server.http_errors import install_error_handlers, too_large_response
from kiln.server.http_guard import HttpGuard
from kiln.server.metrics import CONTENT_TYPE, Metrics
from kiln.server.openai_api import OpenAIRoutes
from kiln.server.openapi import openapi_document
from kiln.server.responses_api import ResponsesRoutes
from kiln.server.rest import SessionRoutes
from kiln.server.service import MAX_REQUEST_BYTES, RuntimeService

HEALTH_PATHS = ("/healthz", "/health")  # /health: where clients of vLLM and llama-server look
UNMATCHED_ROUTE = "http/unmatched"  # one label for every unknown path keeps the metric's cardinality bounded


def build_http_app(service: RuntimeService, keys: ApiKeys, metrics: Metrics,
                   max_request_bytes: int = MAX_REQUEST_BYTES, guard: HttpGuard | None = None,
                   access: AccessLog | None = None, chat_format: str = "auto") -> FastAPI:
    app = FastAPI(title="Kiln", docs_url=None, redoc_url=None, openapi_url="/openapi.json", redirect_slashes=False,
                  generate_unique_id_function=lambda route: route.name)  # operation ids: the handlers' names
    app.openapi = functools.partial(openapi_document, app)  # type: ignore[method-assign]
    install_error_handlers(app)
    openai = OpenAIRoutes(service, chat_format)
    responses = ResponsesRoutes(openai, service.responses)
    dashboard = DashboardRoutes(keys, DashboardState(service.llm, service.health, responses.book.survey))
    routers = [openai.router(), responses.router(), SessionRoutes(service).router(), _operations(service, metrics),
               dashboard.router()]
    for router in routers:
        app.include_router(router)
    app.add_middleware(AuthMiddleware, keys=keys)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if guard is not None:  # kiln serve always has one; in-process apps (tests) may go without
        guard.install(app)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics, access=access or AccessLog(),
                       routes=[route for router in routers for route in router.routes])
    return app


def _operations(service: RuntimeService, metrics: Metrics) -> APIRouter:
    router = APIRouter()

    async def healthz() -> JSONResponse:
        """200 while serving; 503 once shutdown began (load balancers drain the instance) or the engine
        failed (the process is about to exit). service.health() takes no lock: it runs on the loop."""
        health = service.health()
        return JSONResponse(health, status_code=200 if health["status"] == "serving" else 503)

    for path in HEALTH_PATHS:  # HEAD: probes that read only the status
        router.add_api_route(path, healthz, methods=["GET", "HEAD"], name=path.removeprefix("/"))

    @router.get("/metrics")
    async def prometheus() -> Response:
        """A scrape reads live state under the store and engine locks: on a worker thread, so a scrape
        during a slow operation never stalls the loop every stream shares."""
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    return router


class BodyLimitMiddleware:
    """Refuses a request body over `max_bytes` with 413 before buffering it: at once when its
    Content-Length says so, otherwise (chunked uploads) as soon as the bytes read pass the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await too_large_response(self._message(str(int(declared))))(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, self._message(f"at least {received}"))
            return message

        await self.app(scope, counting_receive, send)

    def _message(self, size: str) -> str:
        return f"request body of {size} bytes exceeds the server's limit of {self.max_bytes} bytes"


class RequestMetricsMiddleware:
    """Counts and times every HTTP request as `http/<route template>` with its Kiln status name. A
    streamed response's status is its outcome (an error or a client gone mid-stream), not the 200
    sent before the first token; its duration runs to the last byte."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Sequence[BaseRoute], access: AccessLog) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = list(routes)
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self._label(scope)
        with self.access.http(scope, route, receive, send) as exchange:  # its line in the access log
            try:
                await self.app(scope, exchange.receive, exchange.send)
            finally:
                record = exchange.settle()
                self.metrics.observe_request(route, record.code, record.duration_s)


    def _label(self, scope: Scope) -> str:
        """`http` + the template of the route the path belongs to (any method), e.g.
        `http/v1/sessions/{session_id}`."""
        for route in self.routes:
            match, _ = route.matches(scope)
            if match != Match.NONE:
                return "http" + route.path  # type: ignore[attr-defined]
        return UNMATCHED_ROUTE
