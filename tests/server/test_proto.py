"""The checked-in stubs (kiln/v1/) are what proto/generate.py makes of proto/kiln/v1/runtime.proto now,
and the installed protobuf and grpcio accept them."""

import importlib.util
from pathlib import Path

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


def test_stubs_pass_the_runtime_version_checks():
    from kiln.v1 import runtime_pb2, runtime_pb2_grpc  # both raise on an incompatible protobuf / grpcio

    service = runtime_pb2.DESCRIPTOR.services_by_name["Runtime"]
    assert {method.name for method in service.methods} == {
        "CreateSession", "AppendTokens", "Generate", "CloseSession", "GetSessionInfo", "ForkSession",
        "ListSessions", "Tokenize", "Detokenize", "Health",
    }
    assert hasattr(runtime_pb2_grpc, "RuntimeStub")
