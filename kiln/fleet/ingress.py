"""FleetIngress: the fleet's HTTP entry, a Ray Serve deployment behind Ray's HTTP proxy
(docs/architecture.md § Fleet).

It reads only what routing needs from each request (kiln/fleet/routing.py: the session in the path, the
opening of an OpenAI prompt), and hands the whole request, untouched, to the replicas' handle, whose
SessionRouter (kiln/fleet/router.py) picks the replica. Everything else (Host and Origin checks, keys,
quotas, errors) is the replica's, the same code as `kiln serve`, so a client sees one server.

A replica that died before answering (its process killed, not yet noticed by Ray) is retried on: nothing
of the request ran to completion there, and the router now waits out or routes around the dead owner.
A request that had begun answering is never retried.

(No `from __future__ import annotations` here: Ray's class-based FastAPI views need the real `Request`.)
"""

import asyncio
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from kiln.errors import UnavailableError
from kiln.fleet.http_bridge import HttpRequest, ResponseHead
from kiln.fleet.routing import route_for
from kiln.server.http_errors import error_response, too_large_response
from kiln.server.service import MAX_REQUEST_BYTES

ATTEMPTS = 5
RETRY_PAUSE_S = 0.5
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
_HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection", b"x-request-id"}  # Serve's proxy writes its own

app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)  # /openapi.json is the replicas' document


async def _pieces(stream: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
    """The body pieces after the head. (Defined before the class: serve.ingress serializes the class as it
    is defined, with the module's names bound so far.)"""
    async for piece in stream:
        yield piece


@serve.ingress(app)
class FleetIngress:
    def __init__(self, replicas: DeploymentHandle, max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        self.replicas = replicas.options(method_name="http", stream=True)
        self.max_request_bytes = max_request_bytes

    @app.api_route("/{path:path}", methods=METHODS)
    async def forward(self, request: Request) -> Response:
        body = bytearray()
        async for chunk in request.stream():  # the replica checks the limit too; the ingress must not buffer past it
            body += chunk
            if len(body) > self.max_request_bytes:
                return too_large_response(f"the request body is over {self.max_request_bytes} bytes")
        body = bytes(body)
        client = (request.client.host, request.client.port) if request.client else None
        carried = HttpRequest(request.method, request.url.path, request.url.query.encode(),
                              tuple(request.headers.raw), body, client)
        route = route_for(request.method, carried.path, body)
        for attempt in range(ATTEMPTS):
            stream: DeploymentResponseGenerator = self.replicas.remote(route, carried)
            try:
                head: ResponseHead = await stream.__anext__()
                break
            except RayActorError as error:
                if attempt == ATTEMPTS - 1:
                    return error_response(UnavailableError(f"no replica could take the request: {error}"))
                await asyncio.sleep(RETRY_PAUSE_S)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers if k.lower() not in _HOP_HEADERS}
        if headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(_pieces(stream), status_code=head.status, headers=headers)
        return Response(b"".join([piece async for piece in _pieces(stream)]), status_code=head.status, headers=headers)
