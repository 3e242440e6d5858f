"""Regenerates the checked-in Python message module (kiln/v1/runtime_pb2.py, .pyi) from
proto/kiln/v1/runtime.proto. The service's call table is built from its descriptor (kiln/v1/rpc.py), so
protoc's gRPC plugin output (placeholder servicer methods) is not generated.

The module is committed so that installing Kiln needs no protoc; tests/server/test_proto.py regenerates
it into a temporary folder and fails when the committed files are stale. Run `make proto` after
editing the .proto."""

from __future__ import annotations

from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTOS = ("kiln/v1/runtime.proto",)
GENERATED = ("kiln/v1/runtime_pb2.py", "kiln/v1/runtime_pb2.pyi")


def generate(out_dir: Path) -> list[Path]:
    """Writes the stubs under `out_dir` (module paths as in the repository) and returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            *(str(PROTO_ROOT / proto) for proto in PROTOS)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {', '.join(PROTOS)} (its message is above)")
    return [out_dir / name for name in GENERATED]


if __name__ == "__main__":
    for path in generate(ROOT):
        print(f"wrote {path.relative_to(ROOT)}")
