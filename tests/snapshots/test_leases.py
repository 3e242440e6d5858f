"""Session leases on both backends: one holder at a time, fencing tokens that only grow, writes fenced by
a lease refused once it is lost, and (for the directory) the same between two processes."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kiln.errors import InvalidArgumentError, LeaseHeldError, LeaseLostError
from kiln.snapshots.store import Lease, SnapshotStore, open_store
from tests.snapshots.synthetic import page, synthetic

TTL_S = 30.0
SHORT_TTL_S = 0.2


def lapse(store: SnapshotStore, lease: Lease) -> None:
    """Wait (bounded) until a short lease has lapsed by the store's own clock."""
    deadline = time.monotonic() + 10
    while store.lease_of(lease.name) is not None:
        assert time.monotonic() < deadline, "a 0.2 s lease was still live after 10 s"
        time.sleep(SHORT_TTL_S / 4)


def test_acquire_renew_release(store_target):
    store = open_store(store_target)
    assert store.lease_of("s1") is None
    lease = store.acquire_lease("s1", "server-a", TTL_S)
    assert (lease.name, lease.holder) == ("s1", "server-a") and lease.expires_at > time.time() + TTL_S / 2
    assert store.lease_of("s1").same_grant(lease)
    again = store.acquire_lease("s1", "server-a", TTL_S)  # re-acquiring one's own live lease renews it
    assert again.token == lease.token
    renewed = store.renew_lease(lease, 2 * TTL_S)
    assert renewed.token == lease.token and renewed.expires_at > time.time() + 1.5 * TTL_S
    assert store.release_lease(renewed) and store.lease_of("s1") is None
    assert not store.release_lease(renewed)
    with pytest.raises(LeaseLostError):
        store.renew_lease(renewed, TTL_S)
    later = store.acquire_lease("s1", "server-a", TTL_S)
    assert later.token > lease.token  # a new grant after a release: a new token
    store.close()


def test_many_leases_renew_in_one_call_each_with_its_own_outcome(store_target):
    store = open_store(store_target)
    mine = [store.acquire_lease(f"s{i}", "server-a", TTL_S) for i in range(5)]
    short = store.acquire_lease("lapsing", "server-a", SHORT_TTL_S)
    lapse(store, short)
    taken = store.acquire_lease("taken", "server-a", SHORT_TTL_S)
    lapse(store, taken)
    theirs = store.acquire_lease("taken", "server-b", TTL_S)
    results = store.renew_leases([mine[0], short, *mine[1:], taken], 3 * TTL_S)
    assert [type(result) for result in results] == [Lease, LeaseLostError, *[Lease] * 4, LeaseLostError]
    assert "no live lease" in str(results[1]) and "server-b" in str(results[-1])
    for before, after in zip(mine, [results[0], *results[2:6]], strict=True):
        assert after.same_grant(before) and after.expires_at > time.time() + 2.5 * TTL_S
        assert store.lease_of(before.name).expires_at > time.time() + 2.5 * TTL_S  # the store's own view
    assert store.lease_of("lapsing") is None and store.lease_of("taken").same_grant(theirs)
    assert store.renew_leases([], TTL_S) == []
    with pytest.raises(InvalidArgumentError):
        store.renew_leases([mine[0]], -1.0)
    store.close()


def test_a_directory_lease_renews_in_place_and_an_older_files_length_is_rewritten(tmp_path):
    """A renewal is open, read, write, close on the lease file (no staging file, no rename: each system
    call may wait a GIL switch interval on a busy server); a file of another length is rewritten whole."""
    store = open_store(str(tmp_path / "store"))
    lease = store.acquire_lease("s1", "server-a", TTL_S)
    path = tmp_path / "store" / "leases" / "s1.json"
    inode = path.stat().st_ino
    renewed = store.renew_lease(lease, 2 * TTL_S)
    assert path.stat().st_ino == inode and store.lease_of("s1").expires_at == pytest.approx(renewed.expires_at, abs=1e-5)
    path.write_text(f'{{"holder": "server-a", "token": {lease.token}, "expires_at": {time.time() + 1.5}}}')  # repr width
    again = store.renew_lease(lease, 3 * TTL_S)
    assert again.expires_at > time.time() + 2.5 * TTL_S
    assert store.lease_of("s1").expires_at == pytest.approx(again.expires_at, abs=1e-5)
    path.write_text("{torn")
    with pytest.raises(LeaseLostError):
        store.renew_lease(lease, TTL_S)
    store.close()


