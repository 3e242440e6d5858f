"""RedisStore: snapshots in Redis, shared by every server pointed at it (one machine or many).

    kiln:blob:<digest>        page blob, raw or compressed (blobs.py; SET NX: written once, whoever writes it first)
    kiln:blobs                set of stored blob digests (what gc walks)
    kiln:manifest:<id>        manifest JSON
    kiln:manifests            set of manifest ids
    kiln:owner:<digest>       set of one owner's manifest ids (what a caller's ListSnapshots reads)
    kiln:writer:<token>       lease of a save in flight (value: its token)
    kiln:gc                   lease of a gc in flight (value: its token)
    kiln:lease:<name>         a session lease: hash of holder, fencing token and the holder's process (host,
                              pid), expiring by PEXPIRE
    kiln:lease-tokens         the last fencing token granted (INCR; one counter for every name)
    kiln:prefix:<space>       the prefix store's records of one space: hash of "<group>:<chain hex>" ->
                              "<digest>:<stored size>"
    kiln:prefix-used:<space>  sorted set of the same fields by last use (unix seconds)
    kiln:prefix-spaces        set of the spaces that have records (what gc walks)
    kiln:record:<kind>:<key>  a keyed record (store.record_key of owner and key)

A save writes its absent blobs, then the manifest and its index entries in one Lua script (a prefix save
its records, under the same writer lease): readers see
the old manifest or the new one. Saves and gc exclude each other through the writer and gc leases, each
set before checking for the other (so at least one of two racing parties sees the other and backs off).
Those leases are short (LEASE_MS) and renewed by a thread while the work runs, so a process that dies
stops blocking others soon; each holds a random token, is released only by compare-and-delete, and
fences the work it guards: a save writes its manifest only while its writer lease is still its own (a
save that stalled past its lease may have let a gc delete blobs it counted on), and gc deletes each
batch only while the gc lease is still its own. Both checks run inside the Lua script that writes.
Durability is Redis's own (configure appendonly for crash safety of the Redis server itself).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace

import redis

from kiln.errors import (
    FailedPreconditionError,
    LeaseHeldError,
    LeaseLostError,
    ResourceExhaustedError,
    UnavailableError,
)
from kiln.snapshots.blobs import Blob
from kiln.snapshots.manifest import DIGEST, Manifest
from kiln.snapshots.store import (
    CHAIN_BYTES,
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

PREFIX = "kiln:"
LEASE_MS = 15_000  # a save's or gc's lease; renewed every third of it while the work runs
WAIT_S = 60.0  # longest a save waits for a gc (or a gc for saves) before giving up as UNAVAILABLE
TIMEOUT_S = 10.0  # socket timeouts: a vanished Redis fails a call instead of hanging it
GC_BATCH = 512  # blobs deleted per script call (each call checks the gc lease first)
TOKENS = PREFIX + "lease-tokens"
FENCED, LAPSED = -1, -2  # what the writing scripts answer instead of writing

# KEYS[1] a session lease, ARGV[1] holder, ARGV[2] token: `holds` says whether that grant is live.
_HOLDS = """local cur = redis.call('HMGET', KEYS[1], 'holder', 'token')
local holds = cur[1] == ARGV[1] and cur[2] == ARGV[2]
"""
_OWNS_TOKEN = "if redis.call('GET', KEYS[1]) == ARGV[1] then "  # KEYS[1] a token lease, ARGV[1] its token
# The same check where the fence is optional: an empty holder means "not fenced".
_FENCE = "if ARGV[1] ~= '' then\n" + _HOLDS + "if not holds then return -1 end\nend\n"
SCRIPTS = {
    # KEYS lease, token counter; ARGV holder, ttl ms, host, pid -> {1, token} or {0, holder, pttl ms}
    # (a record without a numeric token or an expiry is no lease, as stored_lease reads it: replaced)
    "acquire": """local cur = redis.call('HMGET', KEYS[1], 'holder', 'token')
