"""A generation whose consumer stops taking tokens: paused (set aside by the scheduler, pages kept, its
slot free for others), resumed when the consumer reads again, cancelled after its stall timeout with the
session intact. Scheduler rules without a model first, then a tiny engine behind an asyncio stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from kiln import SamplingParams
from kiln.engine.stream import AsyncGenerationStream, Backpressure
from kiln.errors import InvalidArgumentError
from tests.engine.test_scheduler import make_scheduler, request, step

PROMPT = [5, 6, 7, 8, 9, 10, 11]
BOUND_S = 30.0


def test_a_paused_request_steps_aside_keeping_its_pages_and_its_slot_goes_to_another():
    scheduler = make_scheduler(num_pages=1000, max_num_seqs=1)
    stalled, other = request(list(range(1, 9))), request([7, 8, 9])
    scheduler.add(stalled)
    step(scheduler)
    stalled.paused.set()
    scheduler.add(other)
    assert step(scheduler) == {other: 3}  # max_num_seqs is 1: the paused one no longer holds the slot
    assert scheduler.paused == [stalled] and scheduler.stats.pauses == 1 and scheduler.stats.paused_now == 1
    assert stalled.seq.table.holds_pages and stalled.seq.num_computed == 8
    scheduler.remove(other)
    assert not scheduler.has_work()  # nothing to step: the engine sleeps rather than spinning
    stalled.paused.clear()
    assert scheduler.has_work()
    assert step(scheduler) == {stalled: 1}  # a decode row: nothing recomputed
    assert scheduler.stats.paused_now == 0


def test_a_resumed_request_queues_before_those_waiting():
    scheduler = make_scheduler(num_pages=1000, max_num_seqs=1)
    first, second, late = request([1, 2, 3]), request([4, 5, 6]), request([7, 8, 9])
    scheduler.add(first)
    step(scheduler)
    first.paused.set()
    scheduler.add(second)
    step(scheduler)
    scheduler.add(late)
    first.paused.clear()
    scheduler.remove(second)
    assert step(scheduler) == {first: 1}


def test_a_cancelled_paused_request_is_work_for_the_step_that_ends_it():
    scheduler = make_scheduler(num_pages=1000)
    stalled = request([1, 2, 3])
    scheduler.add(stalled)
    step(scheduler)
    stalled.paused.set()
    step(scheduler)
    assert not scheduler.has_work()
    stalled.cancelled.set()
    assert scheduler.has_work() and stalled in scheduler.requests()


def test_pages_of_a_paused_request_go_before_any_running_request_is_preempted():
    scheduler = make_scheduler(num_pages=6, budget=64)
    stalled, running = request(list(range(1, 9)), session=True), request(list(range(20, 28)))
    scheduler.add(stalled)
    scheduler.add(running)
    step(scheduler)  # 2 + 2 pages of 4 tokens (plus the sampled tokens' growth)
    stalled.paused.set()
    big = request(list(range(40, 52)))
    scheduler.add(big)
    step(scheduler)
    assert scheduler.stats.kv_dropped_tokens["paused"] > 0 and not stalled.seq.table.holds_pages
    assert scheduler.stats.preemptions == 0 and running in scheduler.running and big in scheduler.running
    stalled.paused.clear()  # resumed: its K/V is recomputed like a preempted request's
    scheduler.remove(big)
    scheduler.cache.release(big.seq.table)
    step(scheduler)
    assert stalled in scheduler.running


def test_backpressure_refuses_a_stall_timeout_that_is_not_positive():
    with pytest.raises(InvalidArgumentError, match="stall_timeout_s"):
        Backpressure(lambda request: None, stall_timeout_s=0)


async def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """The engine thread's state, which no event of ours announces: polled until it holds, the loop
    running meanwhile (it takes the stream's events and pauses the generation)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.01)


async def paused_generation(llm, backpressure_for, max_tokens: int = 200):  # noqa: ANN001, ANN201
    """A session generate whose stream nobody reads, until the engine set it aside."""
    session = llm.create_session(PROMPT)
    stream = AsyncGenerationStream(llm.engine.cancel)
    stream.hold_back(backpressure_for(llm.engine.resume))
    llm.sessions.generate(session.id, SamplingParams(max_tokens=max_tokens, ignore_eos=True), stream=stream)
    await wait_for(lambda: llm.engine.stats.paused_now == 1, "the unread generation was paused")
    return session, stream


def test_an_unread_stream_pauses_its_generation_and_resumes_when_read(tiny_llm):
    llm = tiny_llm("llama")

    async def run() -> None:
        session, stream = await paused_generation(llm, lambda resume: Backpressure(resume, 60.0, max_backlog=4))
        generated = len(stream.request.generated)
        assert generated < 40  # the backlog bound plus the few steps the loop took to see it
        assert stream.request in llm.engine._scheduler.paused and not llm.engine._scheduler.has_work()
        result = await stream.result()  # reading again resumes it
        assert result.finish_reason == "length" and len(result.token_ids) == 200
        assert session.tokens == PROMPT + result.token_ids
        assert llm.engine.stats.pauses >= 1 and llm.engine.stats.stall_cancels == 0

    asyncio.run(run())


def test_a_stream_unread_past_its_stall_timeout_is_cancelled_and_its_session_goes_on(tiny_llm):
    llm = tiny_llm("llama")
    bystander = llm.create_session(PROMPT)

    async def run() -> None:
        session, stream = await paused_generation(llm, lambda resume: Backpressure(resume, 0.2, max_backlog=4))
        other = bystander.generate(max_tokens=30, ignore_eos=True)  # runs while the stalled one is paused
        assert len(other.result().token_ids) == 30
        await asyncio.wait_for(stream.stalled.wait(), 30)
        result = await stream.result()
        assert result.finish_reason == "cancelled"
        assert session.tokens == PROMPT + result.token_ids  # what was committed joined the history
        assert llm.engine.stats.stall_cancels == 1 and llm.engine.stats.requests_by_outcome["cancelled"] == 1
        assert llm.engine.stats.paused_now == 0 and not session.info().generating
        held = session.info().resident_pages + bystander.info().resident_pages
        assert llm.engine.kv_usage().used == held  # nothing held beyond the sessions' own K/V
        assert len(session.generate(max_tokens=5, ignore_eos=True).result().token_ids) == 5

    asyncio.run(run())


async def choices_read_in_turn(llm, stall_timeout_s: float, max_tokens: int = 60,  # noqa: ANN001
                               max_backlog: int = 4) -> list[AsyncGenerationStream]:
    """Two choices of one prompt whose streams one consumer reads one after another."""
    streams = [AsyncGenerationStream(llm.engine.cancel) for _ in range(2)]
    for stream in streams:
        stream.hold_back(Backpressure(llm.engine.resume, stall_timeout_s, max_backlog=max_backlog))
    AsyncGenerationStream.read_in_turn(streams)
    llm.start_choices(PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True), streams)
    return streams


