"""The snapshot store stops taking writes under a running server: Redis killed and started again, a
directory remounted read-only, a filesystem filled up. Throughout, the agents' turns go on (the server
keeps serving), failed saves are counted under their typed code (no untyped error, no traceback), and once
the store takes writes again every session's snapshot catches up with its whole history; a kill -9 then
loses nothing."""

from __future__ import annotations

import random
from collections.abc import Callable

from kiln.client import Client
from tests.fault.ledger import Ledger, Workload, eventually, new_ledgers, turn
from tests.fault.mounts import bind_mount, fill, read_only, tmpfs
from tests.fault.node import Node
from tests.fault.redis_server import DurableRedis
from tests.fault.verify import Reference, check_restored, stored_histories

AGENTS = 3
EVICTED_TTL_S = 1.0  # the shortest idle TTL a session may ask for
FAILURES = 'kiln_snapshot_save_failures_total{{code="{}"}}'


def survive_outage(node: Node, reference: Reference, code: str, fail: Callable[[], None], heal: Callable[[], None]) -> None:
    """Agents work through the store's outage (`fail()` ... `heal()`) while one more session, with a short
    TTL, finishes a turn during the outage and is then evicted: its save fails twice (after the turn, at
    the eviction) and it exists nowhere but in what the server kept of it. The checks in the module
    docstring, for that session too."""
    failures = FAILURES.format(code)
    rng = random.Random(7)
    node.start()
    try:
        with Client(node.address) as client:
            ledgers = new_ledgers(client, AGENTS, rng)
            evicted = new_ledgers(client, 1, rng, ttl_s=EVICTED_TTL_S)[0]
            turn(client.get_session(evicted.session_id), evicted, rng)
            workload = Workload(client, ledgers, seed=7).start()
            workload.wait_turns(2 * AGENTS)
            before = node.metric(failures)
            fail()
            broken = workload.finished_turns()
            turn(client.get_session(evicted.session_id), evicted, rng)
            eventually(lambda: node.metric(failures) > before, 30, f"a failed save counted as {code}")
            eventually(lambda: evicted.session_id not in {s.session_id for s in client.list_sessions() if s.resident}, 30,
                       "the short-TTL session evicted")  # listing expires idle sessions (then lists it, not resident)
            # The saver takes one job per session in order: once more saves have failed since the eviction
            # than there were sessions ahead of its capture, the capture's own save was tried (and failed).
            at_eviction = node.metric(failures)
            eventually(lambda: node.metric(failures) >= at_eviction + AGENTS + 2, 30, "the evicted session's save tried")
            workload.wait_turns(broken + 3 * AGENTS)  # turns go on while no save can succeed
            heal()
            workload.wait_turns(workload.finished_turns() + 2 * AGENTS)
            workload.stop()
        ledgers.append(evicted)
        assert "Traceback" not in node.log(), node.log()
        eventually(lambda: not unsaved(node, ledgers), 60, lambda: f"every session saved: {unsaved(node, ledgers)}")
        node.kill()
        node.start()
        with Client(node.address) as client:
            outcome = check_restored(client, ledgers, reference, node.store[1], Ledger.acknowledged)
        assert not outcome.failures, "\n".join(outcome.failures)
        assert outcome.lost_turns == 0 and outcome.acknowledged_turns >= 7 * AGENTS
    finally:
        node.discard()


def unsaved(node: Node, ledgers: list[Ledger]) -> dict[str, str]:
    """Session id -> "stored/known tokens" for each session whose snapshot lacks part of its history."""
    stored = stored_histories(node.store[1], ledgers)
    return {ledger.session_id: f"{len(stored[ledger.session_id])}/{len(ledger.tokens())}"
            for ledger in ledgers if stored[ledger.session_id] != ledger.tokens()}


def test_redis_killed_and_restarted_mid_save(model, reference, tmp_path):
    redis = DurableRedis(tmp_path)
    try:
        node = Node(model, ("--snapshot-store", redis.url))
        survive_outage(node, reference, "UNAVAILABLE", redis.stop, redis.start)
    finally:
        redis.stop()


def test_read_only_snapshot_directory(model, reference, tmp_path):
    with bind_mount(tmp_path / "disk", tmp_path / "store") as store:
        node = Node(model, ("--snapshot-dir", str(store)))
        survive_outage(node, reference, "UNAVAILABLE", lambda: read_only(store, True), lambda: read_only(store, False))


def test_full_snapshot_directory(model, reference, tmp_path):
    with tmpfs(tmp_path / "store", size_mb=32) as store:
        fillers = []
        node = Node(model, ("--snapshot-dir", str(store)))
        survive_outage(node, reference, "RESOURCE_EXHAUSTED", lambda: fillers.append(fill(store)),
                       lambda: fillers.pop().unlink())
