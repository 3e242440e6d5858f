"""Lock discipline between sessions and persistence (docs/architecture.md § Locks): nothing waits on the
saver while holding the store lock, and one session's slow operation (a revive's fetch, a close's delete,
a grammar compile, an eviction's page copy) never delays calls on another session. Each interleaving is
forced with a gate (tests/snapshots/hooks.py); a call that stays blocked fails after WAIT_S."""

from __future__ import annotations

import torch

from kiln.engine.constraints import ConstraintCompiler
from kiln.llm import LLM
from kiln.snapshots.manifest import session_snapshot_id
from kiln.snapshots.persistence import Persistence
from tests.snapshots.hooks import WAIT_S, Call, Gate, on_thread

GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def turn(session) -> list[int]:  # noqa: ANN001
    return session.generate(**GREEDY).result().token_ids


def another_session_is_served(session) -> None:  # noqa: ANN001
    """Calls on a session other than the held one all complete."""
    def calls() -> int:
        session.append([5, 6])
        turn(session)
        return session.info().history_tokens

    Call(calls).result()


def served_while_held(gate: Gate, held: Call, other) -> object:  # noqa: ANN001
    """While `held` waits at the gate, calls on `other` complete; then the gate opens and `held` ends."""
    try:
        assert gate.entered.wait(WAIT_S)
        another_session_is_served(other)
        assert not held.done
    finally:
        gate.open()
    return held.result()


def test_reviving_a_session_whose_save_is_in_flight_does_not_deadlock(tiny_loaded, tmp_path, monkeypatch):
    """The interleaving that froze a server: a save of S is in flight (held), S is evicted, a call revives
    S. Reviving must not wait for the saver under the store lock, and the saver must not need that lock:
    the revive, the saver and every other session's calls all complete."""
    llm = LLM(loaded=tiny_loaded("llama"), snapshot_dir=str(tmp_path), max_sessions=2, speculative=None,
              kv_budget_bytes=16 << 20)  # not the fixture: after a deadlock its close would hang too
    held = Gate()
    saver = on_thread("kiln-snapshots")
    monkeypatch.setattr(Persistence, "known", held.wrap(Persistence.known, saver))
    monkeypatch.setattr(llm.persistence.store, "missing", held.wrap(llm.persistence.store.missing, saver))
    loads = Gate()
    monkeypatch.setattr(Persistence, "load", loads.wrap(Persistence.load))
    loads.open()  # only announces calls
    try:
        session = llm.create_session(prompt(40))
        turn(session)
        history = session.tokens
        assert held.entered.wait(WAIT_S)  # a save of the session is in flight, held
        llm.create_session(prompt(20, seed=1))
        other = llm.create_session(prompt(20, seed=2))  # evicts `session`, the least recently used
        revive = Call(llm.get_session, session.id)
        assert loads.entered.wait(WAIT_S)
        held.open()
        assert revive.result().tokens == history
        another_session_is_served(other)
        assert llm.persistence.flush(WAIT_S)
    finally:
        held.open()
    llm.close()


def _llm(tiny_llm, tmp_path):  # noqa: ANN001, ANN202
    return tiny_llm("llama", snapshot_dir=str(tmp_path), speculative=None)


def test_a_revive_in_progress_does_not_delay_other_sessions(tiny_llm, tmp_path, monkeypatch):
    first = _llm(tiny_llm, tmp_path)
    evicted = first.create_session(prompt(60))
    turn(evicted)
    history = evicted.tokens
    first.close()
    llm = _llm(tiny_llm, tmp_path)  # after a restart: the session is only in the store
    other = llm.create_session(prompt(20, seed=1))
    fetch = Gate()
    store = llm.persistence.store
    monkeypatch.setattr(store, "get_manifest", fetch.wrap(store.get_manifest, lambda sid: sid == session_snapshot_id(evicted.id)))
    revive = Call(llm.get_session, evicted.id)
    assert served_while_held(fetch, revive, other).tokens == history
    assert llm.persistence.stats.restores["session"] == 1  # revived once, by the one caller


