"""Page blobs: a page's raw bytes, named by their SHA-256 and stored zstd-compressed.

The digest is taken over the raw bytes, so a blob is verified after decompression: whatever a store or a
disk did to it, a page either comes back with exactly the bytes that were captured or not at all.
"""

from __future__ import annotations

import hashlib
import threading

import zstandard

from kiln.errors import FailedPreconditionError

# zstd level 1: float K/V compresses little at any level (mantissas are noise), so the cheapest level
# that compresses at all; higher levels and byte-plane shuffling gain nothing (bench/README.md § snapshot.py).
LEVEL = 1
_local = threading.local()  # zstd contexts are not thread-safe; one pair per thread


def digest(raw: bytes | memoryview) -> str:
    return hashlib.sha256(raw).hexdigest()


def compress(raw: bytes | memoryview) -> bytes:
    return _contexts()[0].compress(raw)


def decompress(blob: bytes, expected_digest: str, size: int) -> bytes:
    """The raw page of a blob, checked: exactly `size` bytes whose SHA-256 is `expected_digest`.
    FailedPreconditionError for a truncated, corrupt or mismatched blob."""
    try:
        raw = _contexts()[1].decompress(blob, max_output_size=size)
    except zstandard.ZstdError as error:
        raise FailedPreconditionError(f"page blob {expected_digest[:16]} is corrupt ({error})") from None
    if len(raw) != size:
        raise FailedPreconditionError(f"page blob {expected_digest[:16]} holds {len(raw)} bytes, a page has {size}")
    if digest(raw) != expected_digest:
        raise FailedPreconditionError(f"page blob {expected_digest[:16]} does not match its digest (corrupt)")
    return raw


def _contexts() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    if not hasattr(_local, "contexts"):
        _local.contexts = (zstandard.ZstdCompressor(level=LEVEL, write_content_size=True), zstandard.ZstdDecompressor())
    return _local.contexts
