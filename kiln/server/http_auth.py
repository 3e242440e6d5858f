"""HTTP authentication: the caller's identity, established before anything else looks at the request.

It runs as ASGI middleware rather than a route dependency so that an unauthenticated caller learns
nothing else (not whether the body parses, not whether a route exists): with keys configured, every
request but the open paths needs `Authorization: Bearer <key>`, else 401 (with Retry-After when the
client's address is throttled after repeated failures, kiln/server/auth_failures.py). `/healthz` (and its
twin `/health`) is open for load balancers; `/metrics` is open for Prometheus scrapers, since it holds
only aggregate counters (no session ids, tokens or keys); restrict it at the network level if even those
are private. The
dashboard's page, script and style (kiln/server/dashboard.py) are open: static files holding no data,
the page must load to ask for a key; its data (`/dashboard/state.json`) is not.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from kiln.errors import UnauthenticatedError
from kiln.server.auth import ApiKeys
from kiln.server.http_errors import error_response

OPEN_PATHS = frozenset({"/healthz", "/health", "/metrics", "/dashboard", "/dashboard/app.js", "/dashboard/style.css"})
_OWNER = "kiln.owner"  # ASGI scope key holding the caller's identity


class AuthMiddleware:
    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            client = scope.get("client")
            scope[_OWNER] = self.keys.identify(Headers(scope=scope).get("authorization"), client[0] if client else None)
        except UnauthenticatedError as error:
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def caller(request: Request) -> str | None:
    """The identity the middleware established for this request."""
    return request.scope.get(_OWNER)


def connection(request: Request) -> str | None:
    """The connection a request came over, as RuntimeService.caller_of takes it: the client's address
    and port (None when the server does not know it)."""
    client = request.scope.get("client")
    return f"{client[0]}:{client[1]}" if client else None


Owner = Annotated[str | None, Depends(caller)]
"""The authenticated caller (None when auth is off): the `owner` of every session call."""
