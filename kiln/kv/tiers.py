"""PageTiers: where pages that left the pool live, in the pool's own encoding (a KVCodec's bytes, moved
as they are): host memory, then disk.

Entries are content-addressed by the pool's key (KV group, chain hash), so sessions sharing a prefix
share tier pages, and reference-counted by the page tables that read them. Each tier has a byte budget
it never exceeds. A new page goes to host memory; when host memory is full its least recently used
page moves down to disk; when disk is full too, the least recently used page nobody references is
dropped (it was only a cache). If every page is referenced and both tiers are full, `hold` refuses and
the caller keeps the page resident: a tier never silently loses K/V someone reads.

Host memory is one pool of equal slots (an anonymous mapping, backed by memory only where written), so
attention reads a host page where it lies, as it reads the pool's pages (kiln/models/streamed_attention.py):
`locate` tells a page's tier and slot, `host_segments` gives the host slots' typed views, `copy` copies
pages (from disk, or with some from disk) into a caller's buffer.

Disk is one file of equal slots (a codec's pages all have `page_nbytes`) in the directory given, created
at start and unlinked at once, so nothing is left behind whatever way the process ends. It is read and
written with pread/pwrite, never memory-mapped: the file is sparse (a budget reserves nothing), and a
store through a mapping into a hole of a full filesystem is SIGBUS, which kills the process, where a
write is ENOSPC. A page whose write fails stays where it was (in host memory), the failure is counted
(`TierUsage.failed_disk_writes`) and logged, and `hold` goes on as if the disk were full.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kiln.errors import InvalidArgumentError, KilnError, ResourceExhaustedError, UnavailableError
from kiln.kv.codec import KVCodec, Segment
from kiln.kv.storage import zeroed_pool

logger = logging.getLogger(__name__)

TIERS = ("host", "disk")


@dataclass
class _Entry:
    tier: str
    where: int  # the page's slot in its tier
    refs: int = 0


@dataclass(frozen=True)
class TierUsage:
    pages: dict[str, int]
    bytes: dict[str, int]
    budget_bytes: dict[str, int]
    failed_disk_writes: int = 0  # pages that stayed in host memory because the disk write failed


class DiskSlots:
    """Equal slots of `slot_bytes` in an unlinked file in `directory`, by ordinary file I/O. A write that
    fails raises ResourceExhaustedError (no space, over quota) or UnavailableError (any other I/O error)
    and leaves every other slot as it was. The file descriptor closes with this object."""

    def __init__(self, directory: str, slot_bytes: int) -> None:
        try:
            fd, path = tempfile.mkstemp(prefix="kiln-kv-", suffix=".pages", dir=directory)
        except OSError as error:
            raise InvalidArgumentError(f"kv_disk_dir {directory!r} is not writable: {error}", "kv_disk_dir") from error
        os.unlink(path)
        self.directory, self.slot_bytes, self._fd = directory, slot_bytes, fd
        self._closer = weakref.finalize(self, os.close, fd)

    def write(self, slot: int, data: np.ndarray) -> None:
        """Store `data` (uint8 [slot_bytes]) in `slot`."""
        view, offset, done = memoryview(np.ascontiguousarray(data)), slot * self.slot_bytes, 0
        try:
            while done < self.slot_bytes:
                done += os.pwrite(self._fd, view[done:], offset + done)
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ResourceExhaustedError(f"the KV disk tier in {self.directory} is full ({error.strerror})") from None
            raise UnavailableError(f"writing the KV disk tier in {self.directory}: {error}") from None

    def read_into(self, slot: int, out: np.ndarray) -> None:
        """Read `slot` into `out` (uint8 [slot_bytes], contiguous)."""
        try:
            got = os.preadv(self._fd, [out], slot * self.slot_bytes)
        except OSError as error:
            raise UnavailableError(f"reading the KV disk tier in {self.directory}: {error}") from None
        if got != self.slot_bytes:
            raise UnavailableError(f"reading the KV disk tier in {self.directory}: slot {slot} is short ({got} bytes)")

    def close(self) -> None:
        self._closer()


class PageTiers:
    def __init__(self, codec: KVCodec, host_budget_bytes: int, disk_dir: str | None = None, disk_budget_bytes: int = 0) -> None:
        for option, value in (("kv_host_budget_mb", host_budget_bytes), ("kv_disk_budget_mb", disk_budget_bytes)):
            if value < codec.page_nbytes and (option == "kv_host_budget_mb" or disk_dir is not None):
                raise InvalidArgumentError(
                    f"{option} must hold at least one page ({codec.page_nbytes} bytes with kv_codec {codec.name!r})", option
                )
        self.codec = codec
        self._capacity = {"host": host_budget_bytes // codec.page_nbytes, "disk": 0}
        self._host = zeroed_pool(self._capacity["host"], codec.page_nbytes, torch.device("cpu"))
        self._free_host = list(range(self._capacity["host"] - 1, -1, -1))
        self._host_segments = [(codec.segment(self._host, 0, s), codec.segment(self._host, 1, s))
                               for s in range(codec.layout.slots)]
        self._entries: dict[Hashable, _Entry] = {}
        self._lru: dict[str, OrderedDict[Hashable, None]] = {tier: OrderedDict() for tier in TIERS}
        self._disk: DiskSlots | None = None
        self._free_slots: list[int] = []
        self._failed_disk_writes = 0
        self._disk_failing = False  # the last disk write failed (the next success logs recovery)
        if disk_dir is not None:
            self._open_disk(disk_dir, disk_budget_bytes // codec.page_nbytes)

    def _open_disk(self, directory: str, slots: int) -> None:
        if not os.path.isdir(directory):
            raise InvalidArgumentError(f"kv_disk_dir {directory!r} is not an existing directory", "kv_disk_dir")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise InvalidArgumentError(f"kv_disk_dir {directory!r} is not writable", "kv_disk_dir")
        self._disk = DiskSlots(directory, self.codec.page_nbytes)
        self._capacity["disk"] = slots
        self._free_slots = list(range(slots - 1, -1, -1))

    # ---- what the tiers hold --------------------------------------------------------------------------

    def usage(self) -> TierUsage:
        size = self.codec.page_nbytes
        pages = {tier: len(self._lru[tier]) for tier in TIERS}
        budgets = {t: n * size for t, n in self._capacity.items()}
        return TierUsage(pages, {t: n * size for t, n in pages.items()}, budgets, self._failed_disk_writes)

    def has(self, key: Hashable) -> bool:
        return key in self._entries

    def tier_of(self, key: Hashable) -> str:
        return self._entries[key].tier

    def references(self, key: Hashable | None = None) -> int:
        """Page tables referencing `key` (None: the sum over every page)."""
        if key is None:
            return sum(entry.refs for entry in self._entries.values())
        return self._entries[key].refs

    # ---- references -----------------------------------------------------------------------------------

    def hold(self, key: Hashable, page: torch.Tensor) -> bool:
        """Take a reference to `key`, storing a copy of `page` (a pool page's bytes, uint8 [page_nbytes])
        under it if no tier has it yet. False (nothing changed) when every tier is full of referenced pages."""
        entry = self._entries.get(key)
        if entry is None:
            if not self._room_in_host():
                return False
            entry = _Entry("host", self._free_host.pop())
            self._host[entry.where].copy_(page)
            self._entries[key] = entry
        entry.refs += 1
        self._lru[entry.tier][key] = None
        self._lru[entry.tier].move_to_end(key)
        return True

    def acquire(self, key: Hashable) -> None:
        self._entries[key].refs += 1

    def release(self, key: Hashable) -> None:
        """Drop one reference; an unreferenced page stays (a cache) until its tier needs the room."""
        entry = self._entries[key]
        if entry.refs <= 0:
            raise RuntimeError("tier page released more times than acquired")
        entry.refs -= 1

    # ---- reads ----------------------------------------------------------------------------------------

    def load(self, keys: Sequence[Hashable], slot: int, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Decode K and V of one slot of each page into out[0][i], out[1][i] (each [page_size, kv_heads,
        head_dim]), all pages in one pass; marks the pages recently used."""
        entries = [self._entries[key] for key in keys]
        stacked = torch.empty((len(entries), self.codec.page_nbytes), dtype=torch.uint8)
        for row, entry in zip(stacked, entries, strict=True):
            self._read_into(entry, row)
        for kind in range(2):
            self.codec.load(self.codec.segment(stacked, kind, slot), None, out[kind])
        for key, entry in zip(keys, entries, strict=True):
            self._lru[entry.tier].move_to_end(key)

    def locate(self, keys: Sequence[Hashable]) -> list[tuple[str, int]]:
        """Each page's tier and slot there (host: a row of `host_segments`), marking the pages recently
        used: their reader attends them next."""
        out = []
        for key in keys:
            entry = self._entries[key]
            self._lru[entry.tier].move_to_end(key)
            out.append((entry.tier, entry.where))
        return out

    def host_segments(self, slot: int) -> tuple[Segment, Segment]:
        """K and V of one slot across the host tier's pages, as the codec's typed views."""
        return self._host_segments[slot]

    def copy(self, places: Sequence[tuple[str, int]], out: torch.Tensor) -> None:
        """The pages at `places` (as `locate` tells them) into out[i] (uint8 [len(places), page_nbytes], contiguous)."""
        for (tier, slot), row in zip(places, out, strict=True):
            self._read_into(_Entry(tier, slot), row)

    def page(self, key: Hashable) -> torch.Tensor:
        """A copy of the page's bytes (uint8 [page_nbytes])."""
        out = torch.empty(self.codec.page_nbytes, dtype=torch.uint8)
        self._read_into(self._entries[key], out)
        return out

    def _read_into(self, entry: _Entry, out: torch.Tensor) -> None:
        if entry.tier == "host":
            out.copy_(self._host[entry.where])
        else:
            self._disk.read_into(entry.where, out.numpy())  # type: ignore[union-attr, arg-type]

    # ---- moves ----------------------------------------------------------------------------------------

    def _room_in_host(self) -> bool:
        """Make room for one more host page: move the coldest host page to disk (dropping the coldest
        unreferenced disk page if disk is full), else drop the coldest unreferenced host page."""
        if len(self._lru["host"]) < self._capacity["host"]:
            return True
        if self._capacity["disk"] and (self._free_slots or self._drop_unreferenced("disk")) and self._move_down():
            return True
        return self._drop_unreferenced("host")

    def _move_down(self) -> bool:
        """Write the coldest host page to a free disk slot and move it there; False (the page stays in
        host memory, the slot stays free) if the write fails."""
        key = next(iter(self._lru["host"]))
        entry = self._entries[key]
        slot = self._free_slots.pop()
        try:
            self._disk.write(slot, self._host[entry.where].numpy())  # type: ignore[union-attr]
        except (ResourceExhaustedError, UnavailableError) as error:
            self._free_slots.append(slot)
            self._disk_write_failed(error)
            return False
        if self._disk_failing:
            self._disk_failing = False
            logger.warning("the KV disk tier takes pages again")
        del self._lru["host"][key]
        self._free_host.append(entry.where)
        entry.tier, entry.where = "disk", slot
        self._lru["disk"][key] = None
        return True

    def _disk_write_failed(self, error: KilnError) -> None:
        self._failed_disk_writes += 1
        if not self._disk_failing:  # once per episode, not once per page
            self._disk_failing = True
            logger.warning("%s: pages stay in host memory (or resident) until it takes writes again", error)

    def _drop_unreferenced(self, tier: str) -> bool:
        victim = next((key for key in self._lru[tier] if self._entries[key].refs == 0), None)
        if victim is None:
            return False
        entry = self._entries.pop(victim)
        del self._lru[tier][victim]
        (self._free_slots if tier == "disk" else self._free_host).append(entry.where)
        return True
