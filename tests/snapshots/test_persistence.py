"""Snapshots in process: bit-exact restore, dedup, incremental saves, verification, sessions that come
back after eviction and restart (a second LLM over the same directory), owner scoping."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

from kiln.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from kiln.snapshots.local import DirectoryStore
from kiln.snapshots.manifest import session_snapshot_id
from kiln.snapshots.store import open_store
from tests.snapshots.conftest import RedisProcess
from tests.snapshots.synthetic import blob_place, flip_blob_byte, stored_digests

ARCHS = ["llama", "gemma3"]  # gemma3: window groups release pages (null in the manifest)
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generated(session, **options) -> list[int]:
    return session.generate(**{**GREEDY, **options}).result().token_ids


def pages_of(llm, session_id: str) -> dict:
    """The session's page bytes by (group, index), read through a capture."""
    capture = llm.sessions.capture(session_id, None)
    return {key: block.clone() for key, block in capture.image.blocks.items()}


@pytest.mark.parametrize(("arch", "codec"), [("llama", "none"), ("gemma3", "none"), ("llama", "int8"), ("gemma3", "int4")])
def test_restore_is_bit_exact_and_continues_like_an_uninterrupted_run(tiny_llm, tmp_path, arch, codec):
    """Coded pools (int8, int4) snapshot their pages' codes as they are."""
    options = {"speculative": None, "snapshot_dir": str(tmp_path), "kv_codec": codec}
    reference = tiny_llm(arch, speculative=None, kv_codec=codec).create_session(prompt(70))
    whole = generated(reference, max_tokens=24)
    llm = tiny_llm(arch, **options)
    session = llm.create_session(prompt(70))
    first = generated(session)
    snapshot_id = session.snapshot()
    original = pages_of(llm, session.id)
    other = tiny_llm(arch, **options)
    restored = other.restore_session(snapshot_id)
    assert restored.id != session.id and restored.tokens == session.tokens
    copied = pages_of(other, restored.id)
    assert copied.keys() == original.keys()
    assert all(torch.equal(copied[key], original[key]) for key in original)
    assert restored.info().computed_tokens == session.info().computed_tokens  # nothing recomputed
    rest = restored.generate(**GREEDY)
    assert first + rest.result().token_ids == whole
    assert rest.result().usage.reused_tokens == len(session.tokens) - 1  # only the last token computed


@pytest.mark.parametrize("policy", ["sink_window", "restore"])
def test_bounded_policies_come_back_with_their_sizes(tiny_llm, tmp_path, policy):
    """A sink_window snapshot holds the pages its policy keeps (the rest is gone by design); a restore
    session's evicted pages live in the tiers, so its snapshot holds the history and the restored
    session recomputes the K/V: either way the continuation equals the uninterrupted run's."""
    sizes = {"kv_policy": policy, "kv_sink_tokens": 8, "kv_window_tokens": 32}
    llm = tiny_llm("llama", speculative=None, snapshot_dir=str(tmp_path))
    session = llm.create_session(prompt(90), **sizes)
    generated(session)
    snapshot_id = session.snapshot()
    uninterrupted = generated(session)
    restored = tiny_llm("llama", speculative=None, snapshot_dir=str(tmp_path)).restore_session(snapshot_id)
    info = restored.info()
    assert (info.kv_policy, info.kv_sink_tokens, info.kv_window_tokens) == (policy, 8, 32)
    assert (info.computed_tokens > 0) == (policy == "sink_window")
    assert generated(restored) == uninterrupted


def test_seeded_sampling_continues_identically(tiny_llm, tmp_path):
    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 7}
    llm = tiny_llm("llama", speculative=None, snapshot_dir=str(tmp_path))
    session = llm.create_session(prompt(40))
    generated(session, **sampled)
    snapshot_id = session.snapshot()
    uninterrupted = generated(session, **{**sampled, "seed": 8})
    restored = tiny_llm("llama", speculative=None, snapshot_dir=str(tmp_path)).restore_session(snapshot_id)
    assert generated(restored, **{**sampled, "seed": 8}) == uninterrupted