def test_a_second_holder_is_refused_while_live_and_granted_after_lapse(store_target):
    store = open_store(store_target)
    first = store.acquire_lease("s1", "server-a", SHORT_TTL_S)
    with pytest.raises(LeaseHeldError) as refused:
        store.acquire_lease("s1", "server-b", TTL_S)
    assert refused.value.holder == "server-a" and refused.value.code == "FAILED_PRECONDITION"
    assert refused.value.expires_at <= time.time() + SHORT_TTL_S + 1
    other = store.acquire_lease("s2", "server-b", TTL_S)  # names are independent
    lapse(store, first)
    second = store.acquire_lease("s1", "server-b", TTL_S)
    assert second.token > max(first.token, other.token) and store.lease_of("s1").holder == "server-b"
    with pytest.raises(LeaseLostError):
        store.renew_lease(first, TTL_S)
    assert not store.release_lease(first)  # releasing a lost lease changes nothing
    assert store.lease_of("s1").same_grant(second)
    store.close()


def test_a_stale_holders_fenced_save_and_delete_are_refused(store_target):
    store = open_store(store_target)
    stale = store.acquire_lease("s1", "server-a", SHORT_TTL_S)
    manifest, blobs = synthetic("session-s1", [page(1)])
    store.save(manifest, blobs, fence=stale)
    lapse(store, stale)
    with pytest.raises(LeaseLostError):  # lapsed, nobody else yet: still refused
        store.save(*synthetic("session-s1", [page(1), page(2)]), fence=stale)
    fresh = store.acquire_lease("s1", "server-b", TTL_S)
    newer, newer_blobs = synthetic("session-s1", [page(1), page(3)])
    store.save(newer, newer_blobs, fence=fresh)
    with pytest.raises(LeaseLostError, match="server-b"):
        store.save(manifest, blobs, fence=stale)
    with pytest.raises(LeaseLostError):
        store.delete_manifest("session-s1", fence=stale)
    assert store.get_manifest("session-s1") == newer  # neither stale write landed
    assert store.delete_manifest("session-s1", fence=fresh) and store.get_manifest("session-s1") is None
    store.close()


def test_a_same_holder_lapsed_lease_is_a_new_grant(store_target):
    """A holder whose lease lapsed and who acquires again gets a new token: writes fenced by the old
    grant stay refused, as they would be after another holder's grant in between."""
    store = open_store(store_target)
    old = store.acquire_lease("s1", "server-a", SHORT_TTL_S)
    lapse(store, old)
    new = store.acquire_lease("s1", "server-a", TTL_S)
    assert new.token > old.token
    with pytest.raises(LeaseLostError):
        store.save(*synthetic("session-s1", [page(1)]), fence=old)
    store.close()


def test_bad_lease_requests_are_invalid_arguments(store_target):
    store = open_store(store_target)
    for name, holder, ttl in (("../x", "a", 1.0), ("s", "", 1.0), ("s", "a b", 1.0), ("s", "a", 0), ("s", "a", -1.0)):
        with pytest.raises(InvalidArgumentError):
            store.acquire_lease(name, holder, ttl)
    store.close()


ACQUIRE = """
import sys
from kiln.errors import LeaseHeldError
from kiln.snapshots.local import DirectoryStore
store = DirectoryStore(__import__("pathlib").Path(sys.argv[1]))
try:
    lease = store.acquire_lease("s1", sys.argv[2], float(sys.argv[3]))
except LeaseHeldError as error:
    print("held", error.holder)
else:
    print("granted", lease.token)
"""


def acquire_in_process(root: str, holder: str, ttl_s: float) -> str:
    done = subprocess.run([sys.executable, "-c", ACQUIRE, root, holder, str(ttl_s)], capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout.strip()


def test_directory_leases_hold_between_processes(tmp_path):
    root = str(tmp_path / "store")
    first = acquire_in_process(root, "process-a", TTL_S)
    assert first.startswith("granted")
    assert acquire_in_process(root, "process-b", TTL_S) == "held process-a"
    store = open_store(root)
    lease = store.lease_of("s1")
    assert (lease.holder, lease.token) == ("process-a", int(first.split()[1]))
    assert store.release_lease(lease)  # compare-and-delete by the grant, whoever calls it
    granted = acquire_in_process(root, "process-b", TTL_S)
    assert granted.startswith("granted") and int(granted.split()[1]) > lease.token
    assert store.lease_of("s1").holder == "process-b"
