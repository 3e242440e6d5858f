"""kill -9 against a real `kiln serve` while its agents work: during generates, right after a turn's finish
(the save it starts), while `kiln snapshot gc` runs beside it (sometimes killed too), and during the lazy
restores of the next incarnation. After each crash the node restarts on the same store and every session
is checked against what its client saw (tests/fault/verify.py).

With `--durable-turns` a finish is sent only after its save, so no acknowledged turn may be lost. In the
default mode the saver runs behind the turns and a crash loses at most its backlog (the durability rule
in kiln/snapshots/persistence.py): every turn finished before the backlog the server reported just before
the kill must survive.

`make test` runs 13 trials over the three tests; KILN_FAULT_TRIALS=N (`make fault`) runs N in each."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from kiln.client import Client
from tests.fault.conftest import trials
from tests.fault.ledger import Ledger, Workload, new_ledgers
from tests.fault.node import Node
from tests.fault.redis_server import DurableRedis
from tests.fault.verify import Outcome, Reference, check_restored, check_stored, stored_histories

AGENTS = 4
KINDS = ("generate", "save", "gc", "restore")
BACKLOG_METRIC = "kiln_snapshot_backlog_seconds"  # age of the oldest change the saver has not written


@dataclass
class GcLoop:
    """`kiln snapshot gc` over and over on the node's store, in a thread, until stopped."""

    store: tuple[str, ...]
    halt: threading.Event = field(default_factory=threading.Event)
    current: subprocess.Popen | None = None
    failures: list[str] = field(default_factory=list)
    thread: threading.Thread | None = None

    def start(self) -> GcLoop:
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.halt.is_set():
            self.current = gc_process(self.store)
            _, err = self.current.communicate()
            if self.current.returncode not in (0, -signal.SIGKILL):
                self.failures.append(err)

    def kill_current(self) -> None:
        """SIGKILL the gc running now (if one is): a gc killed half way must not harm the store."""
        process = self.current
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)

    def stop(self) -> None:
        """After the gc running now (if any) ends."""
        self.halt.set()
        assert self.thread is not None
        self.thread.join(timeout=120)
        assert not self.thread.is_alive(), "a gc did not end"


