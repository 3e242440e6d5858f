"""DirectoryStore: snapshots in a local directory.

    ROOT/packs/<name>.pack         the new page blobs of one save each, with an index (kiln/snapshots/packs.py)
    ROOT/blobs/ab/<digest>.zst     page blobs of format-1 stores, one file each (read and collected, never written)
    ROOT/manifests/<id>.json       manifests
    ROOT/tmp/                      files being written (a crash leaves them here; gc removes them)
    ROOT/lock                      flock: saves hold it shared, gc exclusive
    ROOT/packs/lock                flock: a save holds it exclusive while it finds and packs the absent blobs
    ROOT/leases/<name>.json        a lease: holder, fencing token, holder process (host, pid), expiry (wall-clock seconds)
    ROOT/leases/tokens             the last fencing token granted (one counter for every name)
    ROOT/leases/lock               flock: lease changes hold it exclusive, fenced writes and reads shared
    ROOT/prefix/<space>.idx        the prefix store's records of one prefix space (kiln/snapshots/prefix_file.py)
    ROOT/prefix/lock               flock: changes to the prefix records hold it exclusive, reads shared
    ROOT/records/<kind>/<key>.json a keyed record (store.record_key of owner and key)

Crash safety: every file is written to tmp/, then renamed into place (rename is atomic). A save writes
the blobs the store lacks into one pack and renames it into packs/, writes the manifest to tmp/, makes
all of it durable with one syncfs of the filesystem (where there is none: fsync of each file and of
packs/), and only then renames the manifest into place (and fsyncs manifests/). Killed at any point,
the store holds the previous manifest or the new one with every blob it names. Packs are immutable;
each process keeps an index of digest -> (pack, offset), refreshed from packs/ (`_refresh`: other
processes add packs, gc removes them). Saves in one process pack a blob once; processes sharing a
directory may each pack a blob the other packed within the last second (a duplicate, never a loss).

Prefix pages are saved like a snapshot (their pack made durable by the same syncfs), then their records
are merged into their space's index file, which is rewritten beside itself and renamed into place.

gc keeps a pack while any manifest or prefix record names any page in it, and rewrites a pack whose live blobs are under
half its blob bytes into a new one (durable) before deleting it: every live blob is in a complete pack at
every instant.

Leases lapse by the wall clock, which every process on the machine shares. A fenced write checks the
lease and renames its manifest into place under the lease lock (shared), and every grant takes it
exclusive, so no grant can fall between the check and the write. The token counter is written durably
before a grant is returned; lease files need not be (a crash of the machine ends every holder too).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from kiln.errors import (
    FailedPreconditionError,
    LeaseHeldError,
    LeaseLostError,
    ResourceExhaustedError,
    UnavailableError,
)
from kiln.snapshots import packs, prefix_file
from kiln.snapshots.blobs import Blob
from kiln.snapshots.manifest import DIGEST, SNAPSHOT_ID, Manifest
from kiln.snapshots.store import (
    RECORD_KINDS,
    GcReport,
    Lease,
    PrefixKey,
    PrefixRecord,
    SaveReport,
    SnapshotStore,
    check_lease_name,
    check_lease_request,
    check_prefix_space,
    check_record_kind,
    lease_lost,
    record_key,
    stored_lease,
    this_host,
)

try:
    _syncfs = ctypes.CDLL(None, use_errno=True).syncfs
except (OSError, AttributeError):  # not Linux: fsync each file and directory instead
    _syncfs = None
LISTING_SLACK_S = 1.0  # filesystem timestamps tick coarsely (and may lag the wall clock a little)
LISTING_INTERVAL_S = 1.0  # how stale a process's view of other processes' new packs may be
LEASE_FILE_MAX = 4096  # a lease file's bytes: a holder id, a token, its process, an expiry


class DirectoryStore(SnapshotStore):
    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)
        with _io_errors(f"snapshot directory {root}"):
            for sub in ("packs", "blobs", "manifests", "tmp", "leases", "prefix",
                        *(f"records/{kind}" for kind in RECORD_KINDS)):
                (root / sub).mkdir(parents=True, exist_ok=True)
            for lock in ("lock", "packs/lock", "leases/lock", "prefix/lock"):
                (root / lock).touch()
        self._index_lock = threading.Lock()
        self._packs: dict[str, dict[str, packs.Entry] | None] = {}  # pack name -> its index (None: unreadable)
        self._where: dict[str, tuple[str, packs.Entry]] = {}  # digest -> (pack name, entry)
        self._listed = (-1, 0.0, -LISTING_INTERVAL_S)  # (packs/ mtime_ns, time.time(), time.monotonic()) when last listed

    # ---- blobs ------------------------------------------------------------------------------------

    def _legacy_path(self, digest: str) -> str:
        return os.path.join(self.root, "blobs", digest[:2], f"{digest}.zst")

    def _pack_path(self, name: str) -> Path:
        return self.root / "packs" / name

    def _refresh(self, force: bool = False) -> None:
        """Bring the digest index up to packs/: packs other processes wrote are added, packs a gc removed
        are dropped; only new packs' indexes are read. Unless `force`d, packs/ is listed at most every
        LISTING_INTERVAL_S and only if its mtime moved (as in git's racy-index check, an mtime within
        LISTING_SLACK_S of the listing is not trusted): a save need not list a directory of thousands of
        packs. What that may miss is safe: a blob another process packed since is written again (a
        duplicate), and `missing` and `get_blobs` force a listing when a pack they count on is gone or a
        blob is not indexed."""
        directory = self.root / "packs"
        mtime = os.stat(directory).st_mtime_ns
        listing = (mtime, time.time(), time.monotonic())
        with self._index_lock:
            listed_mtime, listed_wall, listed_mono = self._listed
            unchanged = mtime == listed_mtime and listed_wall - mtime / 1e9 > LISTING_SLACK_S
            if not force and (unchanged or listing[2] - listed_mono < LISTING_INTERVAL_S):
                return
        names = {name for name in os.listdir(directory) if name.endswith(packs.SUFFIX)}
        with self._index_lock:
            self._listed = listing
            gone, new = self._packs.keys() - names, names - self._packs.keys()
            for name in gone:
                del self._packs[name]
            if gone:  # a digest of a removed pack may live on in another (gc rewrote it there)
                self._where = {}
                for name, index in self._packs.items():
                    self._add_pack(name, index)
            for name in new:
                self._add_pack(name, self._read_index(name))

    def _add_pack(self, name: str, index: dict[str, packs.Entry] | None) -> None:
        """Called with the index lock held."""
        self._packs[name] = index
        for digest, entry in (index or {}).items():
            self._where.setdefault(digest, (name, entry))

    def _read_index(self, name: str) -> dict[str, packs.Entry] | None:
        """A pack's index, or None if it is damaged (its blobs are then missing: restores that need them
        refuse, and gc keeps the file, as it cannot tell which blobs it holds)."""
        try:
            with open(self._pack_path(name), "rb") as file:
                return packs.read_index(file, os.fstat(file.fileno()).st_size, name)
        except FileNotFoundError:
            return {}
        except FailedPreconditionError:
            return None

    def missing(self, digests: Iterable[str]) -> set[str]:
        """A blob counts as stored only if the pack the index names for it still exists (a gc or a hand
        may have removed it): one stat per pack, not per blob."""
        wanted = set(digests)
        with _io_errors("checking snapshot blobs"):
            self._refresh()
            for attempt in range(2):
                with self._index_lock:
                    absent = {d for d in wanted if d not in self._where}
                    holding = {self._where[d][0] for d in wanted - absent}
                if attempt or all(self._pack_path(name).exists() for name in holding):
                    break
                self._refresh(force=True)
            if absent and self._has_legacy_blobs():
                absent = {d for d in absent if not os.path.exists(self._legacy_path(d))}
            return absent

    def _has_legacy_blobs(self) -> bool:
        with os.scandir(self.root / "blobs") as entries:
            return any(True for _ in entries)

    def blob_sizes(self, digests: Iterable[str]) -> dict[str, int]:
        """From the packs' indexes in memory; a format-1 blob file's size from a stat."""
        wanted = set(digests)
        with _io_errors("reading snapshot blob sizes"):
            self._refresh()
            with self._index_lock:
                sizes = {d: self._where[d][1].length for d in wanted if d in self._where}
            for digest in wanted - sizes.keys() if self._has_legacy_blobs() else ():
                try:
                    sizes[digest] = os.stat(self._legacy_path(digest)).st_size
                except FileNotFoundError:
                    continue
        return sizes

    def get_blob(self, digest: str) -> bytes | None:
        return self.get_blobs([digest]).get(digest)

    def get_blobs(self, digests: Iterable[str]) -> dict[str, bytes]:
        """Each pack holding some of `digests` is opened once and read front to back."""
        wanted = set(digests)
        with _io_errors("reading snapshot blobs"):
            found: dict[str, bytes] = {}
            for attempt in range(2):  # a blob not indexed, or a pack gone since: list packs/ once
                self._refresh(force=attempt > 0)
                with self._index_lock:
                    by_pack: dict[str, dict[str, packs.Entry]] = {}
                    for digest in wanted - found.keys():
                        if digest in self._where:
                            name, entry = self._where[digest]
                            by_pack.setdefault(name, {})[digest] = entry
                vanished = False
                for name, entries in sorted(by_pack.items()):
                    try:
                        with open(self._pack_path(name), "rb") as file:
                            found.update(packs.read_blobs(file, entries))
                    except FileNotFoundError:
                        vanished = True
                if not vanished and len(found) == len(wanted):
                    break
            for digest in wanted - found.keys():
                try:
                    with open(self._legacy_path(digest), "rb") as file:
                        found[digest] = file.read()
                except FileNotFoundError:
                    continue
            return found

    # ---- manifests --------------------------------------------------------------------------------

    def _manifest_path(self, snapshot_id: str) -> Path:
        return self.root / "manifests" / f"{snapshot_id}.json"

    def manifest_bytes(self, snapshot_id: str) -> bytes | None:
        with _io_errors("reading a snapshot manifest"):
            try:
                return self._manifest_path(snapshot_id).read_bytes()
            except FileNotFoundError:
                return None

    def manifest_ids(self, owner: str | None = None) -> list[str]:
        """Every id: a directory has no owner index (manifests() filters by owner after reading)."""
        with _io_errors("listing snapshots"):
            names = (p.name.removesuffix(".json") for p in (self.root / "manifests").iterdir() if p.suffix == ".json")
            return sorted(name for name in names if SNAPSHOT_ID.fullmatch(name))

    def delete_manifest(self, snapshot_id: str, fence: Lease | None = None) -> bool:
        with _io_errors("deleting a snapshot"), self._lock(fcntl.LOCK_SH), self._fenced(fence):
            try:
                self._manifest_path(snapshot_id).unlink()
            except FileNotFoundError:
                return False
            _fsync_dir(self.root / "manifests")
            return True

    def close(self) -> None:
        """Nothing to release: files are opened per call."""

    # ---- save and gc ------------------------------------------------------------------------------

    def save(self, manifest: Manifest, blobs: dict[str, Blob], fence: Lease | None = None) -> SaveReport:
        """One flush per save (syncfs): the pack, its name in packs/ and the manifest's bytes; then the
        manifest's rename and the fsync of manifests/. A pack is visible before that flush, so a save
        beside this one may count on its blobs: that save's own flush makes them durable too."""
        with _io_errors("saving a snapshot"), self._lock(fcntl.LOCK_SH):
            needed = manifest.digests()
            absent, written = self._store_blobs(needed, blobs)
            data = manifest.to_json()
            staged = self._stage(data, sync=_syncfs is None)
            try:
                if _syncfs is not None:
                    self._syncfs()
                with self._fenced(fence):
                    os.replace(staged, self._manifest_path(manifest.snapshot_id))
                    _fsync_dir(self.root / "manifests")
            finally:
                staged.unlink(missing_ok=True)
            return SaveReport(len(absent), written + len(data), len(needed) - len(absent))

    def _store_blobs(self, needed: set[str], blobs: dict[str, Blob]) -> tuple[set[str], int]:
        """Pack the blobs among `needed` the store lacks (taken from `blobs`: FailedPreconditionError if one is
        not there); returns them and the pack's size. Called with ROOT/lock held shared; the caller makes the
        pack durable (syncfs) where it is not already."""
        with self._lock(fcntl.LOCK_EX, "packs/lock"):  # set-if-absent: concurrent saves pack a blob once
            absent = self.missing(needed)
            unknown = absent - blobs.keys()
            if unknown:
                raise FailedPreconditionError(f"page blob {min(unknown)[:16]} is neither stored nor part of this save")
            written = self._write_pack([(d, blobs[d]) for d in sorted(absent)], durable=_syncfs is None) if absent else 0
        return absent, written

    def _write_pack(self, entries: list[tuple[str, Blob]], durable: bool) -> int:
        """One new pack of `entries`, renamed into packs/ complete and then indexed; `durable`: fsync of
        the file and of packs/ first (else the caller flushes). Returns its size. Two saves may pack the
        same blob: the index serves either copy."""
        name = secrets.token_hex(12) + packs.SUFFIX
        tmp = self.root / "tmp" / name
        try:
            with open(tmp, "wb") as file:
                index = packs.write_pack(file, entries)
                file.flush()
                if durable:
                    os.fsync(file.fileno())
                size = file.tell()
            os.rename(tmp, self._pack_path(name))
        finally:
            tmp.unlink(missing_ok=True)
        if durable:
            _fsync_dir(self.root / "packs")
        with self._index_lock:
            self._add_pack(name, index)
        return size

    def gc(self) -> GcReport:
        with _io_errors("collecting snapshot garbage"), self._lock(fcntl.LOCK_EX):
            manifests = self.gc_manifests()
            referenced = set().union(*(m.digests() for m in manifests)) if manifests else set()
            referenced |= self._prefix_digests()
            kept = deleted = freed = 0
            self._refresh(force=True)
            with self._index_lock:
                stored = dict(self._packs)
            for name, index in sorted(stored.items()):
                if index is None:  # unreadable: which blobs it holds is unknown, so it stays
                    continue
                live = {d: entry for d, entry in index.items() if d in referenced}
                live_bytes = sum(entry.length for entry in live.values())
                if live and live_bytes * 2 >= sum(entry.length for entry in index.values()):
                    kept += len(live)  # its dead blobs stay until they are half its blob bytes
                    continue
                size = self._pack_path(name).stat().st_size
                if live:
                    with open(self._pack_path(name), "rb") as file:
                        self._write_pack(sorted(packs.read_blobs(file, live).items()), durable=True)
                    kept += len(live)
                self._pack_path(name).unlink()
                freed += size
                deleted += len(index) - len(live)
            for path in (self.root / "blobs").glob("*/*.zst"):
                digest = path.name.removesuffix(".zst")
                if DIGEST.fullmatch(digest) and digest in referenced:
                    kept += 1
                    continue
                freed += path.stat().st_size
                path.unlink()
                deleted += 1
            for path in (self.root / "tmp").iterdir():  # no save runs now: these are from crashed ones
                path.unlink()
            self._refresh(force=True)
            self._prune_leases()
            return GcReport(len(manifests), kept, deleted, freed)

    # ---- prefix records ---------------------------------------------------------------------------

    def save_prefix(self, space: str, records: Sequence[PrefixRecord], blobs: dict[str, Blob]) -> SaveReport:
        """As `save`: the pack made durable (one syncfs) before the records name its blobs."""
        check_prefix_space(space)
        with _io_errors("saving prefix pages"), self._lock(fcntl.LOCK_SH):
            needed = {record.digest for record in records}
            absent, written = self._store_blobs(needed, blobs)
            if absent and _syncfs is not None:
                self._syncfs()
            self._change_prefix(space, lambda current: current.update((r.key, r) for r in records))
            return SaveReport(len(absent), written, len(needed) - len(absent))

    def prefix_records(self, space: str) -> list[PrefixRecord]:
        check_prefix_space(space)
        with _io_errors("reading prefix records"), self._lock(fcntl.LOCK_SH, "prefix/lock"):
            return self._read_prefix(self._prefix_path(space))

    def touch_prefix(self, space: str, used: dict[PrefixKey, float]) -> None:
        check_prefix_space(space)

        def touch(current: dict[PrefixKey, PrefixRecord]) -> None:
            for key, at in used.items():
                if key in current and at > current[key].last_used:
                    current[key] = replace(current[key], last_used=at)

        with _io_errors("touching prefix records"):
            self._change_prefix(space, touch)

    def drop_prefix(self, space: str, keys: Iterable[PrefixKey]) -> None:
        check_prefix_space(space)
        gone = set(keys)

        def drop(current: dict[PrefixKey, PrefixRecord]) -> None:
            for key in gone:
                current.pop(key, None)

        with _io_errors("dropping prefix records"):
            self._change_prefix(space, drop)

    def _prefix_path(self, space: str) -> Path:
        return self.root / "prefix" / f"{space}{prefix_file.SUFFIX}"

    def _read_prefix(self, path: Path) -> list[PrefixRecord]:
        try:
            return prefix_file.decode(path.read_bytes())
        except FileNotFoundError:
            return []

    def _change_prefix(self, space: str, change: Callable[[dict[PrefixKey, PrefixRecord]], None]) -> None:
        """Read a space's records, `change` them in place, write them back whole (read-modify-write under
        the exclusive prefix lock: writers of several processes never lose each other's records)."""
        path = self._prefix_path(space)
        with self._lock(fcntl.LOCK_EX, "prefix/lock"):
            current = {record.key: record for record in self._read_prefix(path)}
            change(current)
            self._write_file(path, prefix_file.encode(current.values()), sync=False, beside=True)

    def _prefix_digests(self) -> set[str]:
        """Every blob a prefix record of any space names (gc keeps them)."""
        with self._lock(fcntl.LOCK_SH, "prefix/lock"):
            paths = (self.root / "prefix").glob(f"*{prefix_file.SUFFIX}")
            return {record.digest for path in paths for record in self._read_prefix(path)}

    # ---- keyed records ------------------------------------------------------------------------------

    def record(self, kind: str, owner: str, key: str) -> bytes | None:
        with _io_errors(f"reading a {kind} record"):
            try:
                return self._record_path(kind, owner, key).read_bytes()
            except FileNotFoundError:
                return None

    def put_record(self, kind: str, owner: str, key: str, data: bytes) -> None:
        path = self._record_path(kind, owner, key)
        with _io_errors(f"writing a {kind} record"):
            self._write_file(path, data, sync=True)
            _fsync_dir(path.parent)

    def delete_record(self, kind: str, owner: str, key: str) -> bool:
        path = self._record_path(kind, owner, key)
        with _io_errors(f"deleting a {kind} record"):
            try:
                path.unlink()
            except FileNotFoundError:
                return False
            _fsync_dir(path.parent)
            return True

    def _record_path(self, kind: str, owner: str, key: str) -> Path:
        check_record_kind(kind)
        return self.root / "records" / kind / f"{record_key(owner, key)}.json"

    # ---- leases -----------------------------------------------------------------------------------

    def acquire_lease(self, name: str, holder: str, ttl_s: float) -> Lease:
        check_lease_request(name, holder, ttl_s)
        with _io_errors("taking a lease"), self._lock(fcntl.LOCK_EX, "leases/lock"):
            current = self._live_lease(name)
            if current is not None and current.holder != holder:
                raise LeaseHeldError(f"{name} is leased to {current.holder} for another "
                                     f"{current.expires_at - time.time():.1f} s", current.holder, current.expires_at)
            token = current.token if current is not None else self._next_token()
            return self._write_lease(Lease(name, holder, token, time.time() + ttl_s, this_host(), os.getpid()))

    def renew_leases(self, leases: Sequence[Lease], ttl_s: float) -> list[Lease | LeaseLostError]:
        for lease in leases:
            check_lease_request(lease.name, lease.holder, ttl_s)
        renewed: list[Lease | LeaseLostError] = []
        with _io_errors("renewing leases"), self._lock(fcntl.LOCK_EX, "leases/lock"):
            for lease in leases:
                renewed.append(self._renew_in_place(lease, ttl_s))
        return renewed

    def _renew_in_place(self, lease: Lease, ttl_s: float) -> Lease | LeaseLostError:
        """Four system calls (open, read, write in place, close; no staging file, no rename): while another
        thread keeps the interpreter busy each call may wait out a GIL switch interval, and the stage-and-
        rename write took ~27 ms a lease that way, so 1,000 sessions' leases lapsed before their renewal
        came round. The exclusive lease lock keeps readers from seeing the write half done; a file of
        another length (written before this format) is rewritten whole."""
        try:
            fd = os.open(self._lease_path(lease.name), os.O_RDWR)
        except FileNotFoundError:
            return lease_lost(lease, None)
        try:
            raw = os.pread(fd, LEASE_FILE_MAX, 0)
            stored = _parse_lease(lease.name, raw)
            live = stored if stored is not None and stored.expires_at > time.time() else None
            if not lease.same_grant(live):
                return lease_lost(lease, live)
            renewed = replace(lease, expires_at=time.time() + ttl_s)
            data = _lease_bytes(renewed)
            if len(data) == len(raw):
                os.pwrite(fd, data, 0)
                return renewed
        finally:
            os.close(fd)
        return self._write_lease(renewed)

    def release_lease(self, lease: Lease) -> bool:
        with _io_errors("releasing a lease"), self._lock(fcntl.LOCK_EX, "leases/lock"):
            stored = self._stored_lease(lease.name)
            if not lease.same_grant(stored):
                return False
            self._lease_path(lease.name).unlink()
            return stored.expires_at > time.time()

    def lease_of(self, name: str) -> Lease | None:
        check_lease_name(name)
        with _io_errors("reading a lease"), self._lock(fcntl.LOCK_SH, "leases/lock"):
            return self._live_lease(name)

    @contextlib.contextmanager
    def _fenced(self, fence: Lease | None) -> Iterator[None]:
        """Hold the lease lock shared while the caller writes, having checked that `fence` (if any) is the
        live lease of its name: no grant can come between the check and the write."""
        if fence is None:
            yield
            return
        with self._lock(fcntl.LOCK_SH, "leases/lock"):
            current = self._live_lease(fence.name)
            if not fence.same_grant(current):
                raise lease_lost(fence, current)
            yield

    def _lease_path(self, name: str) -> Path:
        return self.root / "leases" / f"{name}.json"

    def _stored_lease(self, name: str) -> Lease | None:
        """The lease file of `name`, live or lapsed; None if absent or unreadable (a file torn by a crash of
        the machine, whose holders died with it)."""
        try:
            return _parse_lease(name, self._lease_path(name).read_bytes())
        except FileNotFoundError:
            return None

    def _live_lease(self, name: str) -> Lease | None:
        lease = self._stored_lease(name)
        return lease if lease is not None and lease.expires_at > time.time() else None

    def _write_lease(self, lease: Lease) -> Lease:
        self._write_file(self._lease_path(lease.name), _lease_bytes(lease), sync=False, beside=True)
        return lease

    def _next_token(self) -> int:
        """The next fencing token, made durable before it is used: tokens never repeat, even across a
        crash of the machine. Called under the exclusive lease lock."""
        path = self.root / "leases" / "tokens"
        try:
            last = int(path.read_text()) if path.exists() else 0
        except ValueError:
            raise UnavailableError(f"the lease token counter {path} is unreadable") from None
        self._write_file(path, str(last + 1).encode(), sync=True, beside=True)
        _fsync_dir(path.parent)
        return last + 1

    def _prune_leases(self) -> None:
        """Delete lapsed lease files and leftovers of killed lease writes (tokens stay unique: the counter
        is separate)."""
        with self._lock(fcntl.LOCK_EX, "leases/lock"):
            for path in (self.root / "leases").glob("*.json"):
                if self._live_lease(path.name.removesuffix(".json")) is None:
                    path.unlink()
            for path in (self.root / "leases").glob("*.tmp"):
                path.unlink()

    def _write_file(self, path: Path, data: bytes, sync: bool, beside: bool = False) -> Path:
        """Write via tmp/ and rename (replacing what is there); fsync first if `sync`. No partial file is
        ever at `path`. `beside` writes PATH.tmp instead, for lease files: they change under the
        exclusive lease lock, which gc (emptying tmp/) does not take, and that lock makes one name enough."""
        staged = self._stage(data, sync, path.with_name(f"{path.name}.tmp") if beside else None)
        try:
            os.replace(staged, path)
        finally:
            staged.unlink(missing_ok=True)
        return path

    def _stage(self, data: bytes, sync: bool, tmp: Path | None = None) -> Path:
        """`data` in a new file (under tmp/ unless `tmp` names one), fsynced if `sync`, to be renamed into
        place; nothing is left behind if writing fails."""
        tmp = tmp or self.root / "tmp" / f"{secrets.token_hex(8)}.json"
        try:
            with open(tmp, "wb") as file:
                file.write(data)
                if sync:
                    file.flush()
                    os.fsync(file.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def _syncfs(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            if _syncfs(fd) != 0:
                code = ctypes.get_errno()
                raise OSError(code, os.strerror(code))
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _lock(self, mode: int, name: str = "lock") -> Iterator[None]:
        """flock on ROOT/`name`, released when the block ends (order: ROOT/lock before packs/lock,
        leases/lock or prefix/lock, never two of those at once)."""
        with open(self.root / name, "rb") as lock:
            fcntl.flock(lock, mode)
            yield  # closing the file releases the lock


def _lease_bytes(lease: Lease) -> bytes:
    """A lease file's contents; the expiry has a fixed width, so a renewal rewrites the same bytes' span."""
    return (f'{{"holder": {json.dumps(lease.holder)}, "token": {lease.token}, "host": {json.dumps(lease.host)}, '
            f'"pid": {lease.pid}, "expires_at": {lease.expires_at:.6f}}}').encode()


def _parse_lease(name: str, raw: bytes) -> Lease | None:
    """None if unreadable (a file torn by a crash of the machine, whose holders died with it)."""
    try:
        fields = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(fields, dict):
        return None
    return stored_lease(name, fields.get("holder"), fields.get("token"), fields.get("expires_at"),
                        fields.get("host", ""), fields.get("pid", 0))  # no host or pid in older lease files


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _io_errors(what: str) -> Iterator[None]:
    """OS errors as typed errors: a full disk is RESOURCE_EXHAUSTED, anything else UNAVAILABLE."""
    try:
        yield
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ResourceExhaustedError(f"{what}: the snapshot store is full ({error.strerror})") from None
        raise UnavailableError(f"{what}: {error}") from None
