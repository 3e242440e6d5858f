"""The caller's side of a generation: a stream's hand-over to a closing event loop, and a cancel that
arrives before the engine accepted the request."""

from __future__ import annotations

import asyncio

from kiln import SamplingParams
from kiln.engine.sequence import Request, Sequence, TokenEvent
from kiln.engine.stream import AsyncGenerationStream, GenerationStream
from kiln.kv.pages import PageTable


def request() -> Request:
    return Request(Sequence([1, 2, 3], PageTable.empty(1)), SamplingParams(), lambda event: None, frozenset())


def test_an_event_handed_over_as_the_consumer_loop_closes_is_dropped_and_cancels_the_generation():
    """The loop closes between emit's look at it and its hand-over (forced here by closing it inside
    the hand-over): emit, on the engine thread, must not raise, and the generation stops."""
    cancelled: list[Request] = []
    loop = asyncio.new_event_loop()

    async def make() -> AsyncGenerationStream:
        return AsyncGenerationStream(cancelled.append)

    stream = loop.run_until_complete(make())
    stream.request = accepted = request()
    hand_over = loop.call_soon_threadsafe

    def closing_hand_over(*args: object) -> object:
        loop.close()  # the consumer's loop ends right now, after any check emit could have made
        return hand_over(*args)

    loop.call_soon_threadsafe = closing_hand_over  # type: ignore[method-assign]
    stream.emit(TokenEvent(7, None))
    assert loop.is_closed() and cancelled == [accepted]
    stream.emit(TokenEvent(8, None))  # later events are dropped too


def test_a_cancel_before_the_request_is_accepted_cancels_it_as_it_is_set():
    cancelled: list[Request] = []
    stream = GenerationStream(cancelled.append)
    stream.cancel()  # the caller left while the submission was still on its way
    assert cancelled == []
    stream.request = accepted = request()
    assert cancelled == [accepted]


def test_a_stream_without_an_early_cancel_is_not_cancelled_when_its_request_is_set():
    cancelled: list[Request] = []
    stream = GenerationStream(cancelled.append)
    stream.request = accepted = request()
    assert cancelled == []
    stream.cancel()
    assert cancelled == [accepted]
