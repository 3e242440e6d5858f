"""Every gRPC method of kiln.v1.Runtime with request messages drawn from its descriptor
(tests/fuzz/grpc_strategies.py) and with random bytes as the raw request.

Property: every call ends within REQUEST_TIMEOUT_S with OK or a status that names the caller's mistake
or a state (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED), never INTERNAL,
UNKNOWN or a deadline; a Generate that ends OK sent exactly one Finish, last. After each method's run,
FuzzTarget.check_unharmed.
"""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiln.v1 import rpc
from kiln.v1 import runtime_pb2 as pb
from tests.fuzz.conftest import FUZZ_KEY, REQUEST_TIMEOUT_S, FuzzTarget, fuzz_settings
from tests.fuzz.grpc_strategies import Known, messages

ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}
MESSAGES_PER_METHOD = 12
RAW_REQUESTS_PER_METHOD = 4
METADATA = (("authorization", f"Bearer {FUZZ_KEY}"),)


@pytest.fixture
def known(fuzz_target: FuzzTarget) -> Known:
    """Two sessions of the fuzzer's key, so drawn requests can name live sessions."""
    create = fuzz_target.channel.unary_unary(rpc.path("CreateSession"), response_deserializer=pb.CreateSessionResponse.FromString)
    ids = [create(pb.CreateSessionRequest(token_ids=list(b"fuzz me")).SerializeToString(), metadata=METADATA,
                  timeout=REQUEST_TIMEOUT_S).session.session_id for _ in range(2)]
    return Known(ids, fuzz_target.vocab_size)


def answer(channel: grpc.Channel, method: str, payload: bytes) -> grpc.StatusCode:
    """The status `payload` (raw request bytes) gets; a stream is read to its end."""
    try:
        if not rpc.METHODS[method].server_streaming:
            channel.unary_unary(rpc.path(method))(payload, metadata=METADATA, timeout=REQUEST_TIMEOUT_S)
            return grpc.StatusCode.OK
        events = [pb.GenerateEvent.FromString(event) for event in
                  channel.unary_stream(rpc.path(method))(payload, metadata=METADATA, timeout=REQUEST_TIMEOUT_S)]
    except grpc.RpcError as error:
        assert error.code() in ANSWERS, f"{method} answered {error.code()}: {error.details()}"
        return error.code()
    finishes = [index for index, event in enumerate(events) if event.WhichOneof("event") == "finish"]
    assert finishes == [len(events) - 1], f"{method}: a stream that ended OK must end with its one Finish"
    return grpc.StatusCode.OK


@pytest.mark.parametrize("method", sorted(rpc.METHODS))
def test_messages(fuzz_target: FuzzTarget, known: Known, method: str) -> None:
    @given(request=messages(rpc.request_type(method).DESCRIPTOR, known))
    @fuzz_settings(MESSAGES_PER_METHOD)
    def answers_well(request) -> None:  # noqa: ANN001 - the method's request message
        fuzz_target.tried[f"grpc {method} (messages)"] += 1
        answer(fuzz_target.channel, method, request.SerializeToString())

    answers_well()
    fuzz_target.check_unharmed()


@pytest.mark.parametrize("method", sorted(rpc.METHODS))
def test_raw_bytes(fuzz_target: FuzzTarget, method: str) -> None:
    @given(payload=st.binary(max_size=512))
    @fuzz_settings(RAW_REQUESTS_PER_METHOD)
    def answers_well(payload: bytes) -> None:
        fuzz_target.tried[f"grpc {method} (raw bytes)"] += 1
        answer(fuzz_target.channel, method, payload)

    answers_well()
    fuzz_target.check_unharmed()
