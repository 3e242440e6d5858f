"""SnapshotStore: where manifests and page blobs live. One interface, two backends: a local directory
(kiln/snapshots/local.py) and Redis (kiln/snapshots/redis_store.py), chosen by `open_store`.

Contract every backend keeps:
- Blobs are immutable and named by digest: `save` writes only absent ones (set-if-absent), so equal
  pages are stored once whoever writes them (a directory shared by several processes may hold a page
  twice when two packed it within a second, kiln/snapshots/local.py; never zero times).
- A save is `save(manifest, blobs)`: blobs first, made durable, manifest last and atomically. A reader
  (or a crash at any point) sees the previous manifest of that id or the new complete one, never a
  manifest whose blobs are missing.
- `gc` deletes blobs no manifest and no prefix record references, and is safe while other processes save:
  a save in flight holds the store's writer lease, which gc waits out (and saves wait for a running gc).
- `gc` fails closed: while any manifest cannot be read (corrupt, a newer format version) it deletes
  nothing and raises FailedPreconditionError naming those ids; a read that fails for the medium's sake
  (a Redis timeout) is UnavailableError, also before anything is deleted.
- Failures of the medium (a full disk, Redis gone) raise typed errors: ResourceExhaustedError for no
  space, UnavailableError for an unreachable or failing store. Nothing half-written is ever listed.

Prefix records (the persistent prefix store, kiln/snapshots/prefix_store.py): within a prefix space (one
per model and KV format, `prefix_space`) a record maps a full page's (KV group, chain hash) to the blob of
its bytes, with the blob's stored size and when it was last used. `save_prefix(space, records, blobs)`
writes like `save`: absent blobs first, then the records, so no record ever names a missing blob. A
record keeps its blob from gc exactly as a manifest does; `drop_prefix` removes records (their blobs stay
until gc, and are collected then unless a manifest or another record names them). Records are a cache:
an index a crash of the machine tore reads as no records (its blobs become garbage), never as wrong ones.

Keyed records (small JSON an interface keeps beside the sessions, per owner digest and key, of a kind in
RECORD_KINDS: a named session's binding, kiln/server/chat_sessions.py; a stored response of the Responses
API, kiln/server/stored_responses.py): `put_record(kind, owner, key, data)` replaces a record atomically and
durably, `record` reads it back (None: never written, or deleted), `delete_record` removes it (True if it
was there).

Leases (one owner per live session, docs/architecture.md § Ownership): `acquire_lease(name, holder, ttl_s)`
grants `name` to one holder at a time until it lapses (wall-clock `expires_at`) unless renewed. Every
grant carries a fencing token larger than any earlier grant's of that name, so a holder that stalled past
its lease and was replaced is told apart from the new one: `save` and `delete_manifest` given
`fence=lease` write only while that lease is still the live one, checked atomically with the write.
Every grant also records the process that took it (`this_host()`, its pid), so that a taker on the same
host can tell a holder that exited without handing off (kiln/snapshots/ownership.py).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import re
import socket
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import FailedPreconditionError, InvalidArgumentError, LeaseLostError, NotFoundError
from kiln.snapshots.blobs import Blob
from kiln.snapshots.manifest import SNAPSHOT_ID, Manifest


@dataclass(frozen=True)
class SaveReport:
    blobs_written: int
    bytes_written: int  # stored bytes of new blobs plus the manifest
    blobs_deduplicated: int  # referenced blobs that were already stored


@dataclass(frozen=True)
class GcReport:
    manifests: int
    blobs_kept: int
    blobs_deleted: int
    bytes_freed: int


PrefixKey = tuple[int, bytes]  # (KV group, chain hash): kiln/kv/cache.py's key of a named page
PREFIX_SPACE = re.compile(r"[0-9a-f]{32}")
CHAIN_BYTES = 16  # a chain hash (kiln/kv/pages.py)
RECORD_KINDS = ("name", "response")  # keyed records: named sessions' bindings, stored responses


@dataclass(frozen=True)
class PrefixRecord:
    """One page of the persistent prefix store: the page (KV group, chain hash) of a prefix space is the blob
    `digest` (SHA-256 of its raw bytes), `size` bytes as stored; `last_used` (unix seconds) orders eviction."""

    group: int
    chain: bytes
    digest: str
    size: int
    last_used: float

    @property
    def key(self) -> PrefixKey:
        return (self.group, self.chain)


def record_key(owner: str, key: str) -> str:
    """Where a keyed record lives: a digest, since keys such as ".." must not become paths."""
    return hashlib.sha256(f"{owner}\0{key}".encode()).hexdigest()


def check_record_kind(kind: str) -> None:
    """A record kind names a directory and a Redis key part: one of RECORD_KINDS."""
    if kind not in RECORD_KINDS:
        raise InvalidArgumentError(f"a record kind is one of {', '.join(RECORD_KINDS)}, got {str(kind)[:64]!r}")


def check_prefix_space(space: str) -> None:
    """A prefix space names a file and a Redis key part: 32 hex digits (`prefix_space`)."""
    if not isinstance(space, str) or not PREFIX_SPACE.fullmatch(space):
        raise InvalidArgumentError(f"a prefix space is 32 hex digits, got {str(space)[:64]!r}")


@dataclass(frozen=True)
class Lease:
    """A grant of `name` to `holder`. `token` is the fencing token: strictly increasing over every grant
    of a name (re-acquiring or renewing a live lease of one's own keeps it). `expires_at` is wall-clock
    (time.time()) seconds: the holder's view of when the lease lapses unless renewed."""

    name: str  # what is leased: a session id
    holder: str  # who holds it: a server instance's id (random per process)
    token: int
    expires_at: float
    host: str = ""  # where the process that took it runs (`this_host()`); "" when unknown
    pid: int = 0  # that process's id on `host`; 0 when unknown

    def same_grant(self, other: Lease | None) -> bool:
        """Whether `other` is this grant (renewed or not): same name, holder and token."""
        return other is not None and (other.name, other.holder, other.token) == (self.name, self.holder, self.token)


@functools.cache
def this_host() -> str:
    """Where this process runs, as a lease records its holder's: host name, boot id and pid namespace, so
    that a pid in a lease of the same host names a process this one can see (not one of an earlier boot, or
    of another container on the machine). "" where they cannot be read (not Linux): a lease that records
    no host is never judged by its pid."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return ""
    return f"{socket.gethostname()}/{boot}/{namespace.removeprefix('pid:').strip('[]')}"


MAX_HOLDER_CHARS = 256  # a lease's holder id or host


def check_lease_name(name: str) -> None:
    """A lease name is also a file name and a Redis key part: 1-160 characters of [A-Za-z0-9_-]."""
    if not isinstance(name, str) or not SNAPSHOT_ID.fullmatch(name):
        raise InvalidArgumentError(f"lease name must be 1-160 characters of [A-Za-z0-9_-], got {str(name)[:64]!r}")


def check_lease_request(name: str, holder: str, ttl_s: float) -> None:
    """Refuse what no backend can store: a bad name, an empty holder or one with whitespace, a TTL that
    is not a positive number of seconds."""
    check_lease_name(name)
    if not isinstance(holder, str) or not holder or any(c.isspace() for c in holder):
        raise InvalidArgumentError(f"lease holder must be a non-empty string without spaces, got {holder!r}")
    if not isinstance(ttl_s, int | float) or not 0 < ttl_s < 10**7:
        raise InvalidArgumentError(f"lease ttl_s must be a positive number of seconds, got {ttl_s!r}")


def stored_lease(name: str, holder: object, token: object, expires_at: object, host: object = "",
                 pid: object = 0) -> Lease | None:
    """A lease as a store holds it, every field checked for type and range (both backends read leases
    here). None for a record that is no valid lease, which counts as no lease (the next grant replaces
    it): a file torn by a crash, or what else wrote the store (an expiry that never comes, a holder
    that is not a string, a token that is not a positive integer)."""
    valid = (isinstance(holder, str) and 0 < len(holder) <= MAX_HOLDER_CHARS and not any(c.isspace() for c in holder)
             and isinstance(token, int) and not isinstance(token, bool) and 0 < token < 2**63
             and isinstance(expires_at, int | float) and not isinstance(expires_at, bool) and math.isfinite(expires_at)
             and isinstance(host, str) and len(host) <= MAX_HOLDER_CHARS
             and isinstance(pid, int) and not isinstance(pid, bool) and 0 <= pid < 2**31)
    return Lease(name, holder, token, float(expires_at), host, pid) if valid else None


def lease_lost(fence: Lease, current: Lease | None) -> LeaseLostError:
    """The error for a write fenced by `fence` when `current` is the live lease of its name."""
    now = "no live lease" if current is None else f"a lease of {current.holder} (token {current.token})"
    return LeaseLostError(f"lease on {fence.name} (token {fence.token}) is no longer {fence.holder}'s: {now}")


class SnapshotStore(ABC):
    """Manifests by id, blobs by digest. Thread-safe; may be shared by several processes."""

    url: str

    @abstractmethod
    def missing(self, digests: Iterable[str]) -> set[str]:
        """The digests among `digests` that have no stored blob."""

    @abstractmethod
    def save(self, manifest: Manifest, blobs: dict[str, Blob], fence: Lease | None = None) -> SaveReport:
        """Store the `blobs` (digest -> blobs.encode bytes) that are absent, then the manifest, atomically
        replacing any manifest of the same id. Every digest the manifest references must be stored
        afterwards (in `blobs` or already present): FailedPreconditionError otherwise, manifest unwritten.
        With `fence`, the manifest is written only if `fence` is still the live lease of its name
        (LeaseLostError otherwise, manifest unwritten)."""

    @abstractmethod
    def blob_sizes(self, digests: Iterable[str]) -> dict[str, int]:
        """The stored (compressed) size of each digest among `digests` that has a blob; absent ones are
        left out. Reads no blob (a stat, a STRLEN)."""

    @abstractmethod
    def get_blob(self, digest: str) -> bytes | None:
        """The stored blob (blobs.decode reads it), or None if it is not stored."""

    def get_blobs(self, digests: Iterable[str]) -> dict[str, bytes]:
        """The stored blobs among `digests` (absent ones left out); a backend reads them in bulk."""
        found = {digest: self.get_blob(digest) for digest in set(digests)}
        return {digest: blob for digest, blob in found.items() if blob is not None}

    @abstractmethod
    def manifest_bytes(self, snapshot_id: str) -> bytes | None:
        """The stored manifest JSON of an id, or None."""

    @abstractmethod
    def manifest_ids(self, owner: str | None = None) -> list[str]:
        """Every manifest id in the store; with `owner` (an owner digest), at least that owner's (a
        backend with an owner index lists only those)."""

    @abstractmethod
    def delete_manifest(self, snapshot_id: str, fence: Lease | None = None) -> bool:
        """Remove a manifest (its blobs stay until gc); False if there was none. With `fence`, only while
        `fence` is still the live lease of its name (LeaseLostError otherwise, nothing deleted)."""

    @abstractmethod
    def gc(self) -> GcReport:
        """Delete every blob no manifest and no prefix record references (and leftovers of interrupted
        saves). Fails closed: FailedPreconditionError, nothing deleted, while any manifest is unreadable."""

    # ---- prefix records (the persistent prefix store) ---------------------------------------------

    @abstractmethod
    def save_prefix(self, space: str, records: Sequence[PrefixRecord], blobs: dict[str, Blob]) -> SaveReport:
        """Store the `blobs` that are absent, then the records (replacing those of the same keys). Every
        record's digest must be stored afterwards: FailedPreconditionError otherwise, no record written."""

    @abstractmethod
    def prefix_records(self, space: str) -> list[PrefixRecord]:
        """Every record of the space (any order); none for a space never written."""

    @abstractmethod
    def touch_prefix(self, space: str, used: dict[PrefixKey, float]) -> None:
        """Move records' `last_used` forward to the times given (records absent now are left absent)."""

    @abstractmethod
    def drop_prefix(self, space: str, keys: Iterable[PrefixKey]) -> None:
        """Remove records (absent ones are ignored); their blobs stay until gc."""

    # ---- keyed records ------------------------------------------------------------------------------

    @abstractmethod
    def record(self, kind: str, owner: str, key: str) -> bytes | None:
        """The record of `kind` an owner (an owner digest) keeps under `key`; None if there is none."""

    @abstractmethod
    def put_record(self, kind: str, owner: str, key: str, data: bytes) -> None:
        """Replace the record, durably before returning (a reader sees the old record or the new one)."""

    @abstractmethod
    def delete_record(self, kind: str, owner: str, key: str) -> bool:
        """Remove the record, durably before returning; True if there was one."""

    @abstractmethod
    def acquire_lease(self, name: str, holder: str, ttl_s: float) -> Lease:
        """Grant `name` to `holder` for `ttl_s` seconds with a new fencing token, recording this process
        (`this_host()`, its pid) as the holder's, or renew `holder`'s own live lease (same token).
        LeaseHeldError (with the holder and expiry) while another's is live."""

    def renew_lease(self, lease: Lease, ttl_s: float) -> Lease:
        """Extend a live lease to `ttl_s` seconds from now. LeaseLostError if it lapsed or is no longer
        this holder's with this token."""
        (renewed,) = self.renew_leases([lease], ttl_s)
        if isinstance(renewed, LeaseLostError):
            raise renewed
        return renewed

    @abstractmethod
    def renew_leases(self, leases: Sequence[Lease], ttl_s: float) -> list[Lease | LeaseLostError]:
        """Extend many leases at once, in one lock or one round trip (a server renews thousands of sessions'
        leases every few seconds: one call each fell behind their TTL under load). For each lease, in order,
        the renewed lease or the LeaseLostError saying it lapsed or is another's; a failure of the store
        itself raises for the whole batch."""

    @abstractmethod
    def release_lease(self, lease: Lease) -> bool:
        """Give the lease up (compare-and-delete): True if it was still live and ours, else False and
        whatever lease is there now stays."""

    @abstractmethod
    def lease_of(self, name: str) -> Lease | None:
        """The live lease of `name`, or None."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; the store's contents stay."""

    # ---- derived ----------------------------------------------------------------------------------

    def get_manifest(self, snapshot_id: str) -> Manifest | None:
        """The manifest stored under an id, validated (Manifest.from_json), and stored under its own id:
        one written under another id (by hand, or by whoever else can write the store) is refused."""
        data = self.manifest_bytes(snapshot_id)
        if data is None:
            return None
        manifest = Manifest.from_json(data, snapshot_id)
        if manifest.snapshot_id != snapshot_id:
            raise FailedPreconditionError(f"snapshot manifest {snapshot_id} names another snapshot "
                                          f"({manifest.snapshot_id}): refused")
        return manifest

    def require_manifest(self, snapshot_id: str) -> Manifest:
        manifest = self.get_manifest(snapshot_id)
        if manifest is None:
            raise NotFoundError(f"snapshot {snapshot_id} does not exist")
        return manifest

    def manifests(self, owner: str | None = None) -> list[Manifest]:
        """Every readable manifest, or only `owner`'s (an owner digest); one whose content cannot be read
        is skipped (`kiln snapshot inspect` explains it). A failing medium raises UnavailableError."""
        found, _ = self._read_manifests(owner)
        return found

    def gc_manifests(self) -> list[Manifest]:
        """Every manifest, for gc: FailedPreconditionError naming the ids of any that cannot be read, since
        gc cannot know which blobs those reference (a failing medium raises UnavailableError)."""
        found, unreadable = self._read_manifests(None)
        if unreadable:
            shown = "; ".join(f"{sid}: {why}" for sid, why in sorted(unreadable.items())[:8])
            raise FailedPreconditionError(
                f"snapshot gc deleted nothing: {len(unreadable)} manifest(s) cannot be read, so their blobs "
                f"may be live (fix or delete them, then gc again): {shown}")
        return found

    def _read_manifests(self, owner: str | None) -> tuple[list[Manifest], dict[str, str]]:
        """(readable manifests of `owner` or all, {id: why} of unreadable ones). A manifest deleted between
        listing and reading is neither."""
        found, unreadable = [], {}
        for snapshot_id in self.manifest_ids(owner):
            try:
                manifest = self.get_manifest(snapshot_id)
            except FailedPreconditionError as error:
                unreadable[snapshot_id] = str(error)
                continue
            if manifest is not None and (owner is None or manifest.owner == owner):
                found.append(manifest)
        return found, unreadable


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
