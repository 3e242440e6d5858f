"""gc fails closed on both backends: while any manifest cannot be read (corrupt, a newer format version)
or reading one fails (a Redis timeout), it deletes no blob, says which manifests, and `kiln snapshot gc`
exits non-zero."""

from __future__ import annotations

import json

import pytest
import redis

from kiln.cli import main
from kiln.errors import FailedPreconditionError, UnavailableError
from kiln.snapshots import blobs
from kiln.snapshots.local import DirectoryStore
from kiln.snapshots.redis_store import PREFIX, RedisStore
from kiln.snapshots.store import SnapshotStore, open_store
from tests.snapshots.synthetic import page, synthetic

DIGESTS = [blobs.digest(page(n)) for n in (1, 2, 9)]


def seeded(target: str) -> SnapshotStore:
    """snap-live references page 1, snap-other page 2; page 9 is garbage (its manifest was deleted)."""
    store = open_store(target)
    store.save(*synthetic("snap-live", [page(1)]))
    store.save(*synthetic("snap-other", [page(2)]))
    store.save(*synthetic("snap-gone", [page(9)]))
    store.delete_manifest("snap-gone")
    return store


def overwrite_manifest(store: SnapshotStore, snapshot_id: str, data: bytes) -> None:
    """Replace a stored manifest's bytes behind the store's back, as a crash, a bug or a newer Kiln would."""
    if isinstance(store, DirectoryStore):
        (store.root / "manifests" / f"{snapshot_id}.json").write_bytes(data)
    else:
        store.client.set(PREFIX + "manifest:" + snapshot_id, data)


def newer_format(store: SnapshotStore, snapshot_id: str) -> bytes:
    raw = json.loads(store.manifest_bytes(snapshot_id))
    return json.dumps({**raw, "format_version": raw["format_version"] + 1, "new_field": [1]}).encode()


@pytest.mark.parametrize("damage", ["corrupt", "newer-format"])
def test_gc_deletes_nothing_while_a_manifest_is_unreadable(store_target, damage):
    store = seeded(store_target)
    torn = b'{"format_version": 1, "snapshot_id": "snap-oth'
    bad = torn if damage == "corrupt" else newer_format(store, "snap-other")
    overwrite_manifest(store, "snap-other", bad)
    with pytest.raises(FailedPreconditionError, match="snap-other") as refused:
        store.gc()
    assert "deleted nothing" in str(refused.value)
    assert store.missing(DIGESTS) == set()  # page 2 (live, unreadable manifest) and page 9 (garbage) alike
    assert [m.snapshot_id for m in store.manifests()] == ["snap-live"]  # listing still skips it
    overwrite_manifest(store, "snap-other", synthetic("snap-other", [page(2)])[0].to_json())
    assert store.gc().blobs_deleted == 1 and store.missing(DIGESTS) == {DIGESTS[2]}
    store.close()


def test_gc_deletes_nothing_when_reading_a_manifest_times_out(redis_url, monkeypatch):
    store = seeded(redis_url)
    assert isinstance(store, RedisStore)
    get = store.client.get

    def flaky_get(key: str) -> bytes | None:
        if key == PREFIX + "manifest:snap-other":
            raise redis.exceptions.TimeoutError("Timeout reading from socket")
        return get(key)

    monkeypatch.setattr(store.client, "get", flaky_get)
    with pytest.raises(UnavailableError, match="Timeout"):
        store.gc()
    monkeypatch.undo()
    assert store.missing(DIGESTS) == set()
    assert store.client.get(PREFIX + "gc") is None  # the gc lease was released
    store.close()


def test_the_gc_command_names_unreadable_manifests_and_fails(tmp_path, capsys):
    root = str(tmp_path / "store")
    store = seeded(root)
    overwrite_manifest(store, "snap-other", b"not json")
    assert main(["snapshot", "--snapshot-dir", root, "gc"]) != 0
    err = capsys.readouterr().err
    assert "FAILED_PRECONDITION" in err and "snap-other" in err and "deleted nothing" in err
    assert store.missing(DIGESTS) == set()
