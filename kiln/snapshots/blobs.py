"""Page blobs: a page's raw bytes, named by their SHA-256 and stored either as they are or as a zstd
frame.

A blob is the page itself exactly when it is a page's size and hashes to its digest (a zstd frame that
did would be a SHA-256 collision); anything else is decoded as zstd. So a page stored once serves every
later snapshot whatever codec those chose, and a raw page is written straight from the captured buffer.
The digest is taken over the raw bytes, so a blob is verified after decoding: whatever a store or a disk
did to it, a page either comes back with exactly the bytes that were captured or not at all.

Which codec pays is decided per KV encoding (`choose_codec`): float16 and float32 K/V keep ~92 % of their
bytes under zstd (mantissas are noise) while compressing costs more than writing the rest, so such pages
are stored raw; a codec that shrinks pages by a fifth or more is kept (bench/README.md § snapshot.py).
"""

from __future__ import annotations

import hashlib
import threading

import zstandard

from kiln.errors import FailedPreconditionError

Blob = bytes | memoryview  # what a store is given to write: a zstd frame, or a raw page's buffer
CODEC_ZSTD = "zstd"
CODEC_RAW = "raw"
CODECS = (CODEC_ZSTD, CODEC_RAW)
# zstd level 1: float K/V compresses little at any level, so the cheapest level that compresses at all.
LEVEL = 1
WORTH_COMPRESSING = 0.8  # compressed over raw bytes below which zstd is used
SAMPLE_PAGES = 4  # pages compressed to decide (spread over the save's new pages)
_local = threading.local()  # zstd contexts are not thread-safe; one pair per thread


def digest(raw: bytes | memoryview) -> str:
    return hashlib.sha256(raw).hexdigest()


def compress(raw: bytes | memoryview) -> bytes:
    return _contexts()[0].compress(raw)


def encode(raw: bytes | memoryview, codec: str) -> Blob:
    """A page as a blob in `codec` (CODEC_RAW: the page itself, not copied; CODEC_ZSTD)."""
    return compress(raw) if codec == CODEC_ZSTD else raw


def choose_codec(sample: list[bytes | memoryview]) -> str:
    """CODEC_ZSTD if it shrinks the sample pages below WORTH_COMPRESSING of their bytes, else CODEC_RAW."""
    raw = sum(len(page) for page in sample)
    packed = sum(len(compress(page)) for page in sample)
    return CODEC_ZSTD if raw and packed < WORTH_COMPRESSING * raw else CODEC_RAW


def decode(blob: bytes | memoryview, expected_digest: str, size: int) -> bytes | memoryview:
    """The raw page of a blob, checked: exactly `size` bytes whose SHA-256 is `expected_digest`.
    FailedPreconditionError for a truncated, corrupt or mismatched blob."""
    if len(blob) == size and digest(blob) == expected_digest:
        return blob
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
