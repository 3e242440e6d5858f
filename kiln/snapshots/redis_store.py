"""RedisStore: snapshots in Redis, shared by every server pointed at it (one machine or many).

    kiln:blob:<digest>        compressed page blob (SET NX: written once, whoever writes it first)
    kiln:blobs                set of stored blob digests (what gc walks)
    kiln:manifest:<id>        manifest JSON
    kiln:manifests            set of manifest ids
    kiln:owner:<digest>       set of one owner's manifest ids (what a caller's ListSnapshots reads)
    kiln:writer:<token>       lease of a save in flight (expires by itself if its writer dies)
    kiln:gc                   lease of a gc in flight

A save writes its absent blobs, then the manifest and its index entry in one MULTI: readers see the old
manifest or the new one. Saves and gc exclude each other through the leases, each set before checking
for the other (so at least one of two racing parties sees the other and backs off). Durability is
Redis's own (configure appendonly for crash safety of the Redis server itself).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Iterable, Iterator

import redis

from kiln.errors import FailedPreconditionError, ResourceExhaustedError, UnavailableError
from kiln.snapshots.manifest import Manifest
from kiln.snapshots.store import GcReport, SaveReport, SnapshotStore

PREFIX = "kiln:"
LEASE_MS = 120_000  # a save or gc that died holding a lease stops blocking others after this
WAIT_S = 60.0  # longest a save waits for a gc (or a gc for saves) before giving up as UNAVAILABLE
TIMEOUT_S = 10.0  # socket timeouts: a vanished Redis fails a call instead of hanging it


class RedisStore(SnapshotStore):
    def __init__(self, url: str) -> None:
        self.url = url
        with _redis_errors("connecting to the snapshot store"):
            self.client = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
            self.client.ping()

    def missing(self, digests: Iterable[str]) -> set[str]:
        wanted = list(digests)
        if not wanted:
            return set()
        with _redis_errors("reading the snapshot store"):
            pipe = self.client.pipeline(transaction=False)
            for digest in wanted:
                pipe.exists(PREFIX + "blob:" + digest)
            return {d for d, present in zip(wanted, pipe.execute(), strict=True) if not present}

    def get_blob(self, digest: str) -> bytes | None:
        with _redis_errors("reading a snapshot blob"):
            return self.client.get(PREFIX + "blob:" + digest)

    def manifest_bytes(self, snapshot_id: str) -> bytes | None:
        with _redis_errors("reading a snapshot manifest"):
            return self.client.get(PREFIX + "manifest:" + snapshot_id)

    def manifest_ids(self, owner: str | None = None) -> list[str]:
        with _redis_errors("listing snapshots"):
            key = PREFIX + "manifests" if owner is None else PREFIX + "owner:" + owner
            return sorted(member.decode() for member in self.client.smembers(key))

    def delete_manifest(self, snapshot_id: str) -> bool:
        data = self.manifest_bytes(snapshot_id)
        owner = None if data is None else _owner_of(data)
        with _redis_errors("deleting a snapshot"):
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(PREFIX + "manifest:" + snapshot_id)
            pipe.srem(PREFIX + "manifests", snapshot_id)
            if owner is not None:
                pipe.srem(PREFIX + "owner:" + owner, snapshot_id)
            return bool(pipe.execute()[0])

    def save(self, manifest: Manifest, blobs: dict[str, bytes]) -> SaveReport:
        with _redis_errors("saving a snapshot"), self._writer_lease():
            needed = sorted(manifest.digests())
            absent = self.missing(needed)
            unknown = absent - blobs.keys()
            if unknown:
                raise FailedPreconditionError(f"page blob {min(unknown)[:16]} is neither stored nor part of this save")
            pipe = self.client.pipeline(transaction=False)
            for digest in sorted(absent):
                pipe.set(PREFIX + "blob:" + digest, blobs[digest], nx=True)
                pipe.sadd(PREFIX + "blobs", digest)
            replies = pipe.execute()[0::2]  # SET NX: None where a save beside this one got there first
            created = [d for d, reply in zip(sorted(absent), replies, strict=True) if reply]
            data = manifest.to_json()
            pipe = self.client.pipeline(transaction=True)
            pipe.set(PREFIX + "manifest:" + manifest.snapshot_id, data)
            pipe.sadd(PREFIX + "manifests", manifest.snapshot_id)
            pipe.sadd(PREFIX + "owner:" + manifest.owner, manifest.snapshot_id)
            pipe.execute()
            size = sum(len(blobs[d]) for d in created)
            return SaveReport(len(created), size + len(data), len(needed) - len(created))

    def gc(self) -> GcReport:
        with _redis_errors("collecting snapshot garbage"), self._gc_lease():
            manifests = self.manifests()
            referenced = set().union(*(m.digests() for m in manifests)) if manifests else set()
            stored = {member.decode() for member in self.client.smembers(PREFIX + "blobs")}
            stored |= {key.decode().removeprefix(PREFIX + "blob:") for key in self.client.scan_iter(PREFIX + "blob:*")}
            garbage = sorted(stored - referenced)
            freed = 0
            for start in range(0, len(garbage), 512):
                batch = garbage[start : start + 512]
                pipe = self.client.pipeline(transaction=False)
                for digest in batch:
                    pipe.strlen(PREFIX + "blob:" + digest)
                freed += sum(pipe.execute())
                pipe = self.client.pipeline(transaction=False)
                pipe.delete(*(PREFIX + "blob:" + d for d in batch))
                pipe.srem(PREFIX + "blobs", *batch)
                pipe.execute()
            return GcReport(len(manifests), len(stored) - len(garbage), len(garbage), freed)

    def close(self) -> None:
        self.client.close()

    @contextlib.contextmanager
    def _writer_lease(self) -> Iterator[None]:
        key = PREFIX + "writer:" + secrets.token_hex(8)
        deadline = time.monotonic() + WAIT_S
        while True:
            self.client.set(key, 1, px=LEASE_MS)
            if not self.client.exists(PREFIX + "gc"):
                break
            self.client.delete(key)
            _wait(deadline, "a snapshot gc")
        try:
            yield
        finally:
            self.client.delete(key)

    @contextlib.contextmanager
    def _gc_lease(self) -> Iterator[None]:
        deadline = time.monotonic() + WAIT_S
        while not self.client.set(PREFIX + "gc", 1, nx=True, px=LEASE_MS):
            _wait(deadline, "another snapshot gc")
        try:
            while next(self.client.scan_iter(PREFIX + "writer:*"), None) is not None:
                _wait(deadline, "snapshot saves in flight")
            yield
        finally:
            self.client.delete(PREFIX + "gc")


def _owner_of(data: bytes) -> str | None:
    """The owner digest of stored manifest JSON, for its index entry (None if it cannot be read)."""
    try:
        owner = json.loads(data).get("owner")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return owner if isinstance(owner, str) else None


def _wait(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise UnavailableError(f"gave up waiting for {what} in the snapshot store")
    time.sleep(0.02)


@contextlib.contextmanager
def _redis_errors(what: str) -> Iterator[None]:
    """Redis failures as typed errors: out of memory is RESOURCE_EXHAUSTED, anything else (connection
    lost, refused, timed out) UNAVAILABLE."""
    try:
        yield
    except redis.exceptions.ResponseError as error:
        if str(error).startswith("OOM"):
            raise ResourceExhaustedError(f"{what}: the Redis snapshot store is full ({error})") from None
        raise UnavailableError(f"{what}: Redis answered {error}") from None
    except redis.exceptions.RedisError as error:
        raise UnavailableError(f"{what}: the Redis snapshot store is unreachable ({error})") from None