local valid = cur[1] and cur[2] and string.match(cur[2], '^%d+$') and redis.call('PTTL', KEYS[1]) > 0
if valid and cur[1] ~= ARGV[1] then return {0, cur[1], redis.call('PTTL', KEYS[1])} end
local token = cur[2]
if not valid then
  token = redis.call('INCR', KEYS[2])
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'token', token, 'host', ARGV[3], 'pid', ARGV[4])
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, tostring(token)}""",
    "renew": _HOLDS + "if holds then return redis.call('PEXPIRE', KEYS[1], ARGV[3]) end\nreturn 0",
    "release": _HOLDS + "if holds then return redis.call('DEL', KEYS[1]) end\nreturn 0",
    # KEYS a token lease (writer or gc); ARGV token, ttl ms
    "renew_token": _OWNS_TOKEN + "return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end\nreturn 0",
    "release_token": _OWNS_TOKEN + "return redis.call('DEL', KEYS[1]) end\nreturn 0",
    # KEYS lease, writer lease, manifest, manifests, owner set; ARGV holder, token, writer token, id, json
    "commit": _FENCE + """if redis.call('GET', KEYS[2]) ~= ARGV[3] then return -2 end
redis.call('SET', KEYS[3], ARGV[5])
redis.call('SADD', KEYS[4], ARGV[4])
redis.call('SADD', KEYS[5], ARGV[4])
return 1""",
    # KEYS writer lease, records, their last use, spaces; ARGV writer token, space, then field, value, last use...
    "prefix_commit": """if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -2 end
redis.call('SADD', KEYS[4], ARGV[2])
for i = 3, #ARGV, 3 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[3], ARGV[i + 2], ARGV[i])
end
return 1""",
    # KEYS lease, manifest, manifests, [owner set]; ARGV holder, token, id -> manifests deleted (0 or 1)
    "delete": _FENCE + """local n = redis.call('DEL', KEYS[2])
for i = 3, #KEYS do redis.call('SREM', KEYS[i], ARGV[3]) end
return n""",
    # KEYS gc lease, blob set, blob keys...; ARGV gc token, digests... -> bytes freed
    "collect": """if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -2 end
