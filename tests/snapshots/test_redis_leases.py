"""The Redis store's own leases (a save's writer lease, gc's lease): renewed while the work runs,
released only by their holder, and fencing: an expired holder cannot delete or write over a newer one."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from kiln.errors import UnavailableError
from kiln.snapshots import blobs, redis_store
from kiln.snapshots.redis_store import PREFIX, RedisStore
from tests.snapshots.synthetic import page, synthetic

WAIT_S = 30.0  # bound on every wait for an event a test itself sets


def with_garbage(url: str, live: list[int], garbage: list[int]) -> RedisStore:
    store = RedisStore(url)
    store.save(*synthetic("snap-live", [page(n) for n in live]))
    store.save(*synthetic("snap-gone", [page(n) for n in garbage]))
    store.delete_manifest("snap-gone")
    return store


def digests(*seeds: int) -> list[str]:
    return [blobs.digest(page(n)) for n in seeds]


def pause_gc_at_listing(store: RedisStore) -> tuple[threading.Event, threading.Event]:
    """Make the store's next gc stop after taking its lease, before it reads the manifests: (entered,
    proceed) events."""
    entered, proceed = threading.Event(), threading.Event()
    listing = store.manifest_ids

    def paused(owner: str | None = None) -> list[str]:
        entered.set()
        assert proceed.wait(WAIT_S)
        return listing(owner)

    store.manifest_ids = paused
    return entered, proceed


def run_paused(store: RedisStore, proceed: threading.Event, entered: threading.Event,
               meanwhile: Callable[[], None]) -> BaseException | None:
    """Run store.gc() on a thread, do `meanwhile` once it holds its lease, let it go on: its error."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(store.gc)
        assert entered.wait(WAIT_S)
        try:
            meanwhile()
        finally:
            proceed.set()
        return future.exception(WAIT_S)


def test_a_gc_whose_lease_was_taken_over_leaves_the_new_holders_lease_and_deletes_nothing(redis_url):
    store = with_garbage(redis_url, live=[1], garbage=[2, 3])
    entered, proceed = pause_gc_at_listing(store)
    client = redis.Redis.from_url(redis_url)
    error = run_paused(store, proceed, entered, lambda: client.set(PREFIX + "gc", "another-gc", px=60_000))
    assert isinstance(error, UnavailableError) and "lease" in str(error)
    assert client.get(PREFIX + "gc") == b"another-gc"  # not deleted by the gc that lost it
    assert store.missing(digests(1, 2, 3)) == set()


def test_a_lapsed_gc_stops_deleting_at_its_next_batch(redis_url, monkeypatch):
    monkeypatch.setattr(redis_store, "GC_BATCH", 1)
    store = with_garbage(redis_url, live=[1], garbage=[2, 3, 4])
    client = redis.Redis.from_url(redis_url)
    collect = store._scripts["collect"]

    def collect_then_lapse(keys: list[str], args: list[str]) -> int:
        freed = collect(keys=keys, args=args)
        client.delete(PREFIX + "gc")  # the lease lapses (the gc stalled past it) after one batch
        return freed

    store._scripts["collect"] = collect_then_lapse
    with pytest.raises(UnavailableError, match="after deleting 1 of 3"):
        store.gc()
    assert len(store.missing(digests(2, 3, 4))) == 1 and not store.missing(digests(1))


def test_a_long_gc_renews_its_lease_and_is_not_overtaken(redis_url, monkeypatch):
    monkeypatch.setattr(redis_store, "LEASE_MS", 1_500)
    monkeypatch.setattr(redis_store, "WAIT_S", 6.0)  # four lease lengths: unrenewed, it would lapse
    store = with_garbage(redis_url, live=[1], garbage=[2])
    entered, proceed = pause_gc_at_listing(store)
    rival = RedisStore(redis_url)
    refusals = []

    def rival_gc() -> None:
        with pytest.raises(UnavailableError, match="another snapshot gc") as refused:
            rival.gc()
        refusals.append(refused.value)

    assert run_paused(store, proceed, entered, rival_gc) is None
    assert len(refusals) == 1
    assert store.missing(digests(1, 2)) == set(digests(2))  # the first gc finished its work
    assert redis.Redis.from_url(redis_url).get(PREFIX + "gc") is None  # and released its lease


def test_a_save_that_outlived_its_writer_lease_does_not_write_its_manifest(redis_url):
    """The save finds page 1 stored, then stalls past its writer lease; a gc runs meanwhile and deletes
    page 1 (nothing referenced it). Writing the manifest now would name a deleted blob."""
    store = with_garbage(redis_url, live=[5], garbage=[1])
    client = redis.Redis.from_url(redis_url)
    rival = RedisStore(redis_url)
    missing = store.missing

    def stall_past_lease(wanted: list[str]) -> set[str]:
        absent = missing(wanted)
        client.delete(*client.keys(PREFIX + "writer:*"))  # the writer lease lapses
        rival.gc()
        return absent

    store.missing = stall_past_lease
    with pytest.raises(UnavailableError, match="writer lease"):
        store.save(*synthetic("snap-new", [page(1)]))
    assert store.get_manifest("snap-new") is None
    del store.missing
    store.save(*synthetic("snap-new", [page(1)]))  # saved again with its blobs: complete
    assert not store.missing(digests(1))
