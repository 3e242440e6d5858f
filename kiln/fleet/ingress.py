"""FleetIngress: the fleet's entry, a Ray Serve deployment behind Ray's HTTP and gRPC proxies
(docs/architecture.md § Fleet).

It reads only what routing needs from each request (kiln/fleet/routing.py: the session in the path or in
the gRPC request, the opening of an OpenAI prompt), and hands the whole request, untouched, to the
replicas' handle, whose SessionRouter (kiln/fleet/router.py) picks the replica. Everything else (Host and
Origin checks, keys, quotas, errors) is the replica's, the same code as `kiln serve`, so a client sees one
server. Ray's gRPC proxy calls the ingress's method of the RPC's name (one per method of the proto,
added by `_with_runtime_methods`).

A replica that died before answering (its process killed, not yet noticed by Ray) is retried on: nothing
of the request ran to completion there, and the router now waits out or routes around the dead owner.
A request that had begun answering is never retried.

(No `from __future__ import annotations` here: Ray's class-based FastAPI views need the real `Request`.)
"""

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from kiln.errors import UnavailableError
from kiln.fleet.grpc_bridge import Encoded, GrpcCall, GrpcStatus
from kiln.fleet.http_bridge import REPLICA_HEADER, HttpRequest, ResponseHead
from kiln.fleet.listing import joined_grpc, joined_json
from kiln.fleet.metrics import merge_metrics
from kiln.fleet.routing import Route, grpc_route, route_for
from kiln.server.http_errors import error_response, too_large_response
from kiln.server.service import MAX_REQUEST_BYTES
from kiln.v1 import rpc

ATTEMPTS = 5
RETRY_PAUSE_S = 0.5
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
REPLICA = REPLICA_HEADER.decode()
_JOINS = {"/metrics": merge_metrics, "/v1/sessions": joined_json}  # routing.EVERY_REPLICA_PATHS: each answer's join
_HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection", b"x-request-id"}  # Serve's proxy writes its own

app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)  # /openapi.json is the replicas' document


async def _pieces(stream: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
    """The body pieces after the head. (Defined before the class: serve.ingress serializes the class as it
    is defined, with the module's names bound so far.)"""
    async for piece in stream:
        yield piece


async def _open(replicas: DeploymentHandle, route: Route, request: object) -> tuple[object, DeploymentResponseGenerator]:
    """A replica's stream for the request and its first piece, retried while the chosen replica turns out
    dead before answering anything (nothing of the request ran to completion there)."""
    for attempt in range(1, ATTEMPTS + 1):
        stream: DeploymentResponseGenerator = replicas.remote(route, request)
        try:
            return await stream.__anext__(), stream
        except RayActorError as error:
            failure = error
            if attempt < ATTEMPTS:
                await asyncio.sleep(RETRY_PAUSE_S)
    raise UnavailableError(f"no replica could take the request: {failure}")


def _headers(head: ResponseHead) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers if k.lower() not in _HOP_HEADERS}


def _ended(status: GrpcStatus, context: RayServegRPCContext) -> None:
    """Give Ray's context the replica's status; a failed call is raised, and Ray's proxy answers the client
    with the context's code and details."""
    context.set_trailing_metadata(list(status.trailing_metadata))
    if not status.ok:
        context.set_code(grpc.StatusCode[status.code])
        context.set_details(status.details)


class _Refused(Exception):
    """A replica refused a call asked of every replica: its status is the call's."""

    def __init__(self, status: GrpcStatus) -> None:
        super().__init__(status.details)
        self.status = status


class _CallFailed(Exception):
    """Ends a streaming call whose status was set on Ray's context: for a stream, Ray's proxy reads the
    context's code only from an exception (its messages may have been sent already)."""


def _call(method: str, request: bytes, context: RayServegRPCContext) -> GrpcCall:
    return GrpcCall(method, request, tuple(context.invocation_metadata()), context.peer())


def _unary_method(method: str) -> Callable:
    async def call(self: "FleetIngress", request: bytes, grpc_context: RayServegRPCContext) -> Encoded:
        response = Encoded(b"")  # an error's: the client reads the status only
        async for piece in self.grpc(_call(method, request, grpc_context)):
            if isinstance(piece, GrpcStatus):
                _ended(piece, grpc_context)
            else:
                response = Encoded(piece)
        return response

    call.__name__ = call.__qualname__ = method
    return call


