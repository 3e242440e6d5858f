"""gRPC transport: the `kiln.v1.Runtime` service of proto/kiln/v1/runtime.proto over RuntimeService.

Every RPC identifies its caller from the `authorization: Bearer <key>` metadata (the identity scopes
sessions), parses its request (malformed bytes are INVALID_ARGUMENT), calls the service, and answers a
KilnError with the gRPC status of the same name; any other exception is a bug: INTERNAL, logged. Each
call is counted as `grpc/<Method>` with its status. A failed call touches nothing but itself, and unary
calls run the service on a worker thread, so the server keeps serving everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from kiln.engine.constraints import Constraint
from kiln.engine.stream import AsyncGenerationStream
from kiln.errors import CancelledError, InvalidArgumentError, KilnError
from kiln.results import GenerationResult, SessionInfo, SnapshotInfo
from kiln.server import access_log
from kiln.server.access_log import AccessLog
from kiln.server.auth import ApiKeys
from kiln.server.auth_failures import grpc_peer_address
from kiln.server.grpc_limits import DEFAULT_GRPC_LIMITS, GrpcLimits
from kiln.server.metrics import Metrics
from kiln.server.quotas import retry_after
from kiln.server.service import MAX_REQUEST_BYTES, GenerateRequest, RuntimeService
from kiln.server.tls import TlsSettings
from kiln.v1 import rpc
from kiln.v1 import runtime_pb2 as pb

log = logging.getLogger(__name__)

# A client whose deadline passes cancels the call itself, often a few ms before the server's copy of the
# deadline (sent as a timeout, so shifted by the request's transit) runs out: a cancel this close to the
# deadline is counted as DEADLINE_EXCEEDED.
DEADLINE_SLACK_S = 0.05
MAX_SESSION_ID_CHARS = 128  # issued ids are 22 characters; anything this long is not one of ours
FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "cancelled": pb.FINISH_REASON_CANCELLED,
}
SERVING_STATUSES = {"serving": pb.SERVING_STATUS_SERVING, "shutting_down": pb.SERVING_STATUS_SHUTTING_DOWN,
                    "engine_failed": pb.SERVING_STATUS_ENGINE_FAILED}

Handler = Callable[["RuntimeServicer", Any, str | None], Message]  # (servicer, request, owner) -> response


def build_grpc_server(service: RuntimeService, keys: ApiKeys, metrics: Metrics, address: str,
                      max_request_bytes: int = MAX_REQUEST_BYTES, tls: TlsSettings | None = None,
                      access: AccessLog | None = None, limits: GrpcLimits = DEFAULT_GRPC_LIMITS) -> grpc.aio.Server:
    """A server for `address` ("host:port"), bound but not started. Build it on the event loop that will
    run it: generations stream their tokens to that loop. Binding a port another process listens on
    fails (gRPC would otherwise share it via SO_REUSEPORT and split the traffic between servers). A
    larger request message is refused by gRPC itself with RESOURCE_EXHAUSTED. With `tls` the port speaks
    only TLS (kiln/server/tls.py). `limits` (kiln/server/grpc_limits.py) caps calls, streams and connections."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", max_request_bytes),
                                      *limits.channel_options()], maximum_concurrent_rpcs=limits.rpc_limit)
    add_runtime_handlers(RuntimeServicer(service, keys, metrics, access), server)
    if tls is None:
        server.add_insecure_port(address)
    else:
        server.add_secure_port(address, tls.grpc_credentials())
    return server


def add_runtime_handlers(servicer: object, server: grpc.aio.Server) -> None:
    """One handler per method of the proto, `servicer`'s method of that name. Each receives its request
    as raw bytes: gRPC's own deserializer would answer a malformed message with UNKNOWN before Kiln sees
    the call (unauthenticated, uncounted), so the servicer parses it inside its call frame instead. It
    has the shape of protoc's `add_<Service>Servicer_to_server`, which the fleet's gRPC proxy needs
    (kiln/fleet/app.py)."""
    handlers = {}
    for name, method in rpc.METHODS.items():
        kind = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[name] = kind(getattr(servicer, name), response_serializer=rpc.response_type(name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(rpc.SERVICE.full_name, handlers),))


def _parse(method: str, request: bytes) -> Message:
    try:
        message = rpc.request_type(method).FromString(request)
    except DecodeError:
        raise InvalidArgumentError("malformed request message") from None
    access_log.note_grpc_request(request, message)
    return message


def _unary(handler: Handler) -> Callable[..., Awaitable[Message]]:
    """Turns `handler(servicer, request, owner) -> response` into a unary RPC method that authenticates,
    parses the request, maps errors to statuses and records the call. The handler runs on a worker
    thread: the service's calls may tokenize megabytes or wait for the engine's lock, and the event
    loop must keep serving every other call meanwhile."""

    async def rpc(self: RuntimeServicer, request: bytes, context: grpc.aio.ServicerContext) -> Message:
        async with self.call(handler.__name__, context) as owner:
            response = await asyncio.to_thread(handler, self, _parse(handler.__name__, request), owner)
            access_log.note_grpc_response(response)
            return response

    rpc.__name__ = rpc.__qualname__ = handler.__name__
    rpc.__doc__ = handler.__doc__
    return rpc


