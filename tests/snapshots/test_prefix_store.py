"""The persistent prefix store's index on both backends (no model): records beside manifests, gc keeps
what a record or a manifest names and collects a dropped record's blob, the byte budget evicts the least
recently used (a hit refreshes), a corrupt or missing blob is left out of a fetch, counted and its record
dropped, another prefix space never sees a record, a torn index file reads as none, a failing store is
counted and never raises to the engine's calls."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import FailedPreconditionError, UnavailableError
from kiln.snapshots import blobs, prefix_file
from kiln.snapshots.prefix_store import PrefixStore
from kiln.snapshots.store import PrefixRecord, open_store
from tests.snapshots.synthetic import PAGE_BYTES, flip_blob_byte, page, synthetic

SPACE, OTHER_SPACE = "a" * 32, "b" * 32


def key(n: int, group: int = 0) -> tuple[int, bytes]:
    return (group, n.to_bytes(16, "big"))


def tensor(n: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(page(n)), dtype=torch.uint8)


def record(n: int, used: float = 1.0) -> PrefixRecord:
    return PrefixRecord(0, key(n)[1], blobs.digest(page(n)), PAGE_BYTES, used)


def prefix_store(target: str, budget_pages: int = 100, space: str = SPACE) -> PrefixStore:
    return PrefixStore(open_store(target), space, PAGE_BYTES, budget_pages * PAGE_BYTES)


def test_records_round_trip_and_gc_keeps_what_a_record_or_a_manifest_names(store_target):
    store = open_store(store_target)
    for n in (1, 2, 3):  # one save each: a directory store's pack per save, collected once all its blobs are dead
        assert store.save_prefix(SPACE, [record(n)], {blobs.digest(page(n)): page(n)}).blobs_written == 1
    store.save(*synthetic("snap-a", [page(3)]))  # page 3: a snapshot's page too, one blob
    assert sorted(store.prefix_records(SPACE), key=lambda r: r.chain) == [record(1), record(2), record(3)]
    assert store.prefix_records(OTHER_SPACE) == []
    with pytest.raises(FailedPreconditionError, match="neither stored"):
        store.save_prefix(SPACE, [record(4)], {})  # a record is never written before its blob
    assert store.gc().blobs_deleted == 0
    store.touch_prefix(SPACE, {key(1): 50.0, key(9): 60.0})  # an absent record stays absent
    assert {r.chain: r.last_used for r in store.prefix_records(SPACE)} == {key(1)[1]: 50.0, key(2)[1]: 1.0, key(3)[1]: 1.0}
    store.drop_prefix(SPACE, [key(2), key(3)])
    assert store.gc().blobs_deleted == 1  # page 2; page 3 stays for its manifest
    assert store.missing([blobs.digest(page(n)) for n in (1, 2, 3)]) == {blobs.digest(page(2))}
    store.close()


def test_the_budget_evicts_least_recently_used_a_hit_refreshes_and_gc_collects(store_target):
    pages = prefix_store(store_target, budget_pages=4)
    for n in range(1, 5):  # one write each (a directory store's pack is collected once all its blobs are dead)
        pages.offer([(key(n), tensor(n))])
        assert pages.flush()
    assert pages.stored({key(n) for n in range(1, 9)}) == {key(n) for n in range(1, 5)}
    pages.touch([key(1)])  # 1 is used again: 2 is the least recently used now
    assert set(pages.fetch([key(3)])) == {key(3)}  # a fetch is a use too
    pages.offer([(key(5), tensor(5))])
    assert pages.flush()  # written, then the least recently used evicted, in the same pass
    assert pages.stored({key(n) for n in range(1, 6)}) == {key(1), key(3), key(4), key(5)}
    assert pages.stored_bytes == 4 * PAGE_BYTES and pages.stats.evicted_pages == 1 and pages.stats.gc_runs == 1
    pages.close()
    store = open_store(store_target)
    assert {r.key for r in store.prefix_records(SPACE)} == {key(1), key(3), key(4), key(5)}
    assert store.missing([blobs.digest(page(2))])  # a quarter of the budget dropped: the writer collected it
    reopened = prefix_store(store_target, budget_pages=4)  # a restart reads the records back, oldest first
    assert reopened.stored({key(n) for n in range(1, 6)}) == {key(1), key(3), key(4), key(5)}
    reopened.close()


def test_a_corrupt_or_missing_blob_is_left_out_counted_and_its_record_dropped(tmp_path):
    pages = prefix_store(str(tmp_path))
    pages.offer([(key(n), tensor(n)) for n in (1, 2, 3)])
    assert pages.flush()
    flip_blob_byte(tmp_path, blobs.digest(page(2)))
    fetched = pages.fetch([key(1), key(2), key(3), key(7)])  # 7 was never stored: not asked of the store
    assert set(fetched) == {key(1), key(3)} and bytes(fetched[key(3)].numpy()) == page(3)
    assert pages.stats.failed_pages == 1 and pages.stored([key(2)]) == set()
    pages.close()
    assert {r.key for r in open_store(str(tmp_path)).prefix_records(SPACE)} == {key(1), key(3)}


def test_another_space_never_sees_a_record(store_target):
    mine = prefix_store(store_target)
    mine.offer([(key(1), tensor(1))])
    assert mine.flush()
    mine.close()
    theirs = prefix_store(store_target, space=OTHER_SPACE)  # another model, codec or page size
    assert theirs.stored([key(1)]) == set() and theirs.fetch([key(1)]) == {}
    theirs.close()


def test_a_torn_index_file_reads_as_no_records(tmp_path):
    store = open_store(str(tmp_path))
    store.save_prefix(SPACE, [record(1)], {blobs.digest(page(1)): page(1)})
    path = tmp_path / "prefix" / f"{SPACE}{prefix_file.SUFFIX}"
    path.write_bytes(path.read_bytes()[:-5])
    assert store.prefix_records(SPACE) == []
    assert store.gc().blobs_deleted == 1  # its blob is garbage now: the store is a cache


def test_a_failing_store_is_counted_and_never_raises_to_the_engine(tmp_path, monkeypatch):
    pages = prefix_store(str(tmp_path))
    store = pages.store

    def down(*args: object, **kwargs: object) -> None:
        raise UnavailableError("the snapshot store is unreachable")

    monkeypatch.setattr(store, "save_prefix", down)
    pages.offer([(key(n), tensor(n)) for n in (1, 2)])
    assert pages.flush()
    assert pages.stats.write_failures == 2 and pages.stored([key(1), key(2)]) == set()
    monkeypatch.undo()
    pages.offer([(key(1), tensor(1))])  # back: the next offer is written
    assert pages.flush() and pages.stored([key(1)]) == {key(1)}
    monkeypatch.setattr(store, "get_blobs", down)
    with pytest.raises(UnavailableError):  # the engine's fetch thread counts it and recomputes
        pages.fetch([key(1)])
    pages.close()


def test_a_full_queue_drops_offers_and_counts_them(tmp_path):
    pages = PrefixStore(open_store(str(tmp_path)), SPACE, PAGE_BYTES, 100 * PAGE_BYTES, queue_bytes=2 * PAGE_BYTES)
    with pages._cond:  # the writer cannot take the queue meanwhile
        pages.offer([(key(n), tensor(n)) for n in (1, 2, 3)])
    assert pages.flush()
    assert pages.stats.dropped_pages == 1 and pages.stats.pages_written == 2
    pages.close()