def test_two_callers_of_one_evicted_session_revive_it_once(tiny_llm, tmp_path, monkeypatch):
    first = _llm(tiny_llm, tmp_path)
    session = first.create_session(prompt(30))
    first.close()
    llm = _llm(tiny_llm, tmp_path)
    fetch = Gate()
    store = llm.persistence.store
    monkeypatch.setattr(store, "get_manifest", fetch.wrap(store.get_manifest))
    callers = [Call(llm.get_session, session.id) for _ in range(2)]
    assert fetch.entered.wait(WAIT_S)
    fetch.open()
    assert [c.result().tokens for c in callers] == [prompt(30)] * 2
    assert llm.persistence.stats.restores["session"] == 1 and len(llm.sessions) == 1


def test_a_close_in_progress_does_not_delay_other_sessions(tiny_llm, tmp_path, monkeypatch):
    llm = _llm(tiny_llm, tmp_path)
    closing, other = llm.create_session(prompt(30)), llm.create_session(prompt(30, seed=1))
    assert llm.persistence.flush(WAIT_S)
    delete = Gate()
    store = llm.persistence.store
    monkeypatch.setattr(store, "delete_manifest", delete.wrap(store.delete_manifest))
    served_while_held(delete, Call(closing.close), other)
    assert store.get_manifest(session_snapshot_id(closing.id)) is None


def test_a_grammar_compile_does_not_delay_other_sessions(tiny_llm, tmp_path, monkeypatch):
    llm = _llm(tiny_llm, tmp_path)
    constrained, other = llm.create_session(prompt(30)), llm.create_session(prompt(30, seed=1))
    compile_ = Gate()
    monkeypatch.setattr(ConstraintCompiler, "compile", compile_.wrap(ConstraintCompiler.compile))
    pattern = "(ab|cd)+ held-compile"  # not in the process-wide compile cache yet
    generate = Call(lambda: constrained.generate(max_tokens=8, temperature=0.0, regex=pattern).result())
    assert served_while_held(compile_, generate, other).finish_reason in ("stop", "length")


def test_an_eviction_copy_does_not_delay_other_sessions(tiny_llm, tmp_path, monkeypatch):
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path), speculative=None, max_sessions=2)
    evicted = llm.create_session(prompt(200))
    turn(evicted)
    other = llm.create_session(prompt(30, seed=1))  # more recently used: `evicted` goes first
    assert llm.persistence.flush(WAIT_S)
    copy = Gate()
    seq = llm.sessions._sessions[evicted.id].seq
    capture = llm.engine.capture_sequence
    monkeypatch.setattr(llm.engine, "capture_sequence", copy.wrap(capture, lambda s, known: s is seq))
    create = Call(llm.create_session, prompt(10, seed=2))  # evicts `evicted`: its pages are copied out
    served_while_held(copy, create, other)
    assert llm.get_session(evicted.id).tokens == evicted.tokens  # back from its queued capture


def test_nothing_under_the_store_lock_waits_for_the_saver(tiny_llm, tmp_path, monkeypatch):
    """While the saver is held inside a save, every session call still completes (none waits for it)."""
    llm = _llm(tiny_llm, tmp_path)
    session = llm.create_session(prompt(30))
    assert llm.persistence.flush(WAIT_S)
    save = Gate()
    store = llm.persistence.store
    monkeypatch.setattr(store, "save", save.wrap(store.save, on_thread("kiln-snapshots")))
    try:
        turn(session)
        assert save.entered.wait(WAIT_S)
        another_session_is_served(session)
        fork = Call(session.fork).result()
        assert Call(llm.get_session, fork.id).result().tokens == session.tokens
    finally:
        save.open()
    assert llm.persistence.flush(WAIT_S)
