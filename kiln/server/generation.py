"""One path for every HTTP generation (OpenAI completions, chat, session generate): engine streams in,
text deltas out, delivered either as one JSON body or as server-sent events.

Whatever the delivery, a generation whose client goes away is cancelled so its sequence and pages are
freed at once, and an error that happens after SSE headers were sent still reaches the client as an
error event in the usual envelope.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kiln.engine.stream import AsyncGenerationStream
from kiln.errors import CancelledError
from kiln.results import GenerationResult
from kiln.server.http_errors import error_status
from kiln.text import TextDeltas
from kiln.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")
STATUS_KEY = "kiln.status"  # ASGI scope key: the outcome of a response whose HTTP status was already sent
SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Delta:
    """Text that became final after one generated token (`token_id`, with its `logprob` and likeliest
    alternatives if they were asked for), or, on the last delta of a generation, the remaining text and
    the `result`."""

    text: str
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    result: GenerationResult | None = None


@dataclass(frozen=True)
class Output:
    text: str  # the reply, cut before a matched stop string
    result: GenerationResult


async def deltas(stream: AsyncGenerationStream, tokenizer: Tokenizer, stop: Sequence[str],
                 ended: Callable[[], bool] | None = None,
                 decode: Callable[[Sequence[int]], str] | None = None) -> AsyncIterator[Delta]:
    """One delta per generated token, then a final one; the deltas' text concatenates to the reply.
    `ended()`, asked once each delta was taken, may end the reply early: the generation is cancelled
    there and finishes as "stop" (the reply is complete without the rest, e.g. a repeated tool call).
    `decode`: token ids to text (default tokenizer.decode; a tool-calling reply keeps its call markup).
    Engine errors propagate as their typed exception."""
    decoder = TextDeltas(decode or tokenizer.decode, stop)
    position = 0
    async for token_id in stream:
        logprob, top = stream.logprobs_from(position), stream.top_logprobs_from(position)
        position += 1
        yield Delta(decoder.push([token_id]), token_id, logprob[0] if logprob else None, top[0] if top else None)
        if ended is not None and ended():
            stream.cancel()
            yield Delta("", result=replace(await stream.result(), finish_reason="stop", stop_string=None))
            return
    result = await stream.result()
    if result.finish_reason == "cancelled":
        raise CancelledError("the generation was cancelled")
    yield Delta(decoder.finish(result.stop_string), result=result)


async def collect(stream: AsyncGenerationStream, tokenizer: Tokenizer, stop: Sequence[str]) -> Output:
    """The whole reply of one generation, built from the same deltas a stream would send."""
    parts = [delta async for delta in deltas(stream, tokenizer, stop)]
    result = parts[-1].result
    assert result is not None, "deltas() always ends with the final delta"
    return Output("".join(delta.text for delta in parts), result)


async def start_all(starts: Sequence[Callable[[], Awaitable[list[AsyncGenerationStream]]]]) -> list[list[AsyncGenerationStream]]:
    """Start several groups of generations (a prompt's choices); if one is refused, every generation
    already started is cancelled, so none runs on for a request that failed."""
    groups: list[list[AsyncGenerationStream]] = []
    try:
        for start in starts:
            groups.append(await start())
    except BaseException:
        for stream in (stream for group in groups for stream in group):
            stream.cancel()
        raise
    return groups


async def unless_disconnected(request: Request, work: Awaitable[T], streams: Sequence[AsyncGenerationStream]) -> T:
    """Await `work` (a non-streaming reply) unless the client disconnects first: then the
    generations are cancelled and CancelledError (499) is raised. `work` reads the streams in turn."""
    AsyncGenerationStream.read_in_turn(streams)
    try:
        return await unless_gone(request, work)
    finally:
        for stream in streams:
            stream.cancel()


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first: then `work` is cancelled and CancelledError
    (499) is raised. A generate waiting for its session's turn gives up so."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise CancelledError("the client disconnected")
        return task.result()
    finally:
        watcher.cancel()
        task.cancel()


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _stalled_first(response: Awaitable[None], streams: Sequence[AsyncGenerationStream]) -> bool:
    """Runs the response unless a stream's stall timeout cancels its generation first (the client stopped
    reading, so its writes wait for good): then the response is dropped unfinished, on which the server
    closes the connection. True in that case."""
    task = asyncio.ensure_future(response)
    stalls = [asyncio.ensure_future(stream.stalled.wait()) for stream in streams]
    try:
        await asyncio.wait((task, *stalls), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for stall in stalls:
            stall.cancel()
        stalled = not task.done()
        if stalled:
            task.cancel()
    if stalled:
        await asyncio.wait((task,))
        return True
    task.result()
    return False


def sse_event(payload: object) -> bytes:
    """One `data:` event. JSON is ASCII-escaped so that no character in the text (U+2028, U+0085, ...)
    can look like a line break to a client that splits lines loosely."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class SseResponse(StreamingResponse):
    """Server-sent events: one `data: <json>` per event, then `data: [DONE]`. An error while streaming
    becomes a final `data: {"error": ...}` event, or the event `failure` makes of that envelope (an API
    with typed events has its own). When the response ends (finished, failed, or the client went away)
    every generation still running is cancelled, and the outcome is left in the scope for the request
    metrics."""

    def __init__(self, events: AsyncIterator[object], streams: Sequence[AsyncGenerationStream],
                 failure: Callable[[dict], object] | None = None) -> None:
        self.streams = list(streams)
        AsyncGenerationStream.read_in_turn(self.streams)  # the events of one stream after another
        self.outcome: str | None = None
        self.failure = failure
        super().__init__(self._encode(events), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _encode(self, events: AsyncIterator[object]) -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield sse_event(event)
        except Exception as error:  # headers are out: the failure travels as an event
            status, body = error_status(error)
            if status == 500:
                logger.error("internal error while streaming an HTTP response", exc_info=error)
            self.outcome = body["error"]["code"]  # type: ignore[index]
            yield sse_event(body if self.failure is None else self.failure(body))
        yield SSE_DONE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if await _stalled_first(super().__call__(scope, receive, send), self.streams):
                self.outcome = "CANCELLED"
        finally:
            if any(not stream.finished for stream in self.streams):
                self.outcome = self.outcome or "CANCELLED"
                for stream in self.streams:
                    stream.cancel()
            if self.outcome is not None:
                scope[STATUS_KEY] = self.outcome
