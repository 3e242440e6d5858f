"""The Runtime service's call table, built from the descriptor in runtime_pb2 (hand-written).

protoc's gRPC plugin would generate a client stub plus a servicer base class of placeholder methods that
answer UNIMPLEMENTED. Kiln needs neither: its server registers handlers that parse request bytes
themselves (kiln/server/grpc.py), and the SDK's stub is the same table seen from the client. Both
sides read the methods from here, so the .proto stays the one source of the wire contract.
"""

from __future__ import annotations

from types import SimpleNamespace

import grpc
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from kiln.v1 import runtime_pb2

SERVICE = runtime_pb2.DESCRIPTOR.services_by_name["Runtime"]
METHODS: dict[str, MethodDescriptor] = {method.name: method for method in SERVICE.methods}


def request_type(method: str) -> type[Message]:
    return GetMessageClass(METHODS[method].input_type)


def response_type(method: str) -> type[Message]:
    return GetMessageClass(METHODS[method].output_type)


def path(method: str) -> str:
    return f"/{SERVICE.full_name}/{method}"


def stub(channel: grpc.Channel | grpc.aio.Channel) -> SimpleNamespace:
    """One callable per method (`stub(channel).Health(request)`), over a sync or an asyncio channel."""
    calls = {}
    for name, method in METHODS.items():
        kind = channel.unary_stream if method.server_streaming else channel.unary_unary
        calls[name] = kind(path(name), request_serializer=request_type(name).SerializeToString,
                           response_deserializer=response_type(name).FromString)
    return SimpleNamespace(**calls)
