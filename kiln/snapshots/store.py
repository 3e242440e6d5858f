"""SnapshotStore: where manifests and page blobs live. One interface, two backends: a local directory
(kiln/snapshots/local.py) and Redis (kiln/snapshots/redis_store.py), chosen by `open_store`.

Contract every backend keeps:
- Blobs are immutable and named by digest: `put_blobs` writes only absent ones (set-if-absent), so equal
  pages are stored once whoever writes them.
- A save is `save(manifest, blobs)`: blobs first, made durable, manifest last and atomically. A reader
  (or a crash at any point) sees the previous manifest of that id or the new complete one, never a
  manifest whose blobs are missing.
- `gc` deletes blobs no manifest references, and is safe while other processes save: a save in flight
  holds the store's writer lease, which gc waits out (and saves wait for a running gc).
- Failures of the medium (a full disk, Redis gone) raise typed errors: ResourceExhaustedError for no
  space, UnavailableError for an unreachable or failing store. Nothing half-written is ever listed.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import InvalidArgumentError, NotFoundError
from kiln.snapshots.manifest import Manifest


@dataclass(frozen=True)
class SaveReport:
    blobs_written: int
    bytes_written: int  # compressed bytes of new blobs plus the manifest
    blobs_deduplicated: int  # referenced blobs that were already stored


@dataclass(frozen=True)
class GcReport:
    manifests: int
    blobs_kept: int
    blobs_deleted: int
    bytes_freed: int


class SnapshotStore(ABC):
    """Manifests by id, blobs by digest. Thread-safe; may be shared by several processes."""

    url: str

    @abstractmethod
    def missing(self, digests: Iterable[str]) -> set[str]:
        """The digests among `digests` that have no stored blob."""

    @abstractmethod
    def save(self, manifest: Manifest, blobs: dict[str, bytes]) -> SaveReport:
        """Store the compressed `blobs` (digest -> bytes) that are absent, then the manifest, atomically
        replacing any manifest of the same id. Every digest the manifest references must be stored
        afterwards (in `blobs` or already present): FailedPreconditionError otherwise, manifest unwritten."""

    @abstractmethod
    def get_blob(self, digest: str) -> bytes | None:
        """The compressed blob, or None if it is not stored."""

    @abstractmethod
    def manifest_bytes(self, snapshot_id: str) -> bytes | None:
        """The stored manifest JSON of an id, or None."""

    @abstractmethod
    def manifest_ids(self, owner: str | None = None) -> list[str]:
        """Every manifest id in the store; with `owner` (an owner digest), at least that owner's (a
        backend with an owner index lists only those)."""

    @abstractmethod
    def delete_manifest(self, snapshot_id: str) -> bool:
        """Remove a manifest (its blobs stay until gc); False if there was none."""

    @abstractmethod
    def gc(self) -> GcReport:
        """Delete every blob no manifest references (and leftovers of interrupted saves)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; the store's contents stay."""

    # ---- derived ----------------------------------------------------------------------------------

    def get_manifest(self, snapshot_id: str) -> Manifest | None:
        data = self.manifest_bytes(snapshot_id)
        return None if data is None else Manifest.from_json(data, snapshot_id)

    def require_manifest(self, snapshot_id: str) -> Manifest:
        manifest = self.get_manifest(snapshot_id)
        if manifest is None:
            raise NotFoundError(f"snapshot {snapshot_id} does not exist")
        return manifest

    def manifests(self, owner: str | None = None) -> list[Manifest]:
        """Every readable manifest, or only `owner`'s (an owner digest); an unreadable one is skipped
        (`kiln snapshot inspect` explains it)."""
        found = []
        for snapshot_id in self.manifest_ids(owner):
            try:
                manifest = self.get_manifest(snapshot_id)
            except Exception:  # noqa: BLE001 - one bad manifest must not hide the others
                continue
            if manifest is not None and (owner is None or manifest.owner == owner):
                found.append(manifest)
        return found


def default_directory() -> Path:
    """Where `kiln serve` keeps snapshots unless told otherwise: the user's data directory."""
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data) / "kiln" / "snapshots"


def open_store(target: str | Path) -> SnapshotStore:
    """A store from a URL or a directory path: `redis://host:port/db` (also rediss://, unix://) or a
    local directory (created if missing; `file://` prefix optional)."""
    text = str(target)
    if text.startswith(("redis://", "rediss://", "unix://")):
        from kiln.snapshots.redis_store import RedisStore

        return RedisStore(text)
    if "://" in text and not text.startswith("file://"):
        raise InvalidArgumentError(f"snapshot store must be a directory or a redis:// URL, got {text!r}", "snapshot_store")
    from kiln.snapshots.local import DirectoryStore

    return DirectoryStore(Path(text.removeprefix("file://")).expanduser())
