"""After a crash: is every acknowledged turn back, as the client saw it, and does the session continue as
an uninterrupted run would?

The reference is an in-process `kiln.LLM` over the same tiny model with the same engine options
(deterministic, so its greedy tokens are bit-identical to the server's however either batched them). It
checks every turn the clients saw (each generated turn equals the reference's greedy continuation of the
history before it) and completes a turn whose finish never arrived (the server may have generated and
saved it before the kill), which gives the one history the server may hold a prefix of."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kiln import LLM
from kiln.client import Client
from kiln.snapshots.manifest import session_snapshot_id
from kiln.snapshots.store import open_store
from tests.fault.ledger import GENERATE, GREEDY, Ledger
from tests.fault.node import KV_BUDGET_MB, Model


class Reference:
    """The uninterrupted run: greedy continuations of histories, computed in process."""

    def __init__(self, model: Model) -> None:
        self.llm = LLM(str(model.path), cache_dir=str(model.cache), deterministic=True,
                       kv_budget_bytes=KV_BUDGET_MB * 2**20)

    def greedy(self, histories: list[list[int]]) -> list[list[int]]:
        """The GENERATE greedy tokens after each history (one batch)."""
        if not histories:
            return []
        return [output.token_ids for output in self.llm.generate(histories, **GREEDY)]

    def close(self) -> None:
        self.llm.close()


def expected_histories(ledgers: list[Ledger], reference: Reference) -> dict[str, list[int]]:
    """Session id -> the longest history its server may hold. Asserts that every generated token a client
    received is the reference's (a server that streamed other tokens already diverged before any crash)."""
    starts = [(ledger, start, turn) for ledger in ledgers for start, turn in ledger.generate_starts()]
    histories = {ledger.session_id: ledger.tokens() for ledger in ledgers}
    expected = {session: list(tokens) for session, tokens in histories.items()}
    greedy = reference.greedy([histories[ledger.session_id][:start] for ledger, start, _ in starts])
    for (ledger, start, turn), tokens in zip(starts, greedy, strict=True):
        seen = turn.generated
        assert seen == tokens[: len(seen)], (
            f"session {ledger.session_id}: the server generated {seen} after {start} tokens, the reference {tokens}")
        if turn.finished_at is None and len(seen) < GENERATE:  # its last turn: complete it
            expected[ledger.session_id] += tokens[len(seen):]
    return expected


@dataclass
class Outcome:
    """What one crash did to the sessions of one trial."""

    sessions: int = 0
    acknowledged_turns: int = 0  # turns whose finish a client got
    required_turns: int = 0  # of those, the ones the durability rule says must survive
    lost_turns: int = 0  # acknowledged turns not in the restored history
    unacknowledged_kept: int = 0  # tokens the server kept beyond the last acknowledged turn
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.sessions} session checks, {self.acknowledged_turns} acknowledged turns ({self.required_turns} "
                f"required to survive), {self.lost_turns} lost, {self.unacknowledged_kept} unacknowledged tokens kept")

    def add(self, other: Outcome) -> None:
        for name in ("sessions", "acknowledged_turns", "required_turns", "lost_turns", "unacknowledged_kept"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.failures += other.failures


def stored_histories(store_target: str, ledgers: list[Ledger]) -> dict[str, list[int]]:
    """Session id -> the history its own snapshot in the store holds (empty if it has none): what a
    restarted server restores it from."""
    store = open_store(store_target)
    try:
        manifests = {ledger.session_id: store.get_manifest(session_snapshot_id(ledger.session_id)) for ledger in ledgers}
    finally:
        store.close()
    return {session: [] if manifest is None else list(manifest.token_ids) for session, manifest in manifests.items()}


def check_stored(ledgers: list[Ledger], reference: Reference, stored: dict[str, list[int]],
                 required: Callable[[Ledger], int]) -> Outcome:
    """Stored histories against what their clients saw: each is at least `required(ledger)` long (what the
    durability rule says must survive) and is a prefix of the history the server may hold."""
    outcome = Outcome()
    expected = expected_histories(ledgers, reference)
    for ledger in ledgers:
        history, want, must = stored[ledger.session_id], expected[ledger.session_id], required(ledger)
        finished = ledger.finished_turns()
        outcome.sessions += 1
        outcome.acknowledged_turns += len(finished)
        outcome.required_turns += sum(end <= must for end, _ in finished)
        outcome.lost_turns += sum(end > len(history) for end, _ in finished)
        outcome.unacknowledged_kept += max(0, len(history) - max(must, ledger.acknowledged()))
        if len(history) < must or history != want[: len(history)]:
            outcome.failures.append(
                f"session {ledger.session_id}: the store holds {len(history)} tokens "
                f"({'a prefix' if history == want[: len(history)] else 'NOT a prefix'} of the {len(want)} the "
                f"server may have), the client had {must} that must survive")
    return outcome


def check_restored(client: Client, ledgers: list[Ledger], reference: Reference, store_target: str,
                   required: Callable[[Ledger], int]) -> Outcome:
    """check_stored, then through the restarted server: each stored session comes back with that history
    length, and a greedy turn on it gives the reference's continuation of that history (so the server
    holds those tokens and their K/V, not just the count). Continues every session by one turn."""
    stored = stored_histories(store_target, ledgers)
    outcome = check_stored(ledgers, reference, stored, required)
    restored = [ledger.session_id for ledger in ledgers if stored[ledger.session_id]]
    continued = []
    for session_id in restored:
        session = client.get_session(session_id)
        if (length := session.info().history_tokens) != len(stored[session_id]):
            outcome.failures.append(f"session {session_id}: restored with {length} tokens, its snapshot has "
                                    f"{len(stored[session_id])}")
        continued.append(session.generate(**GREEDY).result().token_ids)
    references = reference.greedy([stored[session_id] for session_id in restored])
    for session_id, tokens, want in zip(restored, continued, references, strict=True):
        if tokens != want:
            outcome.failures.append(f"session {session_id}: continued with {tokens}, an uninterrupted run with {want}")
    return outcome
