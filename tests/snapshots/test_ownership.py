"""One owner per live session across engines sharing a store (kiln/snapshots/ownership.py), on a directory
and on a real Redis: a second engine is refused while the first holds the session, gets it whole after
the first hands it off (close, eviction), or takes it over once a dead owner's lease lapses; a restart
under the same instance id takes its sessions back at once; a stale owner can no longer write."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import FailedPreconditionError, InvalidArgumentError
from kiln.snapshots import ownership
from kiln.snapshots.manifest import session_snapshot_id
from tests.snapshots.hooks import WAIT_S, wait_for

GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def turn(session) -> list[int]:  # noqa: ANN001
    return session.generate(**GREEDY).result().token_ids


@pytest.fixture
def engine(tiny_llm, store_target):  # noqa: ANN001, ANN201
    """engine(**options): a tiny LLM persisting to this test's store (a directory or Redis)."""
    return lambda **options: tiny_llm("llama", snapshot_store=store_target, speculative=None, **options)


def live_elsewhere(llm, session_id: str) -> bool:  # noqa: ANN001
    try:
        llm.get_session(session_id)
    except FailedPreconditionError as refused:
        assert "live on another server" in str(refused)
        return True
    return False


def test_a_live_session_is_refused_elsewhere_until_it_is_handed_off(engine):
    one, two = engine(), engine()
    session = one.create_session(prompt(40))
    turn(session)
    history = session.tokens
    assert live_elsewhere(two, session.id)
    one.close()  # saves, then hands every session off
    moved = two.get_session(session.id)
    assert moved.tokens == history and moved.info().computed_tokens == len(history) - 1
    assert turn(moved)


def test_an_evicted_session_is_handed_off_after_its_last_save(engine):
    one, two = engine(max_sessions=1), engine()
    session = one.create_session(prompt(40))
    turn(session)
    history = session.tokens
    one.create_session(prompt(10, seed=1))  # evicts `session`: saved, then released
    assert one.persistence.flush(WAIT_S)
    assert two.get_session(session.id).tokens == history
    assert live_elsewhere(one, session.id)  # now the other engine's


def test_a_dead_owners_sessions_are_taken_over_after_its_lease_lapses(engine, monkeypatch):
    monkeypatch.setattr(ownership, "LEASE_TTL_S", 3.0)
    one, two = engine(), engine()
    session = one.create_session(prompt(40))
    turn(session)
    history = session.tokens
    assert one.persistence.flush(WAIT_S)
    one.persistence.ownership.close()  # dies: its leases are no longer renewed (nor released)
    assert live_elsewhere(two, session.id)
    assert wait_for(lambda: not live_elsewhere(two, session.id), WAIT_S)
    taken = two.get_session(session.id)
    assert taken.tokens == history
    turn(taken)
    assert two.persistence.flush(WAIT_S)
    saved = list(two.persistence.store.get_manifest(session_snapshot_id(session.id)).token_ids)

    session.append([7, 8, 9])  # the stale owner still has it in memory: its save is refused by the fence
    assert one.persistence.flush(WAIT_S)
    assert one.persistence.stats.save_failures["FAILED_PRECONDITION"] >= 1
    assert list(two.persistence.store.get_manifest(session_snapshot_id(session.id)).token_ids) == saved
    with pytest.raises(FailedPreconditionError, match="moved to another server"):
        session.info()


def test_a_restart_under_the_same_instance_id_takes_its_sessions_back_at_once(engine):
    first = engine(instance_id="node-a")
    session = first.create_session(prompt(40))
    turn(session)
    history = session.tokens
    assert first.persistence.flush(WAIT_S)
    first.persistence.ownership.close()  # killed: its leases stay live for a whole TTL
    assert live_elsewhere(engine(instance_id="node-b"), session.id)
    restarted = engine(instance_id="node-a")
    assert restarted.get_session(session.id).tokens == history  # no waiting out the TTL
    assert live_elsewhere(engine(instance_id="node-b"), session.id)


def test_instance_ids_are_checked(engine):
    with pytest.raises(InvalidArgumentError, match="instance_id"):
        engine(instance_id="two words")