def test_equal_pages_are_stored_once(tiny_llm, tmp_path):
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path))
    store = llm.persistence.store
    session = llm.create_session(prompt(1000))  # the tiny models' context is 1024
    generated(session, max_tokens=2)
    session.snapshot()
    blobs = _blobs(tmp_path)
    again = session.snapshot()  # unchanged: no new blob
    assert _blobs(tmp_path) == blobs
    manifest = store.get_manifest(again)
    full, partial = divmod(manifest.num_computed, 16)
    assert partial and manifest.page_count() == full + 1
    for _ in range(10):  # forks share the full pages: each adds at most its partial page
        fork = session.fork(at=len(session.tokens) - 3)
        fork.snapshot()
    assert len(_blobs(tmp_path)) <= len(blobs) + 10


def test_a_turn_writes_only_its_new_pages(tiny_llm, tmp_path):
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path))
    session = llm.create_session(prompt(300))
    generated(session, max_tokens=2)
    session.snapshot()
    llm.persistence.flush()
    before = llm.persistence.stats.blobs_written
    session.append(prompt(40, seed=1))
    generated(session, max_tokens=2)
    session.snapshot()
    llm.persistence.flush()
    new_pages = (len(session.tokens) - 1) // 16 - 300 // 16 + 1  # pages the turn filled, plus the partial one
    assert llm.persistence.stats.blobs_written - before <= new_pages + 1
    assert llm.persistence.stats.dedup_bytes >= (300 // 16) * llm.engine.kv_page_bytes


def _blobs(root: Path) -> list[str]:
    return stored_digests(root)


def test_sessions_come_back_after_a_restart_with_id_owner_and_history(tiny_llm, tmp_path):
    options = {"speculative": None, "snapshot_dir": str(tmp_path), "instance_id": "node-1"}
    llm = tiny_llm("llama", **options)
    session = llm.create_session(prompt(50))
    first = generated(session)
    llm.persistence.flush()
    history = session.tokens
    after = tiny_llm("llama", **options)  # the same server restarted (after a kill -9: it never handed off)
    back = after.get_session(session.id)
    assert back.tokens == history and back.info().computed_tokens == len(history) - 1
    assert generated(back) == generated(session)
    assert first
    assert after.persistence.stats.restores["session"] == 1


def test_sessions_not_in_memory_are_listed_as_not_resident(tiny_llm, tmp_path):
    """After a restart (and after an eviction) the owner's list holds its saved sessions, marked as not
    resident, once each; another owner's, and closed ones, are not listed."""
    options = {"speculative": None, "snapshot_dir": str(tmp_path), "instance_id": "node-1"}
    llm = tiny_llm("llama", **options)
    kept, closed = llm.create_session(prompt(50)), llm.create_session(prompt(20, seed=1))
    generated(kept)
    theirs = llm.sessions.create(prompt(10), owner="someone else")
    llm.persistence.flush()
    closed.close()
    after = tiny_llm("llama", **options, max_sessions=1)
    (listed,) = after.sessions.list()
    assert (listed.session_id, listed.history_tokens, listed.resident) == (kept.id, len(kept.tokens), False)
    assert (listed.computed_tokens, listed.resident_kv_bytes, listed.kv_policy) == (0, 0, "full")
    assert listed.last_saved_at is not None and not listed.unsaved_changes
    assert [s.session_id for s in after.sessions.list("someone else")] == [theirs]
    after.get_session(kept.id)
    assert [(s.session_id, s.resident) for s in after.sessions.list()] == [(kept.id, True)]
    fresh = after.create_session(prompt(30, seed=2))  # evicts the restored one (max_sessions=1)
    assert [(s.session_id, s.resident) for s in after.sessions.list()] == [(fresh.id, True), (kept.id, False)]


def test_listing_answers_while_the_store_is_unreachable(tiny_llm, tmp_path, monkeypatch):
    """Sessions in memory, and an evicted one whose capture is still queued, are listed; those only the
    store holds are left out until it answers again."""
    llm = tiny_llm("llama", speculative=None, snapshot_dir=str(tmp_path), max_sessions=1)
    evicted = llm.create_session(prompt(20))
    llm.persistence.flush()

    def unreachable(*args: object) -> None:
        raise UnavailableError("the store is unreachable")

    monkeypatch.setattr(llm.persistence.store, "manifests", unreachable)
    monkeypatch.setattr(llm.persistence.store, "save", unreachable)  # the eviction's capture stays queued
    live = llm.create_session(prompt(30, seed=1))  # evicts the first
    assert [(s.session_id, s.resident) for s in llm.sessions.list()] == [(live.id, True), (evicted.id, False)]


def test_evicted_sessions_are_restored_lazily(tiny_llm, tmp_path):
    llm = tiny_llm("llama", speculative=None, snapshot_dir=str(tmp_path), max_sessions=2)
    sessions = [llm.create_session(prompt(40, seed=i)) for i in range(3)]  # the third evicts the first
    assert len(llm.sessions) == 2
    back = llm.get_session(sessions[0].id)  # evicts the second, restores the first
    assert back.tokens == prompt(40, seed=0)
    assert llm.sessions.evictions["lru"] == 2
    assert generated(back)


def test_closed_sessions_stay_closed(tiny_llm, tmp_path):
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path))
    session = llm.create_session(prompt(20))
    generated(session, max_tokens=2)
    llm.persistence.flush()
    session.close()
    llm.persistence.flush()
    assert llm.persistence.store.get_manifest(session_snapshot_id(session.id)) is None
    with pytest.raises(NotFoundError):
        tiny_llm("llama", snapshot_dir=str(tmp_path)).get_session(session.id)