class RuntimeServicer:
    """The proto's RPCs, each a translation between messages and RuntimeService calls."""

    def __init__(self, service: RuntimeService, keys: ApiKeys, metrics: Metrics, access: AccessLog | None = None) -> None:
        self.service = service
        self.keys = keys
        self.metrics = metrics
        self.access = access or AccessLog()

    @contextlib.asynccontextmanager
    async def call(self, method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[str | None]:
        """The frame of one RPC: yields the caller's identity; ends the call with the status its outcome
        maps to, and records it."""
        status = grpc.StatusCode.OK
        with self.access.grpc(method, context) as record:  # its access log line; the request id
            try:
                record.caller = self.keys.identify(_metadata(context, "authorization"), grpc_peer_address(context.peer()))
                yield record.caller
            except KilnError as error:
                status = grpc.StatusCode[error.code]
                await context.abort(status, str(error), trailing_metadata=(*_retry_after(error), *record.metadata))
            except asyncio.CancelledError:  # the deadline passed, or the client cancelled or went away
                remaining = context.time_remaining()  # None: the call has no deadline
                expired = remaining is not None and remaining <= DEADLINE_SLACK_S
                status = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
                raise
            except Exception:
                status = grpc.StatusCode.INTERNAL
                log.exception("gRPC %s failed", method)
                await context.abort(status, f"internal error in {method}; the server logged it",
                                    trailing_metadata=record.metadata)
            finally:
                record.code = status.name
                self.metrics.observe_request(f"grpc/{method}", status.name, record.duration_s)

    @_unary
    def CreateSession(self, request: pb.CreateSessionRequest, owner: str | None) -> pb.CreateSessionResponse:
        info = self.service.create_session(
            owner, request.token_ids, _optional(request, "ttl_s"),
            **{name: _optional(request, name) for name in ("kv_policy", "kv_sink_tokens", "kv_window_tokens")},
        )
        return pb.CreateSessionResponse(session=_session_info(info))

    @_unary
    def AppendTokens(self, request: pb.AppendTokensRequest, owner: str | None) -> pb.AppendTokensResponse:
        info = self.service.append(owner, _session_id(request), request.token_ids)
        return pb.AppendTokensResponse(session=_session_info(info))

    @_unary
    def CloseSession(self, request: pb.CloseSessionRequest, owner: str | None) -> pb.CloseSessionResponse:
        self.service.close(owner, _session_id(request))
        return pb.CloseSessionResponse()

    @_unary
    def GetSessionInfo(self, request: pb.GetSessionInfoRequest, owner: str | None) -> pb.GetSessionInfoResponse:
        return pb.GetSessionInfoResponse(session=_session_info(self.service.info(owner, _session_id(request))))

    @_unary
    def ForkSession(self, request: pb.ForkSessionRequest, owner: str | None) -> pb.ForkSessionResponse:
        info = self.service.fork(owner, _session_id(request), _optional(request, "at"))
        return pb.ForkSessionResponse(session=_session_info(info))

    @_unary
    def ListSessions(self, request: pb.ListSessionsRequest, owner: str | None) -> pb.ListSessionsResponse:
        return pb.ListSessionsResponse(sessions=[_session_info(info) for info in self.service.list_sessions(owner)])

    @_unary
    def Tokenize(self, request: pb.TokenizeRequest, owner: str | None) -> pb.TokenizeResponse:
        return pb.TokenizeResponse(token_ids=self.service.tokenize(request.text, request.add_special_tokens))

    @_unary
    def Detokenize(self, request: pb.DetokenizeRequest, owner: str | None) -> pb.DetokenizeResponse:
        return pb.DetokenizeResponse(text=self.service.detokenize(request.token_ids, request.skip_special_tokens))

    @_unary
    def Health(self, request: pb.HealthRequest, owner: str | None) -> pb.HealthResponse:
        health = self.service.health()
        return pb.HealthResponse(**{**health, "status": SERVING_STATUSES[health["status"]]})

    @_unary
    def SnapshotSession(self, request: pb.SnapshotSessionRequest, owner: str | None) -> pb.SnapshotSessionResponse:
        return pb.SnapshotSessionResponse(snapshot=_snapshot_info(self.service.snapshot(owner, _session_id(request))))

    @_unary
    def RestoreSession(self, request: pb.RestoreSessionRequest, owner: str | None) -> pb.RestoreSessionResponse:
        return pb.RestoreSessionResponse(session=_session_info(self.service.restore(owner, _snapshot_id(request))))

    @_unary
    def ListSnapshots(self, request: pb.ListSnapshotsRequest, owner: str | None) -> pb.ListSnapshotsResponse:
        return pb.ListSnapshotsResponse(snapshots=[_snapshot_info(info) for info in self.service.list_snapshots(owner)])

    @_unary
    def DeleteSnapshot(self, request: pb.DeleteSnapshotRequest, owner: str | None) -> pb.DeleteSnapshotResponse:
        self.service.delete_snapshot(owner, _snapshot_id(request))
        return pb.DeleteSnapshotResponse()

    async def Generate(self, request: bytes, context: grpc.aio.ServicerContext) -> None:
        """Initial metadata once the generation is accepted, token chunks as they commit, one Finish.
        However the call ends (done, failed, cancelled by the client), the generation is stopped so
        the session is free for the next one. The stream belongs to the loop; it is submitted from a
        worker thread."""
        async with self.call("Generate", context) as owner:
            message = _parse("Generate", request)
            stream = await self.service.generate(owner, _session_id(message), _generate_request(message), context.peer(),
                                                 context.time_remaining())
            try:
                await context.send_initial_metadata(())
                async with contextlib.aclosing(token_batches(stream)) as batches:
                    async for ids, logprobs in batches:
                        await _write(context, stream, pb.GenerateEvent(tokens=pb.TokenChunk(token_ids=ids, logprobs=logprobs)))
                await _write(context, stream, pb.GenerateEvent(finish=_finish(await stream.result())))
            finally:
                stream.cancel()


async def token_batches(stream: AsyncGenerationStream) -> AsyncIterator[tuple[list[int], list[float]]]:
    """(token ids, their logprobs) of a stream, grouped by what is ready when the consumer asks: each
    batch holds every token that arrived while the consumer was busy (e.g. writing the previous batch to
    a slow client), and a lone token is handed over at once: fewer messages, no added latency. Tokens
    wait in the stream, not here, so a client that stops reading pauses the generation (the stream's
    Backpressure). Raises the generation's error after its last tokens."""
    sent = 0
    while batch := await stream.batch():
        yield batch, stream.logprobs_from(sent)
        sent += len(batch)


async def _write(context: grpc.aio.ServicerContext, stream: AsyncGenerationStream, message: Message) -> None:
    """Write one message, unless the client stays behind until the stream's stall timeout cancels the
    generation (the write waits on HTTP/2 flow control meanwhile): then the call ends CANCELLED, the
    client getting what it had buffered, then the status."""
    write = asyncio.ensure_future(context.write(message))
    stalled = asyncio.ensure_future(stream.stalled.wait())
    try:
        await asyncio.wait((write, stalled), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stalled.cancel()
        behind = not write.done()
        if behind:
            write.cancel()
    if behind:
        raise CancelledError("the client read nothing for the server's stall timeout; the generation was cancelled")
    write.result()


def _retry_after(error: Exception) -> tuple[tuple[str, str], ...]:
    return () if (seconds := retry_after(error)) is None else (("retry-after", seconds),)


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str | None:
    return next((value for name, value in context.invocation_metadata() or () if name == key), None)


def _session_id(request: Message) -> str:
    session_id = request.session_id
    if not session_id:
        raise InvalidArgumentError("session_id is required")
    if len(session_id) > MAX_SESSION_ID_CHARS:
        raise InvalidArgumentError(f"session_id is longer than {MAX_SESSION_ID_CHARS} characters")
    return session_id


def _snapshot_id(request: Message) -> str:
    if not request.snapshot_id:
        raise InvalidArgumentError("snapshot_id is required")
    return request.snapshot_id


def _optional(message: Message, field: str) -> object | None:
    """A proto3 `optional` field's value, or None when the caller left it unset."""
    return getattr(message, field) if message.HasField(field) else None


def _generate_request(request: pb.GenerateRequest) -> GenerateRequest:
    return GenerateRequest(
        max_tokens=_optional(request, "max_tokens"),
        temperature=_optional(request, "temperature"),
        top_p=_optional(request, "top_p"),
        top_k=_optional(request, "top_k"),
        min_p=_optional(request, "min_p"),
        repetition_penalty=_optional(request, "repetition_penalty"),
        presence_penalty=_optional(request, "presence_penalty"),
        frequency_penalty=_optional(request, "frequency_penalty"),
        seed=_optional(request, "seed"),
        stop=tuple(request.stop),
        stop_token_ids=tuple(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
        logprobs=request.logprobs,
        constraint=Constraint.one_of(*(_optional(request, name) for name in ("json_schema", "regex", "grammar"))),
    )


def _session_info(info: SessionInfo) -> pb.SessionInfo:
    return pb.SessionInfo(**asdict(info))  # last_saved_at None leaves the optional field unset


def _snapshot_info(info: SnapshotInfo) -> pb.SnapshotInfo:
    return pb.SnapshotInfo(**asdict(info))


def _finish(result: GenerationResult) -> pb.Finish:
    return pb.Finish(
        reason=FINISH_REASONS[result.finish_reason],
        usage=pb.Usage(**asdict(result.usage)),
        stop_string=result.stop_string,
    )