def gc_process(store: tuple[str, ...]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kiln.cli", "snapshot", *store, "gc"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


class Durable:
    """--durable-turns: a finish is sent only once its turn is saved, so every acknowledged turn survives."""

    flags = ("--durable-turns",)

    def mark(self, node: Node) -> None:
        """Nothing to note before a kill."""

    def required(self, ledger: Ledger) -> int:
        return ledger.acknowledged()


@dataclass
class Backlog:
    """The default mode: a crash loses at most the changes still in the saver's backlog, whose age the
    server exports (BACKLOG_METRIC). Read just before each kill: at the moment of the read, every change
    older than the backlog was saved, so every turn finished before (read time - backlog) must survive."""

    flags = ()
    saved_before: float = 0.0  # time.monotonic() before which every finished turn was saved
    backlogs: list[float] = field(default_factory=list)

    def mark(self, node: Node) -> None:
        sent = time.monotonic()
        backlog = node.metric(BACKLOG_METRIC)
        self.saved_before = sent - backlog
        self.backlogs.append(backlog)

    def required(self, ledger: Ledger) -> int:
        return ledger.acknowledged(before=self.saved_before)


Rule = Durable | Backlog


def crash(kind: str, node: Node, rule: Rule, ledgers: list[Ledger], rng: random.Random, seed: int) -> list[BaseException]:
    """Run the agents on the node and SIGKILL it at a point chosen by `kind`; returns the calls that
    failed before the kill (there must be none)."""
    finished = threading.Event()
    target = rng.randint(1, 3 * AGENTS)
    count = iter(range(1, 10**9))

    def on_finish(_: Ledger) -> None:
        if next(count) >= target:
            finished.set()

    gc = GcLoop(node.store).start() if kind == "gc" else None
    with Client(node.address) as client:
        workload = Workload(client, ledgers, seed, on_finish).start()
        if kind == "save":  # just after a finish: the save it starts is in flight
            assert finished.wait(60), "no turn finished"
            time.sleep(rng.uniform(0.0, 0.01))
        else:
            time.sleep(rng.uniform(0.3, 2.0))
        rule.mark(node)
        node.kill()
        if gc is not None and rng.random() < 0.5:
            gc.kill_current()
        workload.join()
    if gc is not None:
        gc.stop()
        assert not gc.failures, gc.failures
        done = gc_process(node.store)  # a whole gc over what the crash left: it must keep every live blob
        assert done.wait(120) == 0, done.stderr.read() if done.stderr else ""
    return workload.errors_before(node.killed_at)


def resume_and_crash(node: Node, rule: Rule, ledgers: list[Ledger], rng: random.Random, seed: int) -> list[BaseException]:
    """The agents come back to their sessions on the new incarnation (each first call restores its
    session lazily) and the node is killed again soon after."""
    with Client(node.address) as client:
        workload = Workload(client, ledgers, seed).start()
        time.sleep(rng.uniform(0.02, 0.5))
        rule.mark(node)
        node.kill()
        workload.join()
    return workload.errors_before(node.killed_at)


def restore_trial(node: Node, rule: Rule, reference: Reference, ledgers: list[Ledger], rng: random.Random,
                  seed: int, total: Outcome) -> tuple[list[Ledger], list[BaseException]]:
    """After the first crash: check the store (without touching the sessions, so that the next
    incarnation restores them lazily), resume the agents from the stored histories and crash again.
    Returns the ledgers of the resumed sessions and the calls that failed early."""
    stored = stored_histories(node.store[1], ledgers)
    first = check_stored(ledgers, reference, stored, rule.required)
    assert not first.failures, "\n".join(first.failures)
    total.add(first)
    resumed = [Ledger(ledger.session_id, stored[ledger.session_id], resumed=True)
               for ledger in ledgers if stored[ledger.session_id]]
    return resumed, resume_and_crash(node, rule, resumed, rng, seed)


def run_trials(node: Node, rule: Rule, reference: Reference, count: int, seed: int) -> Outcome:
    """`count` crash trials on one node, cycling through KINDS, each checked against `rule`."""
    rng = random.Random(seed)
    total = Outcome()
    node.start()
    try:
        for trial in range(count):
            kind = KINDS[trial % len(KINDS)]
            with Client(node.address) as client:
                ledgers = new_ledgers(client, AGENTS, rng)
            early = crash(kind, node, rule, ledgers, rng, seed * 100 + trial)
            node.start()
            if kind == "restore":
                ledgers, resumed_early = restore_trial(node, rule, reference, ledgers, rng, seed * 100 + 50 + trial, total)
                early += resumed_early
                node.start()
            assert not early, f"trial {trial} ({kind}): calls failed while the server was up: {early}"
            with Client(node.address) as client:
                outcome = check_restored(client, ledgers, reference, node.store[1], rule.required)
            assert not outcome.failures, f"trial {trial} ({kind}):\n" + "\n".join(outcome.failures) + node.log()
            total.add(outcome)
    finally:
        node.discard()
    assert total.acknowledged_turns > count * AGENTS  # the agents got turns done before most kills
    print(f"{count} kill trials: {total.summary()}")
    return total


def test_durable_turns_survive_kill_9_on_a_directory(model, reference, tmp_path):
    rule = Durable()
    node = Node(model, ("--snapshot-dir", str(tmp_path / "store")), rule.flags)
    outcome = run_trials(node, rule, reference, trials(6), seed=1)
    assert outcome.lost_turns == 0


def test_durable_turns_survive_kill_9_on_redis(model, reference, tmp_path):
    server = DurableRedis(tmp_path)
    rule = Durable()
    try:
        node = Node(model, ("--snapshot-store", server.url), rule.flags)
        outcome = run_trials(node, rule, reference, trials(3), seed=2)
    finally:
        server.stop()
    assert outcome.lost_turns == 0


def test_default_mode_keeps_every_turn_older_than_the_backlog(model, reference, tmp_path):
    rule = Backlog()
    node = Node(model, ("--snapshot-dir", str(tmp_path / "store")), rule.flags)
    outcome = run_trials(node, rule, reference, trials(4), seed=3)
    assert outcome.required_turns > 0
