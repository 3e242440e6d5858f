"""Sessions: append-only histories, reuse of their K/V, forks, eviction, invariants, bad input."""

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kiln import SamplingParams
from kiln.engine.stream import GenerationStream
from kiln.errors import (
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    InvariantViolation,
    NotFoundError,
)

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
WAIT_S = 30.0  # liveness bound: what must happen does so well within it
SETTLE_S = 0.5  # how long a cancelled generate takes to end, as on a real model


def history(length: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 200, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def until(condition: Callable[[], bool], what: str) -> None:
    """Another thread's progress, which no event announces: polled."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_history_in_one_piece_or_many_gives_same_tokens(tiny_llm, arch):
    llm = tiny_llm(arch, page_size=4)
    tokens = history(41)
    whole = llm.create_session(tokens).generate(GREEDY).result().token_ids
    pieces = llm.create_session()
    for start in range(0, len(tokens), 5):
        pieces.append(tokens[start : start + 5])
    assert pieces.generate(GREEDY).result().token_ids == whole
    one_by_one = llm.create_session(tokens[:1])
    for token in tokens[1:]:
        one_by_one.append([token])
    assert one_by_one.generate(GREEDY).result().token_ids == whole


def test_turns_prefill_only_new_tokens_and_generated_tokens_join_history(tiny_llm):
    llm = tiny_llm("gemma3", page_size=4)
    session = llm.create_session(history(20))
    first = session.generate(GREEDY).result()
    assert first.usage.prefilled_tokens == 20 and first.usage.reused_tokens == 0
    assert session.tokens[20:] == first.token_ids
    session.append(history(6, seed=1))
    second = session.generate(GREEDY).result()
    # only the 6 new tokens and the last generated token (whose K/V was not yet computed) are prefilled
    assert second.usage.prefilled_tokens == 7 and second.usage.reused_tokens == 20 + 8 - 1
    info = session.info()
    assert info.history_tokens == 20 + 8 + 6 + 8 and info.last_prefill_tokens == 7
    # the same full history in a fresh session gives the same continuation
    fresh = llm.create_session(session.tokens[: 20 + 8 + 6])
    assert fresh.generate(GREEDY).result().token_ids == second.token_ids


def test_fork_shares_pages_and_branches_diverge_safely(tiny_llm):
    llm = tiny_llm("llama", page_size=4)
    parent = llm.create_session(history(30))
    parent.generate(GREEDY).result()
    used = llm.engine.kv_usage().used
    child = parent.fork()
    # 37 of 38 tokens computed: 9 full pages shared, the partial 10th copied (copy-on-write), nothing recomputed
    assert llm.engine.kv_usage().used == used + 1
    assert child.info().computed_tokens == parent.info().computed_tokens == 37
    assert child.tokens == parent.tokens

    parent.append([11, 12, 13])
    child.append([21, 22])
    parent_out = parent.generate(GREEDY).result().token_ids
    child_out = child.generate(GREEDY).result().token_ids
    assert parent_out == llm.create_session(parent.tokens[: -len(parent_out)]).generate(GREEDY).result().token_ids
    assert child_out == llm.create_session(child.tokens[: -len(child_out)]).generate(GREEDY).result().token_ids

    early = parent.fork(at=10)
    assert early.tokens == parent.tokens[:10]
    with pytest.raises(InvalidArgumentError, match="fork position"):
        parent.fork(at=10_000)


def test_append_validation_changes_nothing(tiny_llm):
    llm = tiny_llm("llama")
    session = llm.create_session([5, 6, 7])
    for bad in ([], [5, 100_000], [-1], [1.5], ["a"], [True]):
        with pytest.raises(InvalidArgumentError):
            session.append(bad)
    assert session.tokens == [5, 6, 7]
    session.append(np.array([8, 9], dtype=np.int64))  # NumPy integers are integers
    assert session.tokens == [5, 6, 7, 8, 9] and all(type(t) is int for t in session.tokens)
    with pytest.raises(InvalidArgumentError, match="context"):
        session.append([5] * llm.engine.max_model_len)
    assert session.tokens == [5, 6, 7, 8, 9]
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        session.generate(max_tokens=0)
    assert not session.info().generating


def test_unknown_and_closed_sessions_are_not_found(tiny_llm):
    llm = tiny_llm("llama")
    with pytest.raises(NotFoundError, match="does not exist"):
        llm.sessions.info("nope")
    session = llm.create_session([1, 2, 3])
    session.close()
    with pytest.raises(NotFoundError, match="closed"):
        session.append([4])
    with pytest.raises(NotFoundError):
        session.close()


def test_sessions_are_invisible_to_other_owners(tiny_llm):
    store = tiny_llm("llama").sessions
    sid = store.create([1, 2], owner="key-a")
    with pytest.raises(NotFoundError, match="does not exist"):
        store.info(sid, owner="key-b")
    assert [s.session_id for s in store.list(owner="key-a")] == [sid]
    assert store.list(owner="key-b") == []
    store.close(sid, owner="key-a")
    with pytest.raises(NotFoundError, match="closed"):
        store.info(sid, owner="key-a")
    with pytest.raises(NotFoundError, match="does not exist"):  # not even that it once existed
        store.info(sid, owner="key-b")
    with pytest.raises(NotFoundError) as refused:
        store.info("x" * 60_000)
    assert len(str(refused.value)) < 120


def test_generates_on_one_session_take_turns_in_arrival_order(tiny_llm):
    """ADR 0008 §2.5: a later generate waits for the one in flight; two waiters run in the order they
    came. Other calls needing an idle session are still refused behind a live generate."""
    llm = tiny_llm("llama")
    session = llm.create_session(start := history(5))
    running = session.generate(max_tokens=5_000, ignore_eos=True)
    queued = llm.sessions._sessions[session.id].waiting
    results: dict[str, list[int]] = {}

    def turn(name: str, tokens: int) -> None:
        results[name] = session.generate(max_tokens=tokens, ignore_eos=True).result().token_ids

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(turn, "first", 3)
        until(lambda: len(queued) == 1, "the first waiter queued")
        second = pool.submit(turn, "second", 4)
        until(lambda: len(queued) == 2, "the second waiter queued")
        with pytest.raises(FailedPreconditionError, match="in flight"):
            session.append([3])
        assert not first.done() and not second.done()
        running.cancel()
        first.result(timeout=WAIT_S), second.result(timeout=WAIT_S)
    ran = running.result().token_ids
    assert (len(results["first"]), len(results["second"])) == (3, 4)
    assert llm.sessions.tokens(session.id) == start + ran + results["first"] + results["second"]


def test_calls_right_after_a_cancel_wait_for_it_to_end(tiny_llm, monkeypatch):
    """A cancelled generate ends at the engine's next step (on a real model that took ~0.5 s, held here):
    a generate or append meanwhile waits for it instead of being refused."""
    llm = tiny_llm("llama")
    session = llm.create_session(history(5))
    real = llm.sessions._end_turn
    monkeypatch.setattr(llm.sessions, "_end_turn", lambda *args: (time.sleep(SETTLE_S), real(*args)))
    running = session.generate(max_tokens=5_000, ignore_eos=True)
    next(iter(running))
    running.cancel()
    assert llm.sessions.info(session.id).generating  # still ending
    length = session.append([3])
    assert running.result().finish_reason == "cancelled"
    running = session.generate(max_tokens=5_000, ignore_eos=True)
    next(iter(running))
    running.cancel()
    assert session.generate(GREEDY).result().token_ids and llm.sessions.tokens(session.id)[length - 1] == 3


def test_a_waiting_generate_gives_up_at_its_deadline_or_the_servers_limit_or_when_cancelled(tiny_llm):
    llm = tiny_llm("llama")
    store = llm.sessions
    session = llm.create_session(history(5))
    running = session.generate(max_tokens=5_000, ignore_eos=True)
    next(iter(running))
    running.request.paused.set()  # held as a reader that stopped would hold it: it keeps the turn, however fast the model
    with pytest.raises(DeadlineExceededError, match="deadline"):
        store.generate(session.id, GREEDY, deadline=time.monotonic() + 0.2)
    store.generate_wait_s = 0.2
    with pytest.raises(FailedPreconditionError, match="generate_wait_s"):
        store.generate(session.id, GREEDY)
    store.generate_wait_s = WAIT_S
    leaving = GenerationStream(llm.engine.cancel)
    with ThreadPoolExecutor(1) as pool:
        waiter = pool.submit(store.generate, session.id, GREEDY, stream=leaving)
        until(lambda: len(store._sessions[session.id].waiting) == 1, "it queued")
        leaving.cancel()  # its caller left
        with pytest.raises(CancelledError):
            waiter.result(timeout=WAIT_S)
    assert not store._sessions[session.id].waiting and store.info(session.id).generating
    running.cancel()
    assert session.generate(GREEDY).result().finish_reason == "length"  # the session goes on


def test_idle_ttl_eviction_is_counted(tiny_llm):
    llm = tiny_llm("llama")
    now = [0.0]
    llm.sessions._clock = lambda: now[0]
    kept = llm.create_session([1, 2, 3], ttl_s=100)
    short = llm.create_session([1, 2, 3], ttl_s=10)
    now[0] = 50
    with pytest.raises(NotFoundError, match="idle ttl"):
        short.info()
    assert kept.info().history_tokens == 3
    assert llm.sessions.evictions["ttl"] == 1


def test_lru_eviction_by_session_count(tiny_llm):
    llm = tiny_llm("llama", max_sessions=2)
    a = llm.create_session([1])
    b = llm.create_session([2])
    a.append([3])  # a is now more recently used than b
    llm.create_session([4])
    with pytest.raises(NotFoundError, match="lru"):
        b.info()
    assert a.info().history_tokens == 2
    assert llm.sessions.evictions["lru"] == 1


def test_memory_pressure_drops_kv_never_history(tiny_llm):
    """Sessions made one after another in a pool that holds the K/V of two at a time: every one stays
    alive, and every turn gives the same greedy tokens as with room to spare."""
    histories = [history(60, seed=seed) for seed in range(6)]

    def two_turns(llm):
        sessions = [llm.create_session(h) for h in histories]
        first = [s.generate(GREEDY).result() for s in sessions]
        dropped = [s.info().computed_tokens for s in sessions]
        for s in sessions:
            s.append([7, 8, 9])
        second = [s.generate(GREEDY).result() for s in reversed(sessions)][::-1]  # newest first
        return sessions, first, second, dropped

    _, roomy_first, roomy_second, _ = two_turns(tiny_llm("llama", page_size=4))
    tight = tiny_llm("llama", page_size=4, kv_pages=40)  # 160 tokens; a session holds 68
    sessions, first, second, resident = two_turns(tight)
    assert [r.token_ids for r in first] == [r.token_ids for r in roomy_first]
    assert [r.token_ids for r in second] == [r.token_ids for r in roomy_second]
    assert all(s.info().history_tokens == 60 + 8 + 3 + 8 for s in sessions)
    assert tight.sessions.evictions == {} and tight.sessions.outcomes["evicted"] == 0
    assert resident[0] == 0 and resident[-1] == 67  # the oldest session's K/V went, its history stayed
    assert second[0].usage.prefilled_tokens == 60 + 8 + 3  # ... and its next turn recomputed it
    assert second[-1].usage.prefilled_tokens == 1 + 3  # the newest one's K/V was still there
    assert second[-2].usage.prefilled_tokens == 1 + 3
    assert tight.engine.stats.kv_dropped_tokens["idle"] >= 67 * 5


def test_invariant_violation_fails_only_that_session_and_is_counted(tiny_llm):
    llm = tiny_llm("llama", page_size=4)
    broken = llm.create_session(history(20))
    broken.generate(GREEDY).result()
    healthy = llm.create_session(history(20, seed=3))
    llm.sessions._sessions[broken.id].seq.table.hashes[-1] = b"corrupted-hash!!"
    with pytest.raises(InvariantViolation) as raised:
        broken.append([5])
    assert raised.value.kind == "inv1" and raised.value.bug_id.startswith("KILN-INV1-")
    with pytest.raises(FailedPreconditionError, match="failed"):
        broken.generate(GREEDY)
    assert llm.sessions.invariant_violations["inv1"] == 1
    assert healthy.generate(GREEDY).result().finish_reason == "length"

    shrunk = llm.create_session(history(10))
    del llm.sessions._sessions[shrunk.id].seq.tokens[-2:]
    with pytest.raises(InvariantViolation) as raised:
        shrunk.append([5])
    assert raised.value.kind == "inv2"
    assert llm.sessions.invariant_violations["inv2"] == 1


def test_a_failed_session_info_carries_its_invariant_violations(tiny_llm):
    """info() and list() still describe a session an invariant violation failed, with the count (every
    other call on it is refused); a healthy session's count is 0."""
    llm = tiny_llm("llama", page_size=4)
    broken, healthy = llm.create_session(history(20)), llm.create_session(history(20, seed=3))
    broken.generate(GREEDY).result()
    assert broken.info().invariant_violations == 0
    llm.sessions._sessions[broken.id].seq.table.hashes[-1] = b"corrupted-hash!!"
    with pytest.raises(InvariantViolation):
        broken.append([5])
    assert broken.info().invariant_violations == 1 and broken.info().history_tokens == 29
    assert {info.session_id: info.invariant_violations for info in llm.sessions.list()} == {broken.id: 1, healthy.id: 0}
    with pytest.raises(FailedPreconditionError, match="failed"):
        broken.append([6])


def test_sliding_window_pages_are_released_during_a_long_session(tiny_llm):
    llm = tiny_llm("gemma3", page_size=4)  # tiny gemma: window 8; one global and two sliding KV groups
    session = llm.create_session(history(60))
    session.generate(GREEDY).result()
    info = session.info()
    full_pages = -(-info.computed_tokens // 4)
    # the global group keeps every page; each sliding group the window, the page being filled and one of slack
    assert full_pages < info.resident_pages <= full_pages + 2 * (8 // 4 + 3)


def test_pressure_on_a_forked_parent_leaves_the_pages_its_child_shares(tiny_llm):
    """Dropping the K/V of an idle parent gives back only the references it held: the full pages its fork
    shares stay with the child (which continues exactly), and the parent's next turn finds them again
    through the prefix cache."""
    llm = tiny_llm("llama", page_size=4, kv_pages=34)
    parent = llm.create_session(history(60))
    parent.generate(GREEDY).result()  # 68 tokens, 67 computed: 16 full pages and a partial one
    child = parent.fork()
    child.append([5, 6])  # the parent is now the least recently used
    other = llm.create_session(history(60, seed=4))
    other.generate(GREEDY).result()  # needs 17 pages: only the parent's K/V has to go
    assert parent.info().computed_tokens == 0 and child.info().computed_tokens == 67
    assert llm.engine.stats.kv_dropped_tokens == {"idle": 67}

    child_turn = child.generate(GREEDY).result()
    assert child_turn.usage.prefilled_tokens == 1 + 2
    fresh = llm.create_session(child.tokens[:-8])
    assert fresh.generate(GREEDY).result().token_ids == child_turn.token_ids
    fresh.close()
    parent_turn = parent.generate(GREEDY).result()
    assert parent_turn.usage.reused_tokens == 64  # the 16 full pages the child kept
