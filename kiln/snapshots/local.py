"""DirectoryStore: snapshots in a local directory.

    ROOT/blobs/ab/<digest>.zst     page blobs, in 256 fan-out directories
    ROOT/manifests/<id>.json       manifests
    ROOT/tmp/                      files being written (a crash leaves them here; gc removes them)
    ROOT/lock                      flock: saves hold it shared, gc exclusive
    ROOT/leases/<name>.json        a lease: holder, fencing token, expiry (wall-clock seconds)
    ROOT/leases/tokens             the last fencing token granted (one counter for every name)
    ROOT/leases/lock               flock: lease changes hold it exclusive, fenced writes and reads shared

Crash safety: every file is written to tmp/, then renamed into place (rename is atomic). A save writes
its new blobs, makes them durable with one syncfs of the filesystem (one flush for hundreds of blobs
instead of an fsync each), then writes the manifest (fsync, rename, fsync of the manifests directory).
Killed at any point, the store holds the previous manifest or the new one with every blob it names.

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
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from kiln.errors import (
    FailedPreconditionError,
    LeaseHeldError,
    LeaseLostError,
    ResourceExhaustedError,
    UnavailableError,
)
from kiln.snapshots.manifest import DIGEST, SNAPSHOT_ID, Manifest
from kiln.snapshots.store import (
    GcReport,
    Lease,
    SaveReport,
    SnapshotStore,
    check_lease_name,
    check_lease_request,
    lease_lost,
)

try:
    _syncfs = ctypes.CDLL(None, use_errno=True).syncfs
except (OSError, AttributeError):  # not Linux: fsync each file instead
    _syncfs = None
WRITE_THREADS = 4  # blob files are written in parallel: creating, writing and renaming a file is mostly waiting


class DirectoryStore(SnapshotStore):
    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)
        with _io_errors(f"snapshot directory {root}"):
            for sub in ("blobs", "manifests", "tmp", "leases"):
                (root / sub).mkdir(parents=True, exist_ok=True)
            (root / "lock").touch()
            (root / "leases" / "lock").touch()
        self._pool = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="kiln-snapshot-write")

    # ---- blobs ------------------------------------------------------------------------------------

    def _blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / digest[:2] / f"{digest}.zst"

    def missing(self, digests: Iterable[str]) -> set[str]:
        return {d for d in digests if not self._blob_path(d).exists()}

    def blob_sizes(self, digests: Iterable[str]) -> dict[str, int]:
        sizes = {}
        with _io_errors("reading a snapshot blob's size"):
            for digest in digests:
                try:
                    sizes[digest] = self._blob_path(digest).stat().st_size
                except FileNotFoundError:
                    continue
        return sizes

    def get_blob(self, digest: str) -> bytes | None:
        with _io_errors("reading a snapshot blob"):
            try:
                return self._blob_path(digest).read_bytes()
            except FileNotFoundError:
                return None

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
        self._pool.shutdown()

    # ---- save and gc ------------------------------------------------------------------------------

    def save(self, manifest: Manifest, blobs: dict[str, bytes], fence: Lease | None = None) -> SaveReport:
        with _io_errors("saving a snapshot"), self._lock(fcntl.LOCK_SH):
            needed = sorted(manifest.digests())
            absent = self.missing(needed)
            unknown = absent - blobs.keys()
            if unknown:
                raise FailedPreconditionError(f"page blob {min(unknown)[:16]} is neither stored nor part of this save")
            created = [d for d, new in zip(sorted(absent), self._pool.map(lambda d: self._write_blob(d, blobs[d]), sorted(absent)),
                                           strict=True) if new]
            if absent and _syncfs is not None:
                self._syncfs()
            data = manifest.to_json()
            with self._fenced(fence):
                self._write_file(self._manifest_path(manifest.snapshot_id), data, sync=True)
                _fsync_dir(self.root / "manifests")
            return SaveReport(len(created), sum(len(blobs[d]) for d in created) + len(data), len(needed) - len(created))

    def _write_blob(self, digest: str, data: bytes) -> bool:
        """Set-if-absent: the blob is written to tmp/ and hard-linked into place, which fails if a save
        beside this one got there first. True if this call created it."""
        path = self._blob_path(digest)
        path.parent.mkdir(exist_ok=True)
        tmp = self.root / "tmp" / f"{path.name}.{secrets.token_hex(6)}"
        try:
            with open(tmp, "wb") as file:
                file.write(data)
                if _syncfs is None:
                    file.flush()
                    os.fsync(file.fileno())
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def gc(self) -> GcReport:
        with _io_errors("collecting snapshot garbage"), self._lock(fcntl.LOCK_EX):
            manifests = self.gc_manifests()
            referenced = set().union(*(m.digests() for m in manifests)) if manifests else set()
            kept = deleted = freed = 0
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
            self._prune_leases()
            return GcReport(len(manifests), kept, deleted, freed)

    # ---- leases -----------------------------------------------------------------------------------

    def acquire_lease(self, name: str, holder: str, ttl_s: float) -> Lease:
        check_lease_request(name, holder, ttl_s)
        with _io_errors("taking a lease"), self._lock(fcntl.LOCK_EX, "leases/lock"):
            current = self._live_lease(name)
            if current is not None and current.holder != holder:
                raise LeaseHeldError(f"{name} is leased to {current.holder} for another "
                                     f"{current.expires_at - time.time():.1f} s", current.holder, current.expires_at)
            token = current.token if current is not None else self._next_token()
            return self._write_lease(Lease(name, holder, token, time.time() + ttl_s))

    def renew_leases(self, leases: Sequence[Lease], ttl_s: float) -> list[Lease | LeaseLostError]:
        for lease in leases:
            check_lease_request(lease.name, lease.holder, ttl_s)
        renewed: list[Lease | LeaseLostError] = []
        with _io_errors("renewing leases"), self._lock(fcntl.LOCK_EX, "leases/lock"):
            for lease in leases:
                current = self._live_lease(lease.name)
                if lease.same_grant(current):
                    renewed.append(self._write_lease(replace(lease, expires_at=time.time() + ttl_s)))
                else:
                    renewed.append(lease_lost(lease, current))
        return renewed

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
            raw = json.loads(self._lease_path(name).read_bytes())
            return Lease(name, str(raw["holder"]), int(raw["token"]), float(raw["expires_at"]))
        except (FileNotFoundError, ValueError, TypeError, KeyError):
            return None

    def _live_lease(self, name: str) -> Lease | None:
        lease = self._stored_lease(name)
        return lease if lease is not None and lease.expires_at > time.time() else None

    def _write_lease(self, lease: Lease) -> Lease:
        data = json.dumps({"holder": lease.holder, "token": lease.token, "expires_at": lease.expires_at}).encode()
        self._write_file(self._lease_path(lease.name), data, sync=False, beside=True)
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
        tmp = path.with_name(f"{path.name}.tmp") if beside else self.root / "tmp" / f"{path.name}.{secrets.token_hex(6)}"
        try:
            with open(tmp, "wb") as file:
                file.write(data)
                if sync:
                    file.flush()
                    os.fsync(file.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

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
        """flock on ROOT/`name`, released when the block ends (order: ROOT/lock before leases/lock)."""
        with open(self.root / name, "rb") as lock:
            fcntl.flock(lock, mode)
            yield  # closing the file releases the lock


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
