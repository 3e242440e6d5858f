"""release_free_memory returns the C heap's free pages: memory freed below a live allocation stays resident
under glibc's malloc until it is trimmed (what loading a model leaves behind, kiln/heap.py)."""

import ctypes.util
from pathlib import Path

import pytest

from kiln.heap import release_free_memory

pytestmark = pytest.mark.skipif(
    not hasattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "malloc_trim"), reason="glibc only"
)


def resident_bytes() -> int:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status["VmRSS"].split()[0]) * 1024


def test_freed_heap_memory_goes_back_to_the_os() -> None:
    blocks = [bytearray(64 * 1024) for _ in range(3000)]  # ~200 MB of heap blocks, below mmap's threshold
    pin = bytearray(64 * 1024)  # above them: the heap's top cannot shrink past it on its own
    del blocks
    held = resident_bytes()
    release_free_memory()
    assert held - resident_bytes() > 100 * 2**20
    del pin
