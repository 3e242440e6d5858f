"""Pack files: the new blobs of one save in one file, so a save creates, writes and syncs one file
instead of one per page, and a restore reads its pages in one sequential pass.

    blob, blob, ...                   each blob as blobs.encode made it (self-describing)
    index                             per blob: digest (32 bytes), offset (u64), length (u64)
    trailer                           MAGIC, blob count (u64), SHA-256 of the index

Pages stay content-addressed: the index names each blob by its digest, so dedup works across packs as
it did across blob files. The index is checked by its own SHA-256 and every entry must lie inside the
data area: a pack with a damaged index is refused whole (FailedPreconditionError), and a damaged blob is
caught by its digest when it is decoded.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO

from kiln.errors import FailedPreconditionError

MAGIC = b"KILNPAK1"
ENTRY = struct.Struct("<32sQQ")
TRAILER = struct.Struct("<8sQ32s")
SUFFIX = ".pack"


@dataclass(frozen=True)
class Entry:
    offset: int
    length: int


def write_pack(file: BinaryIO, blobs: Iterable[tuple[str, bytes | memoryview]]) -> dict[str, Entry]:
    """Write blobs (digest, blob) and their index to `file`; returns the index. Bytes written:
    sum of the blob lengths + ENTRY.size per blob + TRAILER.size."""
    index: dict[str, Entry] = {}
    offset = 0
    for digest, blob in blobs:
        file.write(blob)
        index[digest] = Entry(offset, len(blob))
        offset += len(blob)
    table = b"".join(ENTRY.pack(bytes.fromhex(digest), entry.offset, entry.length) for digest, entry in index.items())
    file.write(table)
    file.write(TRAILER.pack(MAGIC, len(index), hashlib.sha256(table).digest()))
    return index


def read_index(file: BinaryIO, size: int, where: str) -> dict[str, Entry]:
    """The index of a pack of `size` bytes, verified; FailedPreconditionError naming `where` if the
    trailer or index is damaged or an entry points outside the data."""
    if size < TRAILER.size:
        raise FailedPreconditionError(f"snapshot pack {where} is truncated ({size} bytes)")
    file.seek(size - TRAILER.size)
    magic, count, checksum = TRAILER.unpack(file.read(TRAILER.size))
    data_end = size - TRAILER.size - count * ENTRY.size
    if magic != MAGIC or data_end < 0:
        raise FailedPreconditionError(f"snapshot pack {where} has no valid trailer (corrupt or truncated)")
    file.seek(data_end)
    table = file.read(count * ENTRY.size)
    if hashlib.sha256(table).digest() != checksum:
        raise FailedPreconditionError(f"snapshot pack {where} has a corrupt index")
    index = {}
    for raw_digest, offset, length in ENTRY.iter_unpack(table):
        if offset + length > data_end:
            raise FailedPreconditionError(f"snapshot pack {where} indexes bytes past its data")
        index[raw_digest.hex()] = Entry(offset, length)
    return index


def read_blobs(file: BinaryIO, entries: dict[str, Entry]) -> dict[str, bytearray]:
    """The blobs of `entries` from an open pack, read in file order (one pass, no seeks back), each into
    its own writable buffer (a restore hands raw pages to torch without another copy)."""
    found = {}
    for digest, entry in sorted(entries.items(), key=lambda item: item[1].offset):
        file.seek(entry.offset)
        blob = bytearray(entry.length)
        read = file.readinto(blob)
        found[digest] = blob if read == entry.length else blob[:read]  # short: a truncated pack
    return found
