"""Persistence never loses an acknowledged change: every finished turn is queued for saving even while
its session is busy again; durable_turns sends a finish only once it is saved; a failed save keeps its
capture and retries; closing finishes every save; a blob lost behind the saver's back is written again;
close is all or nothing during a store outage; an invariant-failed session's history is still saved."""

from __future__ import annotations

import threading

import pytest
import torch

from kiln.engine.sampler import SamplingParams
from kiln.engine.sequence import Event, FinishEvent, TokenEvent
from kiln.engine.stream import GenerationStream
from kiln.errors import InvariantViolation, NotFoundError, UnavailableError
from kiln.llm import LLM
from kiln.snapshots.manifest import session_snapshot_id
from kiln.snapshots.persistence import Backoff
from kiln.snapshots.store import open_store
from tests.conftest import outcome_within
from tests.snapshots.hooks import WAIT_S, Call, Gate, HeldStream, on_thread, wait_for
from tests.snapshots.synthetic import blob_place

GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def turn(session, **options) -> list[int]:  # noqa: ANN001
    return session.generate(**{**GREEDY, **options}).result().token_ids


def saved_history(llm, session_id: str) -> list[int] | None:  # noqa: ANN001
    manifest = llm.persistence.store.get_manifest(session_snapshot_id(session_id))
    return None if manifest is None else list(manifest.token_ids)


def test_every_finished_turn_of_a_busy_session_is_saved(tiny_llm, tmp_path, monkeypatch):
    """append -> generate loops with the saver held: when the saver gets to the session it is generating
    again, and what it saves is still the last finished turn (captured at the turn's end, not when the
    saver comes round)."""
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path), speculative=None)
    store = llm.persistence.store
    slow = Gate()
    monkeypatch.setattr(store, "save", slow.wrap(store.save, on_thread("kiln-snapshots")))
    session = llm.create_session(prompt(30))
    for index in range(4):
        session.append(prompt(3, seed=10 + index))
        turn(session)
    finished = session.tokens
    busy = HeldStream(llm.engine.cancel)
    llm.sessions.generate(session.id, SamplingParams(**GREEDY), stream=busy)
    assert busy.first_token.wait(WAIT_S)  # generating again (the engine thread is held at its first token)
    slow.open()
    try:
        assert llm.persistence.flush(WAIT_S)
        assert saved_history(llm, session.id) == finished
    finally:
        busy.release.set()
    busy.result()


def test_durable_turns_send_the_finish_only_once_the_turn_is_saved(tiny_llm, tmp_path, monkeypatch):
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path), speculative=None, durable_turns=True)
    session = llm.create_session(prompt(30))
    assert llm.persistence.flush(WAIT_S)
    store = llm.persistence.store
    slow = Gate()
    monkeypatch.setattr(store, "save", slow.wrap(store.save, on_thread("kiln-snapshots")))
    tokens = threading.Event()
    emitted: list[int] = []
    at_finish: list[list[int] | None] = []

    class Watched(GenerationStream):
        def emit(self, event: Event) -> None:
            if isinstance(event, TokenEvent):
                emitted.append(event.token_id)
                if len(emitted) == GREEDY["max_tokens"]:
                    tokens.set()
            if isinstance(event, FinishEvent):
                at_finish.append(saved_history(llm, session.id))
            super().emit(event)

    stream = Watched(llm.engine.cancel)
    llm.sessions.generate(session.id, SamplingParams(**GREEDY), stream=stream)
    assert tokens.wait(WAIT_S) and slow.entered.wait(WAIT_S)
    assert at_finish == []  # every token is out; the finish waits for the save
    slow.open()
    result = stream.result()
    assert result.finish_reason == "length" and result.token_ids == emitted
    assert at_finish == [prompt(30) + emitted]


def test_a_failed_save_keeps_the_session_and_retries(tiny_llm, tmp_path, monkeypatch):
    """The store fails the next saves: the session's captures stay queued (info says so), its eviction
    loses nothing (it comes back from the queue), and the retries land the whole history."""
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path), speculative=None, max_sessions=1)
    llm.persistence.backoff = Backoff(first_s=0.01, max_s=0.05)
    session = llm.create_session(prompt(40))
    turn(session)
    assert llm.persistence.flush(WAIT_S)
    store = llm.persistence.store
    down = threading.Event()
    down.set()
    save = store.save

    def failing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if down.is_set():
            raise UnavailableError("the store is down")
        return save(*args, **kwargs)

    monkeypatch.setattr(store, "save", failing)
    session.append(prompt(5, seed=1))
    turn(session)
    history = session.tokens
    assert not llm.persistence.flush(WAIT_S)  # tried, failed, kept queued
    info = session.info()
    assert info.unsaved_changes and info.save_failures >= 1
    llm.create_session(prompt(10, seed=2))  # evicts the session whose saves fail
    assert llm.get_session(session.id).tokens == history  # from its queued capture
    assert not llm.persistence.flush(WAIT_S)  # the eviction's capture tried too, and kept queued
    assert llm.persistence.stats.save_failures["UNAVAILABLE"] >= 2  # the turn's save and the eviction's
    assert saved_history(llm, session.id) != history
    down.clear()
    assert wait_for(lambda: llm.persistence.flush(WAIT_S))
    assert saved_history(llm, session.id) == history
    info = llm.get_session(session.id).info()
    assert not info.unsaved_changes and info.save_failures == 0 and info.last_saved_at is not None


