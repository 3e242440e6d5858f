"""A replica's front door (docs/architecture.md § Fleet): the replicas are the fleet application's ingress,
so Ray's HTTP and gRPC proxies hand each request straight to the replica SessionRouter picks from what a
proxy holds before the body (the session in the path, or in the gRPC request). That replica answers it in
process with `kiln serve`'s app and servicer, except for the requests it must hand on over the replicas'
handle (`hands_on`, kiln/fleet/routing.py):

- GET /metrics, GET /v1/sessions and the gRPC ListSessions are asked of every replica at once (Ray's
  broadcast) and the answers joined (kiln/fleet/metrics.py, kiln/fleet/listing.py);
- an OpenAI request with a `Kiln-Session` header goes to the owner of the session its name is bound to
  (kiln/server/chat_sessions.py; the binding is read from the shared store), answered here when this
  replica holds it;
- another stateless OpenAI request goes to the replica its prompt's opening picks (its prefix cache), which
  the proxy's router cannot see: the body comes after routing. This replica picks it (rendezvous hashing
  over the running replicas, whose ids it refreshes by broadcast at most once a MEMBERS_TTL_S) and
  answers in process when it is its own, so it never hands a request on to itself (Route.origin).

A replica that died before answering a handed-on request is retried on: nothing of the request ran to
completion there, and the router now routes around it. A request that had begun answering is never
retried. A replica that dies during a broadcast is left out of its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from ray.exceptions import RayActorError
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.responses import Response, StreamingResponse

from kiln.errors import UnavailableError
from kiln.fleet.grpc_bridge import Encoded, GrpcCall, GrpcStatus
from kiln.fleet.http_bridge import REPLICA_HEADER, HttpRequest, ResponseHead
from kiln.fleet.listing import joined_grpc, joined_json
from kiln.fleet.metrics import merge_metrics
from kiln.fleet.routing import (
    EVERY_REPLICA_METHODS,
    Route,
    asks_every_replica,
    hands_on,
    opening_holder,
    prefix_hash,
)
from kiln.server.http_errors import error_response, too_large_response
from kiln.v1 import rpc

ATTEMPTS = 5
RETRY_PAUSE_S = 0.5
MEMBERS_TTL_S = 1.0  # how stale this replica's list of the running replicas may be (a rendezvous's input)
REPLICA = REPLICA_HEADER.decode()
_JOINS = {"/metrics": merge_metrics, "/v1/sessions": joined_json}  # routing.EVERY_REPLICA_PATHS: each answer's join
REQUEST_ID = b"x-request-id"  # Ray's proxy writes the request's id on every response itself
_HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection", REQUEST_ID}  # a response made here has its own
Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


async def _open(replicas: DeploymentHandle, route: Route, request: object) -> tuple[object, DeploymentResponseGenerator]:
    """A replica's stream for the request and its first piece, retried while the chosen replica turns out
    dead before answering anything."""
    for attempt in range(1, ATTEMPTS + 1):
        stream: DeploymentResponseGenerator = replicas.remote(route, request)
        try:
            return await stream.__anext__(), stream
        except RayActorError as error:
            failure = error
            if attempt < ATTEMPTS:
                await asyncio.sleep(RETRY_PAUSE_S)
    raise UnavailableError(f"no replica could take the request: {failure}")


async def _broadcast(replicas: Callable[[], DeploymentHandle], method: str, *args: object) -> list:
    """Every running replica's answer to `method(*args)` (their order is not kept); a replica that died
    meanwhile is left out. UnavailableError when none answered, or one failed otherwise."""
    try:
        answers = await replicas().broadcast(method, *args).results_async(return_exceptions=True)
    except Exception as error:  # noqa: BLE001 - Ray's own (no replica running, a deployment being deleted)
        raise UnavailableError(f"asking every replica failed: {error}") from error
    if failures := [answer for answer in answers if isinstance(answer, BaseException)
                    and not isinstance(answer, RayActorError)]:
        raise UnavailableError(f"asking every replica failed: {failures[0]}")
    if not (answered := [answer for answer in answers if not isinstance(answer, BaseException)]):
        raise UnavailableError("no replica answered")
    return answered


async def _rest(stream: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
    """The pieces after the first; a caller that leaves early (its client went away) cancels the call."""
    ended = False
    try:
        async for piece in stream:
            yield piece
        ended = True
    finally:
        if not ended:
            stream.cancel()


def _replayed(body: bytes, receive: Receive) -> Receive:
    """`receive` for an app called after the body was read: the body, then what the client sends next."""
    given = False

    async def replay() -> dict:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _headers(head: ResponseHead) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers if k.lower() not in _HOP_HEADERS}


class HttpFront:
    """The ASGI app a replica serves to Ray's HTTP proxy: `app` (kiln serve's) in process, each response
    naming this replica; the requests that `hands_on` names, over `replicas` (the replicas' `http` method).
    `bound_session(request)`: the session a named-session request goes to (None: not one, or a new name);
    `holds(session_id)`: whether this replica owns that session."""

    def __init__(self, app: Callable, replica_id: str, replicas: Callable[[], DeploymentHandle],
                 max_request_bytes: int, bound_session: Callable[[HttpRequest], str | None],
                 holds: Callable[[str], bool]) -> None:
        self.app = app
        self.bound_session = bound_session
        self.holds = holds
        self.replica_id = replica_id
        self.header = (REPLICA_HEADER, replica_id.encode())
        self.replicas = replicas
        self.max_request_bytes = max_request_bytes
        self._members: list[str] = []
        self._members_at = -MEMBERS_TTL_S

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":  # the engine's life is the replica's (kiln serve runs no lifespan either)
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] == "http" and hands_on(scope["method"], scope["path"]):
            await self._read_first(scope, receive, send)
            return
        await self._here(scope, receive, send)

    async def _here(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The request answered in process, the response naming this replica."""

        async def named(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if bytes(k).lower() != REQUEST_ID]
                message = {**message, "headers": [*headers, self.header]}
            await send(message)

        await self.app(scope, receive, named)

    async def _read_first(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A request whose route needs its body (or every replica): read it, then answer it here or hand it on."""
        body = bytearray()
        while True:  # the app checks the limit too; the front must not buffer past it
            message = await receive()
            body += message.get("body", b"")
            if len(body) > self.max_request_bytes:
                response = too_large_response(f"the request body is over {self.max_request_bytes} bytes")
                await response(scope, receive, send)
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        request = HttpRequest(scope["method"], scope["path"], scope.get("query_string", b""),
                              tuple((bytes(k), bytes(v)) for k, v in scope["headers"]), bytes(body),
                              tuple(scope["client"]) if scope.get("client") else None)
        if asks_every_replica(request.method, request.path):
            try:
                response = await self._every_replicas_answers(request)
            except UnavailableError as error:
                response = error_response(error)
        elif (session_id := await asyncio.to_thread(self.bound_session, request)) is not None:
            if self.holds(session_id):
                await self._here(scope, _replayed(request.body, receive), send)
                return
            response = await self._handed_to(Route(session_id=session_id, origin=self.replica_id), request)
        elif (holder := await self._holder(request.body)) == self.replica_id:
            await self._here(scope, _replayed(request.body, receive), send)
            return
        else:
            response = await self._handed_to(Route(replica=holder, origin=self.replica_id), request)
        await response(scope, receive, send)

    async def _holder(self, body: bytes) -> str:
        """The replica a stateless request's prompt opening picks; this one when the body names none."""
        if (opening := prefix_hash(body)) is None:
            return self.replica_id
        if time.monotonic() - self._members_at > MEMBERS_TTL_S:
            with contextlib.suppress(UnavailableError):  # the last list it had (or itself): the request is served
                self._members = [replica for replica, _ in await _broadcast(self.replicas, "process")]
            self._members_at = time.monotonic()
        return opening_holder(opening, self._members or [self.replica_id])

    async def _handed_to(self, route: Route, request: HttpRequest) -> Response:
        replicas = self.replicas().options(method_name="http", stream=True)
        try:
            head, stream = await _open(replicas, route, request)
        except UnavailableError as error:
            return error_response(error)
        headers = _headers(head)
        if headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(_rest(stream), status_code=head.status, headers=headers)
        return Response(b"".join([piece async for piece in _rest(stream)]), status_code=head.status, headers=headers)

    async def _every_replicas_answers(self, request: HttpRequest) -> Response:
        """The request asked of every replica, the answers joined into one (/metrics: the aggregate beside
        each replica's series; /v1/sessions: the caller's sessions on all). A replica's refusal (a missing
        key, its Host check) is answered as it gave it."""
        bodies: dict[str, bytes] = {}
        answers = await _broadcast(self.replicas, "http_whole", request)
        for head, body in answers:
            headers = _headers(head)
            if head.status != 200:
                return Response(body, status_code=head.status, headers=headers)
            bodies[headers[REPLICA]] = body
        return Response(_JOINS[request.path](bodies), media_type=_headers(answers[0][0])["content-type"])


class _CallFailed(Exception):
    """Ends a streaming call whose status was set on Ray's context: for a stream, Ray's proxy reads the
    context's code only from an exception (its messages may have been sent already)."""


def _ended(status: GrpcStatus, context: RayServegRPCContext) -> None:
    """Give Ray's context the call's status; Ray's proxy answers the client with its code and details."""
    context.set_trailing_metadata(list(status.trailing_metadata))
    if not status.ok:
        context.set_code(grpc.StatusCode[status.code])
        context.set_details(status.details)


def _call(method: str, request: bytes, context: RayServegRPCContext) -> GrpcCall:
    return GrpcCall(method, request, tuple(context.invocation_metadata()), context.peer())


class GrpcFront:
    """A replica's gRPC side for Ray's gRPC proxy: each RPC of kiln.v1.Runtime is a method of the replica
    (`with_runtime_methods`) that runs `local` (the servicer in process); a listing is asked of every
    replica over `replicas` (their `grpc_whole` method)."""

    def __init__(self, local: Callable[[GrpcCall], AsyncIterator[bytes | GrpcStatus]],
                 replicas: Callable[[], DeploymentHandle], max_request_bytes: int) -> None:
        self.local = local
        self.replicas = replicas
        self.max_request_bytes = max_request_bytes

    async def call(self, call: GrpcCall) -> AsyncIterator[bytes | GrpcStatus]:
        """One gRPC call: its messages' bytes, then its status."""
        if len(call.request) > self.max_request_bytes:  # Ray's proxy takes up to 2 GiB; one server, this much
            yield GrpcStatus(grpc.StatusCode.RESOURCE_EXHAUSTED.name,
                             f"the request message is over {self.max_request_bytes} bytes")
            return
        if call.method not in EVERY_REPLICA_METHODS:
            async for piece in self.local(call):
                yield piece
            return
        messages: dict[str, bytes] = {}
        try:
            answers = await _broadcast(self.replicas, "grpc_whole", call)  # a listing: unary
        except UnavailableError as error:
            yield GrpcStatus(grpc.StatusCode.UNAVAILABLE.name, str(error))
            return
        for answer, status in answers:
            if not status.ok:  # a refusal (a missing key) is the call's
                yield status
                return
            messages[status.replica] = answer[0]
        yield joined_grpc(messages)
        yield GrpcStatus(grpc.StatusCode.OK.name)


def _unary_method(method: str) -> Callable:
    async def call(self: object, request: bytes, grpc_context: RayServegRPCContext) -> Encoded:
        response = Encoded(b"")  # an error's: the client reads the status only
        async for piece in self.grpc_front.call(_call(method, request, grpc_context)):
            if isinstance(piece, GrpcStatus):
                _ended(piece, grpc_context)
            else:
                response = Encoded(piece)
        return response

    call.__name__ = call.__qualname__ = method
    return call


def _streaming_method(method: str) -> Callable:
    async def call(self: object, request: bytes, grpc_context: RayServegRPCContext) -> AsyncIterator[Encoded]:
        async for piece in self.grpc_front.call(_call(method, request, grpc_context)):
            if isinstance(piece, GrpcStatus):
                _ended(piece, grpc_context)
                if not piece.ok:
                    raise _CallFailed(piece.details)
            else:
                yield Encoded(piece)

    call.__name__ = call.__qualname__ = method
    return call


def with_runtime_methods(cls: type) -> type:
    """One method per RPC of kiln.v1.Runtime, named as the proto names it (what Ray's gRPC proxy calls),
    each running through the instance's `grpc_front`."""
    for name, method in rpc.METHODS.items():
        setattr(cls, name, (_streaming_method if method.server_streaming else _unary_method)(name))
    return cls
