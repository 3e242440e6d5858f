"""Ownership: one owner per live session across the servers that share a snapshot store
(docs/architecture.md § Ownership).

A session live in this process holds a lease on its id in the store (SnapshotStore.acquire_lease: holder,
fencing token, expiry). It is taken when the session comes to life here (create, fork, restore, revive),
renewed in the background by this module's thread (never under a lock of the session store), and given
back once the session's last save is durable (close, eviction, shutdown): that release is the hand-off
to whichever server is asked for the session next. Every write of the session's own snapshot is fenced
by the lease, so a server that lost it (a stall or partition past the TTL, after which another server
took the session) can never write over the new owner.

Holder ids are `<instance id>/<incarnation>`: the instance id names this server among those sharing the
store (unique among live ones; `kiln serve` derives it from the host and its gRPC address, `--instance-id`
sets it; an in-process LLM without one gets a random id), the incarnation is random per process. The
rule for restarts: a lease held by another incarnation of this same instance id belongs to a process
that is gone (only one process runs an instance id at a time), so this process takes it over at once
instead of waiting out its TTL. So does a lease whose process is known to have exited: every lease
records the host (host name, boot id, pid namespace: `store.this_host`) and pid of the process that took
it, and a lease of this host whose pid no longer runs belongs to a process that ended without handing
off (killed, or exited without closing). Any other holder's live lease refuses the session with
FailedPreconditionError: it is live on another server until that lease is released or lapses. A pid
reused since by another process only makes the taker wait out the TTL, as for a live holder; the fence
keeps a holder wrongly judged gone from writing anything.

A renewal the store refuses (LeaseLostError) means the session was lost: it is served no longer here
(`lost`), and its queued saves are dropped by the fence. Other renewal failures (the store unreachable)
are retried; a lease that lapses meanwhile is lost at the next renewal.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from kiln.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    KilnError,
    LeaseHeldError,
    LeaseLostError,
)
from kiln.snapshots.store import Lease, SnapshotStore, this_host

logger = logging.getLogger(__name__)
LEASE_TTL_S = 30.0  # how long a dead server's sessions stay locked (other instance ids wait this out)
LOST_REMEMBERED = 10_000
RENEW_BATCH = 256  # leases renewed per store call: one lock or round trip each, short enough not to stall saves


@dataclass
class _Held:
    lease: Lease
    claims: int  # times this process (re)acquired it: a hand-off releases only the claim it was made for


class Ownership:
    def __init__(self, store: SnapshotStore, instance_id: str | None = None, ttl_s: float | None = None) -> None:
        if instance_id is not None and (not instance_id or any(c.isspace() or c == "/" for c in instance_id)):
            raise InvalidArgumentError(f"instance_id must be non-empty, without spaces or '/', got {instance_id!r}",
                                       "instance_id")
        self.store = store
        self.instance_id = instance_id or "process-" + secrets.token_hex(6)
        self.holder = f"{self.instance_id}/{secrets.token_hex(6)}"
        self.ttl_s = ttl_s or LEASE_TTL_S  # renewed every third of it
        self._held: dict[str, _Held] = {}
        self._lost: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew_loop, name="kiln-session-leases", daemon=True)
        self._renewer.start()

    def acquire(self, session_id: str) -> None:
        """Own the session here (again): FailedPreconditionError if another server's lease on it is live;
        a lease whose holder is known gone (`_gone`) is taken over at once. Store failures raise their
        typed errors (UnavailableError)."""
        try:
            lease = self.store.acquire_lease(session_id, self.holder, self.ttl_s)
        except LeaseHeldError:
            lease = self._take_over(session_id)
        with self._lock:
            held = self._held.get(session_id)
            self._held[session_id] = _Held(lease, held.claims + 1 if held else 1)
            self._lost.pop(session_id, None)

    def _gone(self, lease: Lease) -> str | None:
        """Why the lease's holder is known to be gone, or None if it may be alive: a previous incarnation
        of this instance id, or a process of this host (same boot and pid namespace) that no longer runs."""
        instance, _, incarnation = lease.holder.rpartition("/")
        if instance == self.instance_id and lease.holder != self.holder and incarnation:
            return "this instance's previous process"
        if lease.host and lease.host == this_host() and 0 < lease.pid != os.getpid() and not _running(lease.pid):
            return f"process {lease.pid} of this host, which has exited"
        return None

    def _take_over(self, session_id: str) -> Lease:
        """Acquire a session whose lease another holder had a moment ago: its live lease refuses the
        session unless its holder is gone, whose very grant is then released (compare-and-delete, so a
        holder that renewed or took it meanwhile keeps it) before this process acquires it."""
        current = self.store.lease_of(session_id)
        if current is not None:
            gone = self._gone(current)
            if gone is None:
                raise FailedPreconditionError(
                    f"session {session_id} is live on another server ({current.holder}); ask that server, or retry "
                    f"once it hands the session off (its lease lapses in {max(0.0, current.expires_at - time.time()):.0f} s "
                    "unless renewed)")
            self.store.release_lease(current)
            logger.info("session %s: took over the lease of %s (%s)", session_id, current.holder, gone)
        try:
            return self.store.acquire_lease(session_id, self.holder, self.ttl_s)
        except LeaseHeldError as held:
            raise FailedPreconditionError(f"session {session_id} is live on another server ({held.holder})") from None

    def fence(self, session_id: str) -> Lease | None:
        """The lease that fences writes of this session's snapshot; None if this process does not own it."""
        with self._lock:
            held = self._held.get(session_id)
            return held.lease if held else None

    def claim(self, session_id: str) -> int:
        with self._lock:
            held = self._held.get(session_id)
            return held.claims if held else 0

    def lost(self, session_id: str) -> bool:
        """Whether the store refused this process's lease on the session: it is owned elsewhere now."""
        with self._lock:
            return session_id in self._lost

    def mark_lost(self, session_id: str) -> None:
        """A fenced write was refused: the session is owned elsewhere."""
        with self._lock:
            if self._held.pop(session_id, None) is not None:
                self._remember_lost(session_id)

    def release(self, session_id: str, claim: int | None = None) -> None:
        """Hand the session off (its last save is durable); with `claim`, only if it was not acquired again
        since. A failed release is logged: the lease then lapses after its TTL."""
        with self._lock:
            held = self._held.get(session_id)
            if held is None or (claim is not None and held.claims != claim):
                return
            del self._held[session_id]
        try:
            self.store.release_lease(held.lease)
        except KilnError as error:
            logger.warning("releasing the lease of session %s failed (it lapses in %.0f s): %s", session_id,
                           self.ttl_s, error)

    def held(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def close(self) -> None:
        """Stop renewing; leases still held lapse after their TTL (this instance's next process, and once
        this process has exited any process of this host, takes them over at once)."""
        self._stop.set()
        self._renewer.join()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            self.renew_all()

    def renew_all(self) -> None:
        """Renew every held lease, the soonest to lapse first, `RENEW_BATCH` per store call (the renewer
        thread's round; no lock is held during the store calls)."""
        with self._lock:
            leases = sorted((held.lease for held in self._held.values()), key=lambda lease: lease.expires_at)
        for start in range(0, len(leases), RENEW_BATCH):
            batch = leases[start:start + RENEW_BATCH]
            try:
                results = self.store.renew_leases(batch, self.ttl_s)
            except KilnError as error:
                logger.warning("renewing %d session leases failed (retried): %s", len(batch), error)
                continue
            for lease, renewed in zip(batch, results, strict=True):
                if isinstance(renewed, LeaseLostError):
                    logger.error("session %s is no longer this server's: %s", lease.name, renewed)
                    self.mark_lost(lease.name)
                    continue
                with self._lock:
                    held = self._held.get(lease.name)
                    if held is not None and held.lease.token == renewed.token:
                        held.lease = renewed

    def _remember_lost(self, session_id: str) -> None:
        self._lost[session_id] = None
        while len(self._lost) > LOST_REMEMBERED:
            self._lost.popitem(last=False)


def _running(pid: int) -> bool:
    """Whether a process of this pid runs on this host (one of another user's counts: it may not be signalled)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
