"""gRPC calls run through a replica's servicer for Ray Serve's gRPC proxy (docs/architecture.md § Fleet).

Ray Serve's gRPC proxy hands a replica each call's request as raw bytes with a RayServegRPCContext (its
metadata and peer). The replica wraps them in a GrpcCall (plain, picklable data, so a call can also be
handed on to another replica over Ray), runs it through the same RuntimeServicer `kiln serve` serves
(kiln/server/grpc.py: keys, quotas, typed statuses, metrics) over a BridgedContext, and gets each
response message's bytes, then one GrpcStatus, which it sets on Ray's context so the client sees the
status one server would send (kiln/fleet/front.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf.message import Message

from kiln.server.grpc import RuntimeServicer
from kiln.v1 import rpc

Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class GrpcCall:
    method: str  # the proto's method name, e.g. "CreateSession"
    request: bytes  # the request message as the client serialized it: the replica parses it
    metadata: Metadata  # the client's invocation metadata (authorization, x-request-id, ...)
    peer: str  # gRPC's peer string of the client ("ipv4:127.0.0.1:5000")


@dataclass(frozen=True)
class GrpcStatus:
    """How the call ended on the replica: the status code's name, its details, the trailing metadata."""

    code: str
    details: str = ""
    trailing_metadata: Metadata = ()
    replica: str = ""  # the replica that ran the call (a call asked of every replica stops at a repeated one)

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK.name


@dataclass(frozen=True)
class Encoded:
    """A response message already serialized by the servicer: Ray Serve's proxy asks the replica's return
    value for SerializeToString(), and re-parsing the replica's bytes only to serialize them again is waste."""

    data: bytes

    def SerializeToString(self) -> bytes:  # noqa: N802 - protobuf's name, which Ray Serve calls
        return self.data


class _Aborted(Exception):
    """Raised by BridgedContext.abort, as grpc.aio's abort raises: the servicer's call ends there."""

    def __init__(self, status: GrpcStatus) -> None:
        super().__init__(status.details)
        self.status = status


class BridgedContext:
    """The part of grpc.aio.ServicerContext that RuntimeServicer uses, for a call that arrived through
    Ray: written messages are queued for the replica's stream, an abort becomes the call's GrpcStatus.
    The client's deadline does not cross Ray Serve's proxy, so time_remaining() is None (no deadline)."""

    def __init__(self, call: GrpcCall) -> None:
        self.call = call
        self.written: asyncio.Queue[bytes] = asyncio.Queue()
        self.trailing: Metadata = ()

    def invocation_metadata(self) -> Metadata:
        return self.call.metadata

    def peer(self) -> str:
        return self.call.peer

    def time_remaining(self) -> float | None:
        return None

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.trailing = tuple(metadata)

    async def send_initial_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        """Ray Serve's proxy sends the initial metadata with the first message it forwards."""

    async def write(self, message: Message) -> None:
        await self.written.put(message.SerializeToString())

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Metadata = ()) -> None:
        raise _Aborted(GrpcStatus(code.name, details, tuple(trailing_metadata) or self.trailing))


async def call_servicer(servicer: RuntimeServicer, call: GrpcCall) -> AsyncIterator[bytes | GrpcStatus]:
    """Run one call through the servicer: each response message's bytes, then its GrpcStatus. When the
    consumer leaves (Ray cancels the stream because the client went away), the call is cancelled, so a
    Generate stops its generation."""
    if call.method not in rpc.METHODS:
        yield GrpcStatus(grpc.StatusCode.UNIMPLEMENTED.name, f"unknown method {call.method}")
        return
    context = BridgedContext(call)
    task = asyncio.create_task(getattr(servicer, call.method)(call.request, context))
    written = asyncio.ensure_future(context.written.get())
    try:
        while True:
            await asyncio.wait((written, task), return_when=asyncio.FIRST_COMPLETED)
            if not written.done():
                break
            yield written.result()
            written = asyncio.ensure_future(context.written.get())
        written.cancel()  # before the yields below: a pending get would take what they drain
        while not context.written.empty():  # what a stream wrote as it finished
            yield context.written.get_nowait()
        if isinstance(error := task.exception(), _Aborted):
            yield error.status
            return
        if isinstance(response := task.result(), Message):  # a unary call's answer
            yield response.SerializeToString()
        yield GrpcStatus(grpc.StatusCode.OK.name, "", context.trailing)
    finally:
        written.cancel()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, _Aborted):
            await task
