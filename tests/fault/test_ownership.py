"""Two servers on one Redis asked for the same session at the same moment: exactly one serves it; the
other answers FAILED_PRECONDITION (the session is live on another server), and keeps answering so while
the first holds it. The store ends up with the winner's turn only: no last-write-wins mix of the two."""

from __future__ import annotations

import random
import threading
from dataclasses import replace

from kiln.client import Client, FailedPreconditionError
from kiln.errors import KilnError
from tests.fault.ledger import Ledger, new_ledgers, turn
from tests.fault.node import Node
from tests.fault.redis_server import DurableRedis
from tests.fault.verify import stored_histories

SESSIONS = 4


def race(nodes: list[Node], ledger: Ledger, seed: int) -> list[Ledger | KilnError]:
    """Each node gets the session and takes a turn on it, both starting at once; per node, the ledger of
    its turn or the error it answered."""
    start = threading.Barrier(len(nodes))
    results: list[Ledger | KilnError] = [KilnError("no answer")] * len(nodes)

    def ask(k: int) -> None:
        mine = replace(ledger, turns=list(ledger.turns), errors=[], lock=threading.Lock())
        with Client(nodes[k].address) as client:
            start.wait()
            try:
                turn(client.get_session(ledger.session_id), mine, random.Random(seed * 10 + k))
                results[k] = mine
            except KilnError as error:
                results[k] = error

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(len(nodes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_one_session_is_served_by_one_server_at_a_time(model, tmp_path):
    redis = DurableRedis(tmp_path)
    store = ("--snapshot-store", redis.url)
    nodes = [Node(model, store), Node(model, store)]
    maker = Node(model, store).start()
    rng = random.Random(5)
    try:
        with Client(maker.address) as client:
            ledgers = new_ledgers(client, SESSIONS, rng)
            for ledger in ledgers:
                turn(client.get_session(ledger.session_id), ledger, rng)
        assert maker.stop() == 0  # saved and handed off: the sessions live only in the store now
        for node in nodes:
            node.start()
        winners = []
        for k, ledger in enumerate(ledgers):
            results = race(nodes, ledger, k)
            served = [n for n, result in enumerate(results) if isinstance(result, Ledger)]
            assert len(served) == 1, f"session {ledger.session_id}: {len(served)} servers served it at once"
            refused = results[1 - served[0]]
            assert isinstance(refused, FailedPreconditionError), refused
            with Client(nodes[1 - served[0]].address) as client:  # and again, while the winner holds it
                try:
                    client.get_session(ledger.session_id).append([3])
                    raise AssertionError(f"session {ledger.session_id} taken by a second server while live")
                except FailedPreconditionError:
                    pass
            winners.append(results[served[0]])
        for node in nodes:
            assert node.stop() == 0
        stored = stored_histories(redis.url, winners)
        for winner in winners:
            assert stored[winner.session_id] == winner.tokens(), f"session {winner.session_id} is not the winner's"
    finally:
        for node in (maker, *nodes):
            node.discard()
        redis.stop()
