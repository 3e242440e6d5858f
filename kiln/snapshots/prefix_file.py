"""The directory store's prefix index: one file per prefix space, ROOT/prefix/<space>.idx, holding every
record of that space (kiln/snapshots/store.py § prefix records).

    MAGIC (8 bytes), record count (u64)
    per record: KV group (u32), chain hash (16 bytes), digest (32 bytes), stored size (u64), last used (f64)
    SHA-256 of the records (32 bytes)

The file is rewritten whole (beside itself, then renamed) under ROOT/prefix/lock, so a reader sees the
previous file or the new one. A file that fails its checks (torn by a crash of the machine, edited by
hand) reads as no records: the prefix store is a cache, and the blobs it named become garbage.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

from kiln.snapshots.store import CHAIN_BYTES, PrefixRecord

MAGIC = b"KILNPFX1"
HEADER = struct.Struct("<8sQ")
RECORD = struct.Struct(f"<I{CHAIN_BYTES}s32sQd")
SUFFIX = ".idx"


def encode(records: Iterable[PrefixRecord]) -> bytes:
    body = b"".join(RECORD.pack(r.group, r.chain, bytes.fromhex(r.digest), r.size, r.last_used) for r in records)
    return HEADER.pack(MAGIC, len(body) // RECORD.size) + body + hashlib.sha256(body).digest()


def decode(data: bytes) -> list[PrefixRecord]:
    """The records of a file's bytes; [] for anything that is not a whole, checked index."""
    if len(data) < HEADER.size + 32:
        return []
    magic, count = HEADER.unpack_from(data)
    body = data[HEADER.size : -32]
    if magic != MAGIC or len(body) != count * RECORD.size or hashlib.sha256(body).digest() != data[-32:]:
        return []
    return [PrefixRecord(group, chain, digest.hex(), size, used) for group, chain, digest, size, used in RECORD.iter_unpack(body)]
