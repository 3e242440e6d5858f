"""The workload that found the lost turns, and what its clients saw.

N agents, each on its own session, loop: append 3 token ids -> greedy generate 4 -> read the history length
back. Every agent writes down what it sent and what it received in a Ledger as it goes, so that after a
kill -9 the test knows exactly which turns the server acknowledged (the client got their finish), when,
and which tokens they hold."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from kiln.client import Client, Session
from kiln.errors import KilnError
from tests.fault.node import CONTEXT, VOCAB

APPEND = 3
GENERATE = 4
GREEDY = {"max_tokens": GENERATE, "temperature": 0.0, "ignore_eos": True}
PROMPT_TOKENS = 20
# An agent stops short of the model's context, leaving room for the turn the checks add after a restart.
MAX_HISTORY = CONTEXT - 2 * (APPEND + GENERATE)


@dataclass
class Turn:
    """One append -> generate turn. `finished_at` (time.monotonic()) is set once the client holds the
    generation's finish: from then on the server has acknowledged the turn."""

    appended: list[int]
    generated: list[int] = field(default_factory=list)
    generate_sent: bool = False
    finished_at: float | None = None


@dataclass
class Ledger:
    """Everything one agent's client sent to and received from its session, in order."""

    session_id: str
    prompt: list[int]
    resumed: bool = False  # the prompt is a history the server restored (acknowledged), not a new session's
    turns: list[Turn] = field(default_factory=list)
    errors: list[tuple[float, BaseException]] = field(default_factory=list)  # (monotonic time, error)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def tokens(self) -> list[int]:
        """The history as this client knows it: every token sent (acknowledged or not) and received."""
        with self.lock:
            return self.prompt + [t for turn in self.turns for t in turn.appended + turn.generated]

    def acknowledged(self, before: float = float("inf")) -> int:
        """History length at the last finish the client received before `before` (monotonic). Without
        one: a resumed session's restored history, a new session's nothing (it need not be saved before
        its first turn ends)."""
        return max((end for end, _ in self.finished_turns(before)), default=len(self.prompt) if self.resumed else 0)

    def finished_turns(self, before: float = float("inf")) -> list[tuple[int, Turn]]:
        """(history length at its end, turn) of each turn finished before `before` (monotonic)."""
        with self.lock:
            length, found = len(self.prompt), []
            for turn in self.turns:
                length += len(turn.appended) + len(turn.generated)
                if turn.finished_at is not None and turn.finished_at < before:
                    found.append((length, turn))
            return found

    def generate_starts(self) -> Iterator[tuple[int, Turn]]:
        """(history length when the turn's generate was sent, the turn) for every turn that sent one."""
        with self.lock:
            length = len(self.prompt)
            for turn in self.turns:
                length += len(turn.appended)
                if turn.generate_sent:
                    yield length, turn
                length += len(turn.generated)


def new_ledgers(client: Client, count: int, rng: random.Random, ttl_s: float | None = None) -> list[Ledger]:
    ledgers = []
    for _ in range(count):
        prompt = [rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS)]
        ledgers.append(Ledger(client.create_session(prompt, ttl_s).id, prompt))
    return ledgers


def turn(session: Session, ledger: Ledger, rng: random.Random) -> None:
    """One turn, written down as it goes; then the history length read back must be the client's."""
    current = Turn([rng.randrange(3, VOCAB) for _ in range(APPEND)])
    with ledger.lock:
        ledger.turns.append(current)
    session.append(current.appended)
    current.generate_sent = True
    generation = session.generate(**GREEDY)
    for token in generation:
        with ledger.lock:
            current.generated.append(token)
    generation.result()
    current.finished_at = time.monotonic()
    history = session.info().history_tokens
    if history != len(ledger.tokens()):
        raise AssertionError(f"session {ledger.session_id} reads back {history} tokens, "
                             f"the client holds {len(ledger.tokens())}")


def agent(client: Client, ledger: Ledger, rng: random.Random, stop: threading.Event,
          on_finish: Callable[[Ledger], None] = lambda ledger: None) -> None:
    """Loop turns on the ledger's session until `stop` is set or a call fails (the server was killed);
    the failure is recorded with its time, for the test to tell expected failures from early ones."""
    try:
        session = client.get_session(ledger.session_id)
        while not stop.is_set() and len(ledger.tokens()) <= MAX_HISTORY - APPEND - GENERATE:
            turn(session, ledger, rng)
            on_finish(ledger)
    except (KilnError, grpc.RpcError, AssertionError) as error:
        ledger.errors.append((time.monotonic(), error))


@dataclass
class Workload:
    """Agents running on a node's sessions, each in its own thread, until `stop()` or the server dies."""

    client: Client
    ledgers: list[Ledger]
    seed: int
    on_finish: Callable[[Ledger], None] = lambda ledger: None
    halt: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    started_at: float = 0.0

    def start(self) -> Workload:
        self.started_at = time.monotonic()
        for k, ledger in enumerate(self.ledgers):
            rng = random.Random(self.seed * 1000 + k)
            thread = threading.Thread(target=agent, args=(self.client, ledger, rng, self.halt, self.on_finish), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def join(self, timeout: float = 60.0) -> None:
        """Wait for every agent to end (after a stop or a kill); an agent still running is a hung call."""
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        hung = [ledger.session_id for ledger, thread in zip(self.ledgers, self.threads, strict=True) if thread.is_alive()]
        assert not hung, f"agents of sessions {hung} still wait on the server"

    def stop(self) -> None:
        self.halt.set()
        self.join()

    def errors_before(self, moment: float) -> list[BaseException]:
        """This run's failures before `moment`: the server failed a call while it was still up."""
        return [error for ledger in self.ledgers for at, error in ledger.errors if self.started_at <= at < moment]

    def finished_turns(self) -> int:
        return sum(turn.finished_at is not None for ledger in self.ledgers for turn in ledger.turns)

    def wait_turns(self, count: int, timeout: float = 60.0) -> None:
        """Until the agents have finished `count` turns in all; fails at once if a call failed."""
        eventually(lambda: self.finished_turns() >= count or any(ledger.errors for ledger in self.ledgers),
                   timeout, f"{count} turns finished")
        assert not self.errors_before(float("inf")), self.errors_before(float("inf"))


def eventually(condition: Callable[[], bool], timeout: float, what: str | Callable[[], str]) -> None:
    """Poll `condition` (something another process does, which no event of ours can tell) until it holds;
    `what` (or what it returns) says what did not happen."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout} s: {what if isinstance(what, str) else what()}")
        time.sleep(0.05)