def test_graceful_close_saves_sessions_that_never_generated(tiny_loaded, tmp_path):
    from kiln.llm import LLM

    llm = LLM(loaded=tiny_loaded("llama"), snapshot_dir=str(tmp_path), kv_budget_bytes=16 << 20)
    session_id = llm.create_session(prompt(30)).id
    llm.close()
    with LLM(loaded=tiny_loaded("llama"), snapshot_dir=str(tmp_path), kv_budget_bytes=16 << 20) as again:
        assert again.get_session(session_id).tokens == prompt(30)


def test_another_owner_sees_nothing(tiny_llm, tmp_path):
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path))
    session_id = llm.sessions.create(prompt(20), owner="key-a")
    snapshot_id = llm.snapshots.snapshot(session_id, "key-a")
    with pytest.raises(NotFoundError):
        llm.snapshots.restore(snapshot_id, "key-b")
    with pytest.raises(NotFoundError):
        llm.persistence.delete(snapshot_id, "key-b")
    assert [s.snapshot_id for s in llm.persistence.list("key-a")] == [snapshot_id]
    assert llm.persistence.list("key-b") == []
    assert "key-a" not in (tmp_path / "manifests" / f"{snapshot_id}.json").read_text()
    llm.close()  # hands the session off
    other = tiny_llm("llama", snapshot_dir=str(tmp_path))
    with pytest.raises(NotFoundError):
        other.sessions.info(session_id, "key-b")
    assert other.sessions.tokens(session_id, "key-a") == prompt(20)


def test_bad_ids_and_snapshots_off(tiny_llm, tmp_path):
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path))
    with pytest.raises(NotFoundError):
        llm.restore_session("snap-unknown")
    with pytest.raises(InvalidArgumentError):
        llm.restore_session("../../etc/passwd")
    with pytest.raises(NotFoundError):
        llm.get_session("../escape")
    with pytest.raises(FailedPreconditionError, match="snapshots are off"):
        tiny_llm("llama").create_session(prompt(5)).snapshot()
    with pytest.raises(InvalidArgumentError, match="not both"):
        tiny_llm("llama", snapshot_dir=str(tmp_path), snapshot_store="redis://127.0.0.1:1/0")


def test_a_corrupt_blob_is_refused_and_nothing_is_loaded(tiny_llm, tmp_path):
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path))
    session = llm.create_session(prompt(60))
    generated(session, max_tokens=2)
    snapshot_id = session.snapshot()
    flip_blob_byte(tmp_path, sorted(llm.persistence.store.get_manifest(snapshot_id).digests())[0])
    other = tiny_llm("llama", snapshot_dir=str(tmp_path))
    used = other.engine.kv_usage().used
    with pytest.raises(FailedPreconditionError, match="corrupt|digest"):
        other.restore_session(snapshot_id)
    assert other.engine.kv_usage().used == used and len(other.sessions) == 0
    assert other.persistence.stats.verification_failures == 1
    assert generated(other.create_session(prompt(10)), max_tokens=2)  # still serving


def test_a_truncated_blob_is_refused(tiny_llm, tmp_path):
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path))
    session = llm.create_session(prompt(40))
    generated(session, max_tokens=2)
    snapshot_id = session.snapshot()
    digest = sorted(llm.persistence.store.get_manifest(snapshot_id).digests())[0]
    path, entry = blob_place(tmp_path, digest)
    path.write_bytes(path.read_bytes()[: entry.offset + 100])
    with pytest.raises(FailedPreconditionError):
        llm.restore_session(snapshot_id)


