"""The store contract, on both backends: set-if-absent blobs, atomic manifests, listing, deletion, gc;
and typed errors when the medium fails (a full disk, Redis going away)."""

from __future__ import annotations

import errno
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from kiln.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from kiln.snapshots import blobs
from kiln.snapshots.local import DirectoryStore
from kiln.snapshots.store import open_store
from tests.snapshots.conftest import RedisProcess
from tests.snapshots.synthetic import PAGE_BYTES, page, synthetic


def test_save_dedups_and_round_trips(store_target):
    store = open_store(store_target)
    first, first_blobs = synthetic("snap-a", [page(1), page(2)])
    report = store.save(first, first_blobs)
    assert (report.blobs_written, report.blobs_deduplicated) == (2, 0)
    second, second_blobs = synthetic("snap-b", [page(1), page(2), page(3)])
    report = store.save(second, second_blobs)
    assert (report.blobs_written, report.blobs_deduplicated) == (1, 2)
    assert store.save(second, {}).blobs_written == 0  # unchanged: only the manifest again
    assert store.get_manifest("snap-b") == second
    assert store.manifest_ids() == ["snap-a", "snap-b"]
    store.save(*synthetic("snap-c", [page(4)], owner="sha256:1"))
    assert [m.snapshot_id for m in store.manifests("sha256:1")] == ["snap-c"]
    assert [m.snapshot_id for m in store.manifests("sha256:0")] == ["snap-a", "snap-b"]
    assert store.delete_manifest("snap-c") and store.manifests("sha256:1") == []
    digest = blobs.digest(page(3))
    assert blobs.decode(store.get_blob(digest), digest, PAGE_BYTES) == page(3)
    assert store.missing([digest, "0" * 64]) == {"0" * 64}
    assert store.blob_sizes([digest, "0" * 64]) == {digest: len(second_blobs[digest])}  # absent: left out
    store.close()


def test_a_manifest_whose_blobs_are_absent_is_not_written(store_target):
    store = open_store(store_target)
    manifest, _ = synthetic("snap-a", [page(1)])
    with pytest.raises(FailedPreconditionError, match="neither stored"):
        store.save(manifest, {})
    assert store.get_manifest("snap-a") is None and store.manifest_ids() == []


def test_gc_deletes_only_unreferenced_blobs(store_target):
    store = open_store(store_target)
    kept, kept_blobs = synthetic("snap-keep", [page(1), page(2)])
    dropped, dropped_blobs = synthetic("snap-drop", [page(2), page(3)])
    store.save(kept, kept_blobs)
    store.save(dropped, dropped_blobs)
    assert store.delete_manifest("snap-drop") and not store.delete_manifest("snap-drop")
    report = store.gc()
    assert (report.manifests, report.blobs_kept, report.blobs_deleted) == (1, 2, 1)
    assert not store.missing(kept.digests())
    assert store.missing([blobs.digest(page(3))])


def test_decompress_refuses_corrupt_truncated_and_mismatched_blobs():
    raw = page(7)
    blob = blobs.compress(raw)
    digest = blobs.digest(raw)
    for bad in (blob[:-3], blob[:5] + bytes([blob[5] ^ 1]) + blob[6:]):
        with pytest.raises(FailedPreconditionError):
            blobs.decode(bad, digest, PAGE_BYTES)
    with pytest.raises(FailedPreconditionError, match="digest"):
        blobs.decode(blobs.compress(page(8)), digest, PAGE_BYTES)
    with pytest.raises(FailedPreconditionError, match="bytes"):
        blobs.decode(blob, digest, PAGE_BYTES * 2)


def test_store_urls():
    with pytest.raises(InvalidArgumentError, match="redis://"):
        open_store("s3://bucket/x")
    with pytest.raises(UnavailableError, match="unreachable"):
        open_store("redis://127.0.0.1:1/0")


def test_a_full_disk_is_resource_exhausted_and_keeps_the_previous_snapshot(tmp_path, monkeypatch):
    store = DirectoryStore(tmp_path)
    manifest, stored = synthetic("snap-a", [page(1)])
    store.save(manifest, stored)
    newer, newer_blobs = synthetic("snap-a", [page(1), page(2)])

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(DirectoryStore, "_stage", full)  # the manifest cannot be written
    with pytest.raises(ResourceExhaustedError, match="full"):
        store.save(newer, newer_blobs)
    monkeypatch.undo()
    assert store.get_manifest("snap-a") == manifest


def test_redis_going_away_is_unavailable(redis_server, tmp_path):
    own = RedisProcess(tmp_path)
    store = open_store(own.url)
    manifest, stored = synthetic("snap-a", [page(1)])
    store.save(manifest, stored)
    own.stop()
    with pytest.raises(UnavailableError):
        store.save(*synthetic("snap-b", [page(2)]))
    with pytest.raises(UnavailableError):
        store.get_manifest("snap-a")


def test_concurrent_saves_write_each_blob_once(store_target):
    store = open_store(store_target)
    pages = [page(i) for i in range(40)]
    with ThreadPoolExecutor(4) as pool:
        reports = list(pool.map(lambda n: store.save(*synthetic(f"snap-{n}", pages)), range(4)))
    assert sum(r.blobs_written for r in reports) == len(pages)
    assert sum(r.blobs_deduplicated for r in reports) == 3 * len(pages)
    assert not store.missing(blobs.digest(p) for p in pages)
    store.close()
