"""One owner per live session across engines sharing a store (kiln/snapshots/ownership.py), on a directory
and on a real Redis: a second engine is refused while the first holds the session, gets it whole after
the first hands it off (close, eviction), or takes it over once a dead owner's lease lapses; a restart
under the same instance id takes its sessions back at once; a stale owner can no longer write."""

from __future__ import annotations

import time

import pytest
import torch

from kiln.errors import FailedPreconditionError, InvalidArgumentError
from kiln.snapshots import ownership
from kiln.snapshots.manifest import session_snapshot_id
from kiln.snapshots.store import open_store
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


def test_the_renewer_renews_in_batches_the_soonest_to_lapse_first(store_target, monkeypatch):
    """Thousands of sessions: one store call per lease fell behind the TTL under load (the dashboard's
    2,000-session benchmark lost ~2 % of its sessions); a round now takes a few batched calls."""
    store = open_store(store_target)
    owner = ownership.Ownership(store, "batch-test", ttl_s=ownership.LEASE_TTL_S)
    owner.close()  # the test drives the rounds itself
    monkeypatch.setattr(ownership, "RENEW_BATCH", 4)
    for i in range(10):
        owner.acquire(f"s{i}")
    owner.mark_lost("s3")
    time.sleep(0.01)
    owner.acquire("s0")  # taken again: renewed, so now the last to lapse
    before = {name: owner.fence(name) for name in owner.held()}
    store.renew_leases([before["s5"]], 0.5)  # s5 lapses in the store behind the owner's back
    batches: list[list[str]] = []
    renew_leases = store.renew_leases
    monkeypatch.setattr(store, "renew_leases", lambda leases, ttl_s: batches.append([lease.name for lease in leases])
                        or renew_leases(leases, ttl_s))
    deadline = time.time() + WAIT_S
    while store.lease_of("s5") is not None:
        assert time.time() < deadline
        time.sleep(0.05)
    owner.renew_all()
    assert [len(batch) for batch in batches] == [4, 4, 1]
    assert [name for batch in batches for name in batch] == ["s1", "s2", "s4", "s5", "s6", "s7", "s8", "s9", "s0"]
    assert owner.lost("s5") and owner.fence("s5") is None
    for name in set(before) - {"s5"}:
        assert owner.fence(name).expires_at > before[name].expires_at and store.lease_of(name).same_grant(before[name])
    store.close()
