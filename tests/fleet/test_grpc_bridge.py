"""A gRPC call carried to a replica (kiln/fleet/grpc_bridge.py), without Ray: the servicer's messages come
out as bytes in order, then the call's status (OK with its trailing metadata, or the abort's code and
details), and a consumer that leaves cancels the call."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kiln.fleet.grpc_bridge import BridgedContext, GrpcCall, GrpcStatus, call_servicer
from kiln.v1 import runtime_pb2 as pb

CALLER = (("authorization", "Bearer key-a"),)


class FakeServicer:
    """RuntimeServicer's calling convention (raw request bytes, a context) with scripted answers."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def Health(self, request: bytes, context: BridgedContext) -> pb.HealthResponse:  # noqa: N802 - the proto's names
        context.set_trailing_metadata((("x-request-id", "r1"),))
        return pb.HealthResponse(model=dict(context.invocation_metadata())["authorization"])

    async def GetSessionInfo(self, request: bytes, context: BridgedContext) -> pb.GetSessionInfoResponse:  # noqa: N802
        await context.abort(grpc.StatusCode.NOT_FOUND, "no session x", (("x-request-id", "r2"),))
        raise AssertionError("abort returns nothing")

    async def Generate(self, request: bytes, context: BridgedContext) -> None:  # noqa: N802
        count = pb.GenerateRequest.FromString(request).max_tokens
        try:
            for token in range(count):
                await context.write(pb.GenerateEvent(tokens=pb.TokenChunk(token_ids=[token])))
                await asyncio.sleep(0)
            if count > 100:
                await asyncio.Event().wait()  # a generation that runs until cancelled
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def pieces(call: GrpcCall, servicer: FakeServicer) -> list[bytes | GrpcStatus]:
    return [piece async for piece in call_servicer(servicer, call)]  # type: ignore[arg-type] - the fake


def test_a_unary_call_gives_its_response_then_ok_with_its_trailing_metadata():
    out = asyncio.run(pieces(GrpcCall("Health", b"", CALLER, "ipv4:127.0.0.1:1"), FakeServicer()))
    assert pb.HealthResponse.FromString(out[0]).model == "Bearer key-a"
    assert out[1] == GrpcStatus("OK", "", (("x-request-id", "r1"),))


def test_an_abort_gives_its_status_and_nothing_else():
    out = asyncio.run(pieces(GrpcCall("GetSessionInfo", b"", CALLER, "ipv4:127.0.0.1:1"), FakeServicer()))
    assert out == [GrpcStatus("NOT_FOUND", "no session x", (("x-request-id", "r2"),))]


def test_a_stream_gives_every_message_in_order_then_ok():
    request = pb.GenerateRequest(session_id="s", max_tokens=5).SerializeToString()
    out = asyncio.run(pieces(GrpcCall("Generate", request, CALLER, "ipv4:127.0.0.1:1"), FakeServicer()))
    assert [pb.GenerateEvent.FromString(piece).tokens.token_ids[0] for piece in out[:-1]] == [0, 1, 2, 3, 4]
    assert out[-1] == GrpcStatus("OK")


def test_an_unknown_method_is_unimplemented():
    out = asyncio.run(pieces(GrpcCall("Reboot", b"", CALLER, "ipv4:127.0.0.1:1"), FakeServicer()))
    assert [piece.code for piece in out] == ["UNIMPLEMENTED"]


def test_a_consumer_that_leaves_cancels_the_call():
    servicer = FakeServicer()
    request = pb.GenerateRequest(session_id="s", max_tokens=1000).SerializeToString()

    async def leave_early() -> None:
        stream = call_servicer(servicer, GrpcCall("Generate", request, CALLER, "ipv4:127.0.0.1:1"))  # type: ignore[arg-type]
        await stream.__anext__()
        await stream.aclose()
        await asyncio.wait_for(servicer.cancelled.wait(), 5)

    asyncio.run(leave_early())
    assert servicer.cancelled.is_set()


pytestmark = pytest.mark.timeout(60)
