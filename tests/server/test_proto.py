"""The checked-in stubs (kiln/v1/) are what proto/generate.py makes of proto/kiln/v1/runtime.proto now,
and the installed protobuf and grpcio accept them."""

import importlib.util
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]


def load_generator():
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checked_in_stubs_match_the_proto(tmp_path):
    generator = load_generator()
    fresh = generator.generate(tmp_path)
    stale = [name for name, path in zip(generator.GENERATED, fresh, strict=True)
             if path.read_bytes() != (ROOT / name).read_bytes()]
    assert not stale, f"stale generated stubs {stale}: run `make proto` and commit the result"


def test_the_call_table_covers_every_method_of_the_proto():
    from kiln.v1 import rpc  # runtime_pb2 raises on an incompatible protobuf

    assert set(rpc.METHODS) == {
        "CreateSession", "AppendTokens", "Generate", "CloseSession", "GetSessionInfo", "ForkSession",
        "ListSessions", "Tokenize", "Detokenize", "Health", "SnapshotSession", "RestoreSession", "ListSnapshots",
        "DeleteSnapshot",
    }
    with grpc.insecure_channel("127.0.0.1:1") as channel:
        stub = rpc.stub(channel)
        assert all(callable(getattr(stub, name)) for name in rpc.METHODS)
        assert isinstance(stub.Generate, grpc.UnaryStreamMultiCallable)
        assert isinstance(stub.Health, grpc.UnaryUnaryMultiCallable)
    assert rpc.path("Health") == "/kiln.v1.Runtime/Health"