def _streaming_method(method: str) -> Callable:
    async def call(self: "FleetIngress", request: bytes, grpc_context: RayServegRPCContext) -> AsyncIterator[Encoded]:
        async for piece in self.grpc(_call(method, request, grpc_context)):
            if isinstance(piece, GrpcStatus):
                _ended(piece, grpc_context)
                if not piece.ok:
                    raise _CallFailed(piece.details)
            else:
                yield Encoded(piece)

    call.__name__ = call.__qualname__ = method
    return call


def _with_runtime_methods(cls: type) -> type:
    """One method per RPC of kiln.v1.Runtime, named as the proto names it: what Ray's gRPC proxy calls."""
    for name, method in rpc.METHODS.items():
        setattr(cls, name, (_streaming_method if method.server_streaming else _unary_method)(name))
    return cls


@serve.ingress(app)
@_with_runtime_methods
class FleetIngress:
    def __init__(self, replicas: DeploymentHandle, max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        self.http_replicas = replicas.options(method_name="http", stream=True)
        self.grpc_replicas = replicas.options(method_name="grpc", stream=True)
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
        try:
            if route.every_replica:
                return await self._every_replicas_answers(route, carried)
            head, stream = await _open(self.http_replicas, route, carried)
        except UnavailableError as error:
            return error_response(error)
        headers = _headers(head)
        if headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(_pieces(stream), status_code=head.status, headers=headers)
        return Response(b"".join([piece async for piece in _pieces(stream)]), status_code=head.status, headers=headers)

    async def _every_replicas_answers(self, route: Route, request: HttpRequest) -> Response:
        """The request asked of each replica in turn (kiln/fleet/routing.py), their answers joined into one
        (/metrics: the aggregate beside each replica's series; /v1/sessions: the caller's sessions on all).
        A replica's refusal (a missing key, its Host check) is answered as it gave it."""
        bodies: dict[str, bytes] = {}
        while True:
            head, stream = await _open(self.http_replicas, replace(route, asked=frozenset(bodies)), request)
            body = b"".join([piece async for piece in _pieces(stream)])
            headers = _headers(head)
            if head.status != 200:
                return Response(body, status_code=head.status, headers=headers)
            if (replica := headers[REPLICA]) in bodies:
                return Response(_JOINS[request.path](bodies), media_type=headers["content-type"])
            bodies[replica] = body

    async def grpc(self, call: GrpcCall) -> AsyncIterator[bytes | GrpcStatus]:
        """One gRPC call on the replica its request routes to (on each replica in turn for a listing): its
        messages' bytes, then its status."""
        if len(call.request) > self.max_request_bytes:  # Ray's proxy takes up to 2 GiB; one server, this much
            yield GrpcStatus(grpc.StatusCode.RESOURCE_EXHAUSTED.name,
                             f"the request message is over {self.max_request_bytes} bytes")
            return
        route = grpc_route(call.method, call.request)
        try:
            if route.every_replica:
                yield await self._every_replicas_grpc_answer(route, call)  # a listing: unary
                yield GrpcStatus(grpc.StatusCode.OK.name)
                return
            first, stream = await _open(self.grpc_replicas, route, call)
        except UnavailableError as error:
            yield GrpcStatus(grpc.StatusCode.UNAVAILABLE.name, str(error))
            return
        except _Refused as refused:
            yield refused.status
            return
        yield first
        async for piece in stream:
            yield piece

    async def _every_replicas_grpc_answer(self, route: Route, call: GrpcCall) -> bytes:
        """A unary call asked of each replica in turn, the answers joined (kiln/fleet/listing.py); the first
        refusal (a missing key) ends it."""
        messages: dict[str, bytes] = {}
        while True:
            first, stream = await _open(self.grpc_replicas, replace(route, asked=frozenset(messages)), call)
            *answer, status = [first, *[piece async for piece in stream]]
            if not status.ok:
                raise _Refused(status)
            if status.replica in messages:
                return joined_grpc(messages)
            messages[status.replica] = answer[0]