def test_a_choice_waiting_its_turn_is_not_stalled_while_the_client_reads_an_earlier_one_slowly(tiny_llm):
    """OpenAI's `n` choices stream one after another: while the client keeps reading the first (slowly,
    for many stall timeouts), the second is judged by that progress: throttled to the reader's pace with
    the first, never stall-cancelled."""
    llm = tiny_llm("llama")

    async def run() -> None:
        first, second = await choices_read_in_turn(llm, 0.3)
        async for _ in first:
            await asyncio.sleep(0.05)  # a slow reader: 60 tokens take 10 stall timeouts
        assert not second.stalled.is_set()
        assert (await second.result()).finish_reason == "length"
        assert llm.engine.stats.pauses > 0 and llm.engine.stats.stall_cancels == 0

    asyncio.run(run())


def test_a_choice_waiting_its_turn_generates_on_while_a_client_that_keeps_up_reads_an_earlier_one(tiny_llm):
    """The others buffer while they wait, as streams always did: choices still generate together."""
    llm = tiny_llm("llama")

    async def run() -> None:
        first, second = await choices_read_in_turn(llm, 30.0, max_tokens=200, max_backlog=64)
        assert len((await first.result()).token_ids) == len((await second.result()).token_ids) == 200
        assert llm.engine.stats.pauses == 0

    asyncio.run(run())


def test_choices_read_in_turn_pause_and_stall_together_when_the_client_stops_reading(tiny_llm):
    llm = tiny_llm("llama")

    async def run() -> None:
        first, second = await choices_read_in_turn(llm, 0.3, max_tokens=200)
        await wait_for(lambda: llm.engine.stats.paused_now == 2, "both choices were paused")
        await asyncio.wait_for(second.stalled.wait(), BOUND_S)
        assert first.stalled.is_set()
        for stream in (first, second):
            assert (await stream.result()).finish_reason == "cancelled"
        assert llm.engine.stats.stall_cancels == 2

    asyncio.run(run())