local freed = 0
for i = 3, #KEYS do freed = freed + redis.call('STRLEN', KEYS[i]) end
redis.call('DEL', unpack(KEYS, 3))
redis.call('SREM', KEYS[2], unpack(ARGV, 2))
return freed""",
}


class RedisStore(SnapshotStore):
    def __init__(self, url: str) -> None:
        self.url = url
        with _redis_errors("connecting to the snapshot store"):
            self.client = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
            self.client.ping()
        self._scripts = {name: self.client.register_script(body) for name, body in SCRIPTS.items()}

    def missing(self, digests: Iterable[str]) -> set[str]:
        wanted = list(digests)
        if not wanted:
            return set()
        with _redis_errors("reading the snapshot store"):
            pipe = self.client.pipeline(transaction=False)
            for digest in wanted:
                pipe.exists(PREFIX + "blob:" + digest)
            return {d for d, present in zip(wanted, pipe.execute(), strict=True) if not present}

    def blob_sizes(self, digests: Iterable[str]) -> dict[str, int]:
        wanted = list(digests)
        if not wanted:
            return {}
        with _redis_errors("reading the snapshot store"):
            pipe = self.client.pipeline(transaction=False)
            for digest in wanted:
                pipe.strlen(PREFIX + "blob:" + digest)
            return {d: size for d, size in zip(wanted, pipe.execute(), strict=True) if size}

    def get_blob(self, digest: str) -> bytes | None:
        with _redis_errors("reading a snapshot blob"):
            return self.client.get(PREFIX + "blob:" + digest)

    def get_blobs(self, digests: Iterable[str]) -> dict[str, bytes]:
        """One MGET: a restore's pages in one round trip."""
        wanted = sorted(set(digests))
        if not wanted:
            return {}
        with _redis_errors("reading snapshot blobs"):
            found = self.client.mget([PREFIX + "blob:" + digest for digest in wanted])
        return {digest: blob for digest, blob in zip(wanted, found, strict=True) if blob is not None}

    def manifest_bytes(self, snapshot_id: str) -> bytes | None:
        with _redis_errors("reading a snapshot manifest"):
            return self.client.get(PREFIX + "manifest:" + snapshot_id)

    def manifest_ids(self, owner: str | None = None) -> list[str]:
        with _redis_errors("listing snapshots"):
            key = PREFIX + "manifests" if owner is None else PREFIX + "owner:" + owner
            return sorted(member.decode() for member in self.client.smembers(key))

    def delete_manifest(self, snapshot_id: str, fence: Lease | None = None) -> bool:
        data = self.manifest_bytes(snapshot_id)
        owner = None if data is None else _owner_of(data)
        keys = [PREFIX + "manifest:" + snapshot_id, PREFIX + "manifests"]
        keys += [] if owner is None else [PREFIX + "owner:" + owner]
        with _redis_errors("deleting a snapshot"):
            lease_key, holder, token = _fence_args(fence)
            deleted = self._scripts["delete"](keys=[lease_key, *keys], args=[holder, token, snapshot_id])
            if deleted == FENCED:
                raise lease_lost(fence, self.lease_of(fence.name))
            return bool(deleted)

    def save(self, manifest: Manifest, blobs: dict[str, Blob], fence: Lease | None = None) -> SaveReport:
        with _redis_errors("saving a snapshot"), self._writer_lease() as (writer_key, writer_token):
            needed = sorted(manifest.digests())
            created = self._store_blobs(needed, blobs)
            data = manifest.to_json()
            lease_key, holder, token = _fence_args(fence)
            keys = [lease_key, writer_key, PREFIX + "manifest:" + manifest.snapshot_id, PREFIX + "manifests",
                    PREFIX + "owner:" + manifest.owner]
            verdict = self._scripts["commit"](keys=keys, args=[holder, token, writer_token, manifest.snapshot_id, data])
            if verdict == FENCED:
                raise lease_lost(fence, self.lease_of(fence.name))
            if verdict == LAPSED:
                raise UnavailableError(f"saving snapshot {manifest.snapshot_id}: the save outlived its writer lease (a gc "
                                       f"may have run meanwhile), so its manifest was not written; save it again")
            size = sum(len(blobs[d]) for d in created)
            return SaveReport(len(created), size + len(data), len(needed) - len(created))

    def gc(self) -> GcReport:
        with _redis_errors("collecting snapshot garbage"), self._gc_lease() as token:
            manifests = self.gc_manifests()
            referenced = set().union(*(m.digests() for m in manifests)) if manifests else set()
            referenced |= self._prefix_digests()
            stored = {member.decode() for member in self.client.smembers(PREFIX + "blobs")}
            stored |= {key.decode().removeprefix(PREFIX + "blob:") for key in self.client.scan_iter(PREFIX + "blob:*")}
            garbage = sorted(stored - referenced)
            freed = 0
            for start in range(0, len(garbage), GC_BATCH):
                batch = garbage[start : start + GC_BATCH]
                keys = [PREFIX + "gc", PREFIX + "blobs", *(PREFIX + "blob:" + d for d in batch)]
                result = self._scripts["collect"](keys=keys, args=[token, *batch])
                if result == LAPSED:
                    raise UnavailableError(f"snapshot gc stopped after deleting {start} of {len(garbage)} unreferenced "
                                           "blobs: its lease lapsed or another gc holds it; run gc again")
                freed += result
            return GcReport(len(manifests), len(stored) - len(garbage), len(garbage), freed)

    def _store_blobs(self, needed: Sequence[str], blobs: dict[str, Blob]) -> list[str]:
        """SET NX the blobs among `needed` the store lacks (taken from `blobs`: FailedPreconditionError if one
        is not there); returns the digests this call created. Called under the writer lease."""
        absent = sorted(self.missing(needed))
        unknown = set(absent) - blobs.keys()
        if unknown:
            raise FailedPreconditionError(f"page blob {min(unknown)[:16]} is neither stored nor part of this save")
        pipe = self.client.pipeline(transaction=False)
        for digest in absent:
            pipe.set(PREFIX + "blob:" + digest, blobs[digest], nx=True)
            pipe.sadd(PREFIX + "blobs", digest)
        replies = pipe.execute()[0::2]  # SET NX: None where a save beside this one got there first
        return [d for d, reply in zip(absent, replies, strict=True) if reply]

    def close(self) -> None:
        self.client.close()

    # ---- prefix records ---------------------------------------------------------------------------

    def save_prefix(self, space: str, records: Sequence[PrefixRecord], blobs: dict[str, Blob]) -> SaveReport:
        check_prefix_space(space)
        with _redis_errors("saving prefix pages"), self._writer_lease() as (writer_key, writer_token):
            needed = sorted({record.digest for record in records})
            created = self._store_blobs(needed, blobs)
            fields = [value for r in records for value in (_prefix_field(r.key), f"{r.digest}:{r.size}", r.last_used)]
            keys = [writer_key, PREFIX + "prefix:" + space, PREFIX + "prefix-used:" + space, PREFIX + "prefix-spaces"]
            if self._scripts["prefix_commit"](keys=keys, args=[writer_token, space, *fields]) == LAPSED:
                raise UnavailableError("saving prefix pages: the save outlived its writer lease (a gc may have run "
                                       "meanwhile), so its records were not written")
            return SaveReport(len(created), sum(len(blobs[d]) for d in created), len(needed) - len(created))

    def prefix_records(self, space: str) -> list[PrefixRecord]:
        """Malformed fields (not what save_prefix writes) are left out."""
        check_prefix_space(space)
        with _redis_errors("reading prefix records"):
            pipe = self.client.pipeline(transaction=True)
            pipe.hgetall(PREFIX + "prefix:" + space)
            pipe.zrange(PREFIX + "prefix-used:" + space, 0, -1, withscores=True)
            values, used = pipe.execute()
        last_used = dict(used)
        records = []
        for field, value in values.items():
            record = _prefix_record(field, value, last_used.get(field, 0.0))
            if record is not None:
                records.append(record)
        return records

    def touch_prefix(self, space: str, used: dict[PrefixKey, float]) -> None:
        check_prefix_space(space)
        if used:
            with _redis_errors("touching prefix records"):
                self.client.zadd(PREFIX + "prefix-used:" + space, {_prefix_field(k): at for k, at in used.items()},
                                 xx=True, gt=True)

    def drop_prefix(self, space: str, keys: Iterable[PrefixKey]) -> None:
        check_prefix_space(space)
        fields = [_prefix_field(key) for key in keys]
        if fields:
            with _redis_errors("dropping prefix records"):
                pipe = self.client.pipeline(transaction=True)
                pipe.hdel(PREFIX + "prefix:" + space, *fields)
                pipe.zrem(PREFIX + "prefix-used:" + space, *fields)
                pipe.execute()

    def record(self, kind: str, owner: str, key: str) -> bytes | None:
        with _redis_errors(f"reading a {kind} record"):
            return self.client.get(_record_key(kind, owner, key))

    def put_record(self, kind: str, owner: str, key: str, data: bytes) -> None:
        with _redis_errors(f"writing a {kind} record"):
            self.client.set(_record_key(kind, owner, key), data)

    def delete_record(self, kind: str, owner: str, key: str) -> bool:
        with _redis_errors(f"deleting a {kind} record"):
            return bool(self.client.delete(_record_key(kind, owner, key)))

    def _prefix_digests(self) -> set[str]:
        """Every blob a prefix record of any space names (gc keeps them)."""
        digests = set()
        for space in self.client.smembers(PREFIX + "prefix-spaces"):
            for value in self.client.hvals(PREFIX + "prefix:" + space.decode()):
                digests.add(value.decode(errors="replace").partition(":")[0])
        return digests

    # ---- session leases ---------------------------------------------------------------------------

    def acquire_lease(self, name: str, holder: str, ttl_s: float) -> Lease:
        check_lease_request(name, holder, ttl_s)
        start = time.time()
        with _redis_errors("taking a lease"):
            reply = self._scripts["acquire"](keys=[_lease_key(name), TOKENS],
                                             args=[holder, _ms(ttl_s), this_host(), os.getpid()])
        if reply[0] == 0:
            other, left_s = reply[1].decode(errors="replace"), reply[2] / 1000
            raise LeaseHeldError(f"{name} is leased to {other} for another {left_s:.1f} s", other, start + left_s)
        return Lease(name, holder, int(reply[1]), start + ttl_s, this_host(), os.getpid())

    def renew_leases(self, leases: Sequence[Lease], ttl_s: float) -> list[Lease | LeaseLostError]:
        for lease in leases:
            check_lease_request(lease.name, lease.holder, ttl_s)
        start = time.time()
        with _redis_errors("renewing leases"):
            pipe = self.client.pipeline(transaction=False)
            for lease in leases:
                self._scripts["renew"](keys=[_lease_key(lease.name)], args=[lease.holder, lease.token, _ms(ttl_s)],
                                       client=pipe)
            replies = pipe.execute()
            return [replace(lease, expires_at=start + ttl_s) if renewed
                    else lease_lost(lease, self.lease_of(lease.name)) for lease, renewed in zip(leases, replies, strict=True)]

    def release_lease(self, lease: Lease) -> bool:
        with _redis_errors("releasing a lease"):
            return bool(self._scripts["release"](keys=[_lease_key(lease.name)], args=[lease.holder, lease.token]))

    def lease_of(self, name: str) -> Lease | None:
        check_lease_name(name)
        with _redis_errors("reading a lease"):
            pipe = self.client.pipeline(transaction=True)
            pipe.hmget(_lease_key(name), "holder", "token", "host", "pid")
            pipe.pttl(_lease_key(name))
            (holder, token, host, pid), pttl = pipe.execute()
        if holder is None or pttl < 0:
            return None
        return stored_lease(name, _text(holder), _number(token), time.time() + pttl / 1000, _text(host or b""),
                            _number(pid or b"0"))  # no host or pid in leases written before they were recorded

    # ---- the writer and gc leases ----------------------------------------------------------------

    @contextlib.contextmanager
    def _writer_lease(self) -> Iterator[tuple[str, str]]:
        token = secrets.token_hex(8)
        key = PREFIX + "writer:" + token
        deadline = time.monotonic() + WAIT_S
        while True:
            self.client.set(key, token, px=LEASE_MS)
            if not self.client.exists(PREFIX + "gc"):
                break
            self._scripts["release_token"](keys=[key], args=[token])
            _wait(deadline, "a snapshot gc")
        with self._holding(key, token):
            yield key, token

    @contextlib.contextmanager
    def _gc_lease(self) -> Iterator[str]:
        token = secrets.token_hex(8)
        deadline = time.monotonic() + WAIT_S
        while not self.client.set(PREFIX + "gc", token, nx=True, px=LEASE_MS):
            _wait(deadline, "another snapshot gc")
        with self._holding(PREFIX + "gc", token):
            while next(self.client.scan_iter(PREFIX + "writer:*"), None) is not None:
                _wait(deadline, "snapshot saves in flight")
            yield token

    @contextlib.contextmanager
    def _holding(self, key: str, token: str) -> Iterator[None]:
        """Renew the token lease `key` while the block runs, then release it if it is still ours. A
        failed release is left to the lease's expiry (the block's own error matters more)."""
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(LEASE_MS / 3000):
                with contextlib.suppress(redis.RedisError):  # a blip: the next tick tries again
                    if not self._scripts["renew_token"](keys=[key], args=[token, LEASE_MS]):
                        return  # lost: the fenced writes will refuse; nothing to renew any more

        renewer = threading.Thread(target=renew, name="kiln-lease-renewer", daemon=True)
        renewer.start()
        try:
            yield
        finally:
            stop.set()
            renewer.join()
            with contextlib.suppress(redis.RedisError):
                self._scripts["release_token"](keys=[key], args=[token])