def test_closing_finishes_every_save_first(tiny_loaded, tmp_path, monkeypatch):
    """A checkpoint under way (held between hashing and writing its pages) and a queued save when the LLM
    closes: close waits for both; nothing is handed to a shut encoding pool or a closed store. (The
    session's own saves fail here, so only the checkpoint writes its pages.)"""
    llm = LLM(loaded=tiny_loaded("llama"), snapshot_dir=str(tmp_path), speculative=None, kv_budget_bytes=16 << 20)
    llm.persistence.close_timeout_s = 1.0  # the checkpointed session's own saves never succeed
    store = llm.persistence.store
    save = store.save

    def own_saves_fail(manifest, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if manifest.snapshot_id == session_snapshot_id(session.id):
            raise UnavailableError("this session's snapshot cannot be written")
        return save(manifest, *args, **kwargs)

    monkeypatch.setattr(store, "save", own_saves_fail)
    session = llm.create_session(prompt(40))
    turn(session)
    other = llm.create_session(prompt(20, seed=2))
    held = Gate()
    monkeypatch.setattr(store, "missing", held.wrap(store.missing, on_thread("checkpoint")))
    closed = threading.Event()
    close_store = store.close
    monkeypatch.setattr(store, "close", lambda: (closed.set(), close_store()))
    checkpoint = Call(session.snapshot, name="checkpoint")
    assert held.entered.wait(WAIT_S)
    other.append(prompt(3, seed=1))  # a change queued for the background saver
    history = other.tokens
    closing = Call(llm.close)
    assert wait_for(lambda: closed.is_set() or getattr(llm.sessions, "closing", False))
    held.open()
    snapshot_id = checkpoint.result()
    closing.result()
    after = open_store(tmp_path)
    assert after.get_manifest(snapshot_id) is not None and not after.missing(after.get_manifest(snapshot_id).digests())
    assert list(after.get_manifest(session_snapshot_id(other.id)).token_ids) == history


def test_a_blob_lost_behind_the_savers_back_is_written_again(tiny_llm, tmp_path):
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path), speculative=None)
    session = llm.create_session(prompt(100))
    turn(session)
    assert llm.persistence.flush(WAIT_S)
    manifest = llm.persistence.store.get_manifest(session_snapshot_id(session.id))
    lost = manifest.groups[0].pages[0]  # a full page: later saves name it by digest only
    blob_place(tmp_path, lost)[0].unlink()  # its pack: every page the first save wrote
    session.append(prompt(3, seed=1))
    turn(session)
    assert llm.persistence.flush(WAIT_S)
    manifest = llm.persistence.store.get_manifest(session_snapshot_id(session.id))
    assert list(manifest.token_ids) == session.tokens
    assert not llm.persistence.store.missing(manifest.digests())
    llm.close()
    back = tiny_llm("llama", snapshot_dir=str(tmp_path), speculative=None).get_session(session.id)
    assert back.tokens == list(manifest.token_ids) and back.info().computed_tokens == len(back.tokens) - 1


def test_close_during_a_store_outage_changes_nothing(tiny_llm, tmp_path, monkeypatch):
    """Either closed and its snapshot deleted, or not closed and a typed error: a retry then works."""
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path), speculative=None)
    session = llm.create_session(prompt(30))
    turn(session)
    assert llm.persistence.flush(WAIT_S)
    history = session.tokens
    store = llm.persistence.store

    def down(*args: object, **kwargs: object) -> bool:
        raise UnavailableError("the store is down")

    monkeypatch.setattr(store, "delete_manifest", down)
    with pytest.raises(UnavailableError, match="not closed"):
        session.close()
    assert session.tokens == history and turn(session)
    monkeypatch.undo()
    session.close()
    assert saved_history(llm, session.id) is None
    with pytest.raises(NotFoundError, match="closed"):
        session.info()


def test_an_invariant_failed_session_keeps_its_history(tiny_llm, tmp_path):
    """A bookkeeping bug fails the session, but its token history is saved (without K/V): after a restart
    or its eviction it comes back whole and healthy, its K/V recomputed."""
    options = {"snapshot_dir": str(tmp_path), "speculative": None, "page_size": 4}
    llm = tiny_llm("llama", **options)
    session = llm.create_session(prompt(20))
    turn(session)
    history = session.tokens
    llm.sessions._sessions[session.id].seq.table.hashes[-1] = b"corrupted-hash!!"
    with pytest.raises(InvariantViolation):
        session.append([5])
    assert llm.persistence.flush(WAIT_S)
    llm.close()
    again = tiny_llm("llama", **options)
    back = again.get_session(session.id)
    assert back.tokens == [*history, 5] and back.info().computed_tokens == 0
    assert turn(back) == turn(again.create_session([*history, 5]))


@pytest.mark.parametrize("durable", [False, True])
def test_a_bug_queueing_a_turns_save_still_ends_the_turn(tiny_llm, tmp_path, monkeypatch, durable):
    """The turn's finish is the caller's only signal: a bug in capturing the session at the turn's end is
    logged and the finish still arrives (an error under durable_turns, whose promise is then unmet)."""
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path), speculative=None, durable_turns=durable)
    session = llm.create_session(prompt(20))

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("a bug in capturing")

    monkeypatch.setattr(llm.engine, "capture_sequence", broken)
    ended = outcome_within(lambda: session.generate(**GREEDY).result(), WAIT_S, "the finish event was lost")
    if durable:
        assert isinstance(ended, UnavailableError) and "save failed" in str(ended)
    else:
        assert ended.finish_reason == "length" and len(ended.token_ids) == GREEDY["max_tokens"]
    assert len(session.tokens) == 20 + GREEDY["max_tokens"]  # the turn is in the history either way
    monkeypatch.undo()
    assert len(turn(session)) == GREEDY["max_tokens"]  # the session is free for its next turn