def test_a_snapshot_of_another_model_or_format_version_is_refused(tiny_llm, tmp_path):
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path))
    session = llm.create_session(prompt(40))
    generated(session, max_tokens=2)
    snapshot_id = session.snapshot()
    with pytest.raises(FailedPreconditionError, match="another model"):
        tiny_llm("qwen3", snapshot_dir=str(tmp_path)).restore_session(snapshot_id)
    with pytest.raises(FailedPreconditionError, match="encoding 'raw' \\(this server: 'int8'\\)"):
        tiny_llm("llama", snapshot_dir=str(tmp_path), kv_codec="int8").restore_session(snapshot_id)
    path = tmp_path / "manifests" / f"{snapshot_id}.json"
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "format_version": 99}))
    with pytest.raises(FailedPreconditionError, match="format version 99"):
        llm.restore_session(snapshot_id)
    path.write_text(json.dumps({**raw, "num_computed": raw["num_computed"] - 16}))
    with pytest.raises(FailedPreconditionError, match="pages for"):
        llm.restore_session(snapshot_id)
    path.write_text(json.dumps({**raw, "token_ids": [*raw["token_ids"][:-1], 10**6]}))
    with pytest.raises(InvalidArgumentError, match="token ids"):
        llm.restore_session(snapshot_id)


def test_gc_keeps_referenced_blobs_only(tiny_llm, tmp_path):
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path))
    keep = llm.create_session(prompt(100))
    generated(keep, max_tokens=2)
    kept = keep.snapshot()
    drop = llm.create_session(prompt(100, seed=5))
    generated(drop, max_tokens=2)
    dropped = drop.snapshot()
    drop.close()
    keep.close()
    llm.persistence.flush()
    llm.prefix_store.flush()
    llm.delete_snapshot(dropped)
    store = open_store(tmp_path)
    report = store.gc()
    assert report.blobs_deleted > 0
    assert not store.missing(store.get_manifest(kept).digests())
    prefix_pages = {record.digest for record in store.prefix_records(llm.prefix_store.space)}  # full pages only
    assert set(_blobs(tmp_path)) == store.get_manifest(kept).digests() | prefix_pages
    assert llm.restore_session(kept).tokens[:100] == prompt(100)


def test_a_full_disk_fails_the_save_not_the_session(tiny_llm, tmp_path, monkeypatch):
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path))
    session = llm.create_session(prompt(40))
    generated(session, max_tokens=2)
    earlier = session.snapshot()
    history = session.tokens

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DirectoryStore, "_write_pack", full)
    session.append(prompt(20, seed=3))
    more = generated(session, max_tokens=2)  # new pages: the background save of this turn fails too
    llm.persistence.flush()
    failures = llm.persistence.stats.save_failures["RESOURCE_EXHAUSTED"]
    with pytest.raises(ResourceExhaustedError, match="full"):
        session.snapshot()
    assert llm.persistence.stats.save_failures["RESOURCE_EXHAUSTED"] == failures + 1
    assert session.tokens == history + prompt(20, seed=3) + more
    assert generated(session, max_tokens=2)  # the session in memory goes on
    monkeypatch.undo()
    assert llm.restore_session(earlier).tokens == history  # the earlier snapshot is intact


def test_redis_going_away_fails_the_save_not_the_session(tiny_llm, redis_server, tmp_path):
    own = RedisProcess(tmp_path)
    llm = tiny_llm("llama", snapshot_store=own.url)
    llm.persistence.close_timeout_s = 1.0  # the store stays down: closing gives up on this session's last turn
    session = llm.create_session(prompt(40))
    generated(session, max_tokens=2)
    assert session.snapshot()
    llm.persistence.flush()  # the turn's background save is done: the failure below is the explicit one
    own.stop()
    with pytest.raises(UnavailableError):
        session.snapshot()
    assert llm.persistence.stats.save_failures["UNAVAILABLE"] == 1
    assert generated(session, max_tokens=2) and len(session.tokens) == 44


def test_checkpoints_move_between_engines_through_redis(tiny_llm, redis_url):
    one = tiny_llm("llama", speculative=None, snapshot_store=redis_url)
    session = one.create_session(prompt(70))
    generated(session)
    snapshot_id = session.snapshot()
    two = tiny_llm("llama", speculative=None, snapshot_store=redis_url)
    moved = two.restore_session(snapshot_id)
    assert moved.info().computed_tokens == len(session.tokens) - 1
    assert generated(moved) == generated(session)
