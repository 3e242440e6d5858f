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
VERIFY_CHUNK = 2**20  # bytes of a page `verify` holds at a time
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


def max_blob_bytes(page_bytes: int) -> int:
    """The most bytes a page's blob can hold: the page itself, or zstd's worst-case frame of it
    (ZSTD_COMPRESSBOUND, frame header included)."""
    small = (128 * 1024 - page_bytes) >> 11 if page_bytes < 128 * 1024 else 0
    return page_bytes + (page_bytes >> 8) + small


def decode(blob: bytes | memoryview, expected_digest: str, size: int) -> bytes | memoryview:
    """The raw page of a blob, checked: exactly `size` bytes whose SHA-256 is `expected_digest`.
    FailedPreconditionError for a truncated, corrupt or mismatched blob. `size` bounds the decompression:
    a restore passes its engine's own page size."""
    if len(blob) == size and digest(blob) == expected_digest:
        return blob
    try:
        raw = _contexts()[1].decompress(blob, max_output_size=size)
    except zstandard.ZstdError as error:
        raise _refused(expected_digest, f"is corrupt ({error})") from None
    if len(raw) != size:
        raise _refused(expected_digest, f"holds {len(raw)} bytes, a page has {size}")
    if digest(raw) != expected_digest:
        raise _refused(expected_digest, "does not match its digest (corrupt)")
    return raw


def verify(blob: bytes | memoryview, expected_digest: str, size: int) -> None:
    """What `decode` checks, in bounded memory whatever `size` is: the blob is decompressed and hashed
    VERIFY_CHUNK bytes at a time, refused at the first byte past `size`. An import checks pages of a shape
    no loaded model vouches for (a file claiming huge pages of zeros must not cost their size in memory)."""
    if len(blob) == size and digest(blob) == expected_digest:
        return
    hasher, total = hashlib.sha256(), 0
    try:
        with _contexts()[1].stream_reader(blob) as reader:
            while chunk := reader.read(VERIFY_CHUNK):
                total += len(chunk)
                if total > size:
                    raise _refused(expected_digest, f"holds more than {size} bytes, a page's size")
                hasher.update(chunk)
    except zstandard.ZstdError as error:
        raise _refused(expected_digest, f"is corrupt ({error})") from None
    if total != size:
        raise _refused(expected_digest, f"holds {total} bytes, a page has {size}")
    if hasher.hexdigest() != expected_digest:
        raise _refused(expected_digest, "does not match its digest (corrupt)")


def _refused(expected_digest: str, why: str) -> FailedPreconditionError:
    return FailedPreconditionError(f"page blob {expected_digest[:16]} {why}")


def _contexts() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    if not hasattr(_local, "contexts"):
        _local.contexts = (zstandard.ZstdCompressor(level=LEVEL, write_content_size=True), zstandard.ZstdDecompressor())
    return _local.contexts
