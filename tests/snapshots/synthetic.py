"""Synthetic snapshots (no model): manifests over made-up pages, for store tests and the crash writer.
Imports only kiln.snapshots, so a writer subprocess starts in a fraction of a second."""

from __future__ import annotations

from pathlib import Path

from kiln.snapshots import blobs, packs
from kiln.snapshots.manifest import (
    KIND_CHECKPOINT,
    KIND_SESSION,
    SESSION_PREFIX,
    GroupPages,
    KVShape,
    Manifest,
)

PAGE_BYTES = 256


def shape() -> KVShape:
    return KVShape(fingerprint="ab" * 32, model="m", weights="float32/exact", dtype="float32", encoding="raw",
                   layout_version=1, page_size=16, slots=1, num_kv_heads=1, head_dim=2, page_bytes=PAGE_BYTES)


def synthetic(snapshot_id: str, pages: list[bytes], owner: str = "sha256:0",
              codec: str = blobs.CODEC_ZSTD) -> tuple[Manifest, dict[str, blobs.Blob]]:
    """A manifest over raw pages, and their blobs in `codec`: a session's own snapshot if the id says so
    (session-<id>), else a checkpoint."""
    digests = [blobs.digest(page) for page in pages]
    own = snapshot_id.startswith(SESSION_PREFIX)
    manifest = Manifest(snapshot_id=snapshot_id, kind=KIND_SESSION if own else KIND_CHECKPOINT, owner=owner,
                        session_id=snapshot_id.removeprefix(SESSION_PREFIX) if own else "s", created_at=1.0,
                        ttl_s=60.0, policy="full", shape=shape(), token_ids=tuple(range(16 * len(pages))),
                        num_computed=16 * len(pages), groups=(GroupPages((0,), None, tuple(digests)),), codec=codec)
    return manifest, {d: blobs.encode(page, codec) for d, page in zip(digests, pages, strict=True)}


def page(seed: int) -> bytes:
    return bytes((seed * 31 + i) % 251 for i in range(PAGE_BYTES))


def stored_digests(root: Path) -> list[str]:
    """Every blob a directory store holds, by digest (a digest twice if two packs hold it)."""
    return [digest for path in sorted((root / "packs").glob("*.pack")) for digest in _pack_index(path)]


def blob_place(root: Path, digest: str) -> tuple[Path, packs.Entry]:
    """The pack of a directory store that holds a blob, and where in it."""
    for path in sorted((root / "packs").glob("*.pack")):
        index = _pack_index(path)
        if digest in index:
            return path, index[digest]
    raise AssertionError(f"no pack in {root} holds {digest}")


def flip_blob_byte(root: Path, digest: str) -> None:
    """Corrupt one byte in the middle of a stored blob (its pack's index stays intact)."""
    path, entry = blob_place(root, digest)
    data = bytearray(path.read_bytes())
    data[entry.offset + entry.length // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _pack_index(path: Path) -> dict[str, packs.Entry]:
    with open(path, "rb") as file:
        return packs.read_index(file, path.stat().st_size, path.name)
