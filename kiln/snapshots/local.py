"""DirectoryStore: snapshots in a local directory.

    ROOT/blobs/ab/<digest>.zst     page blobs, in 256 fan-out directories
    ROOT/manifests/<id>.json       manifests
    ROOT/tmp/                      files being written (a crash leaves them here; gc removes them)
    ROOT/lock                      flock: saves hold it shared, gc exclusive

Crash safety: every file is written to tmp/, then renamed into place (rename is atomic). A save writes
its new blobs, makes them durable with one syncfs of the filesystem (one flush for hundreds of blobs
instead of an fsync each), then writes the manifest (fsync, rename, fsync of the manifests directory).
Killed at any point, the store holds the previous manifest or the new one with every blob it names.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import secrets
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kiln.errors import FailedPreconditionError, ResourceExhaustedError, UnavailableError
from kiln.snapshots.manifest import DIGEST, SNAPSHOT_ID, Manifest
from kiln.snapshots.store import GcReport, SaveReport, SnapshotStore

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
            for sub in ("blobs", "manifests", "tmp"):
                (root / sub).mkdir(parents=True, exist_ok=True)
            (root / "lock").touch()
        self._pool = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="kiln-snapshot-write")

    # ---- blobs ------------------------------------------------------------------------------------

    def _blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / digest[:2] / f"{digest}.zst"

    def missing(self, digests: Iterable[str]) -> set[str]:
        return {d for d in digests if not self._blob_path(d).exists()}

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

    def delete_manifest(self, snapshot_id: str) -> bool:
        with _io_errors("deleting a snapshot"), self._lock(fcntl.LOCK_SH):
            try:
                self._manifest_path(snapshot_id).unlink()
            except FileNotFoundError:
                return False
            _fsync_dir(self.root / "manifests")
            return True

    def close(self) -> None:
        self._pool.shutdown()

    # ---- save and gc ------------------------------------------------------------------------------

    def save(self, manifest: Manifest, blobs: dict[str, bytes]) -> SaveReport:
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
            manifests = self.manifests()
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
            return GcReport(len(manifests), kept, deleted, freed)

    def _write_file(self, path: Path, data: bytes, sync: bool) -> Path:
        """Write via tmp/ and rename (replacing what is there); fsync first if `sync`. No partial file is
        ever at `path`."""
        tmp = self.root / "tmp" / f"{path.name}.{secrets.token_hex(6)}"
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
    def _lock(self, mode: int) -> Iterator[None]:
        with open(self.root / "lock", "rb") as lock:
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