def _prefix_field(key: PrefixKey) -> str:
    return f"{key[0]}:{key[1].hex()}"


def _prefix_record(field: bytes, value: bytes, last_used: float) -> PrefixRecord | None:
    """A record as save_prefix wrote it; None for anything else."""
    group, _, chain = field.decode(errors="replace").partition(":")
    digest, _, size = value.decode(errors="replace").partition(":")
    if not (group.isdigit() and size.isdigit() and DIGEST.fullmatch(digest)):
        return None
    try:
        raw = bytes.fromhex(chain)
    except ValueError:
        return None
    return PrefixRecord(int(group), raw, digest, int(size), float(last_used)) if len(raw) == CHAIN_BYTES else None


def _lease_key(name: str) -> str:
    return PREFIX + "lease:" + name


def _record_key(kind: str, owner: str, key: str) -> str:
    check_record_kind(kind)
    return f"{PREFIX}record:{kind}:{record_key(owner, key)}"


def _fence_args(fence: Lease | None) -> tuple[str, str, str]:
    """KEYS[1], ARGV[1], ARGV[2] of a fenced script: an empty holder turns the check off."""
    if fence is None:
        return PREFIX + "lease:", "", ""
    return _lease_key(fence.name), fence.holder, str(fence.token)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _owner_of(data: bytes) -> str | None:
    """The owner digest of stored manifest JSON, for its index entry (None if it cannot be read)."""
    try:
        owner = json.loads(data).get("owner")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return owner if isinstance(owner, str) else None


def _text(value: bytes) -> str | None:
    """A lease field as text; None if it is not UTF-8 (stored_lease then refuses the record)."""
    try:
        return value.decode()
    except UnicodeDecodeError:
        return None


def _number(value: bytes | None) -> int | None:
    """A lease field as a non-negative integer; None if it is not one."""
    return int(value) if value is not None and value.isdigit() else None


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
