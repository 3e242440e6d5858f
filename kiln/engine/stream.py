"""The caller's side of one generation: token ids as the engine commits them, for threads
(GenerationStream) and for asyncio (AsyncGenerationStream)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

from kiln.engine.sequence import Event, FinishEvent, Request, TokenEvent
from kiln.results import GenerationResult


class BaseStream:
    """What both stream kinds remember of the events they hand out. `emit` runs on the engine thread
    and never blocks; `cancel` stops the generation and frees its sequence.

    A stream may be cancelled before its request is accepted (an RPC cancelled while its submission
    runs on a worker thread): the cancel is remembered, and the request is cancelled the moment it is
    set, so no generation outlives a caller that already left."""

    def __init__(self, cancel: Callable[[Request], None]) -> None:
        self._request: Request | None = None  # set once the engine has accepted the request
        self._cancel_asked = False
        self._guard = threading.Lock()  # orders `cancel` against `request` being set on another thread
        self._cancel = cancel
        self._started = time.perf_counter()
        self._first_token_at: float | None = None
        self._token_ids: list[int] = []
        self._logprobs: list[float] = []
        self._top_logprobs: list[tuple[tuple[int, float], ...]] = []
        self._finish: FinishEvent | None = None
        self._finished_at = 0.0

    @property
    def finished(self) -> bool:
        return self._finish is not None

    @property
    def request(self) -> Request | None:
        return self._request

    @request.setter
    def request(self, request: Request) -> None:
        with self._guard:
            self._request = request
            cancelled = self._cancel_asked
        if cancelled:
            self._cancel(request)

    def cancel(self) -> None:
        with self._guard:
            self._cancel_asked = True
            request = self._request
        if self._finish is None and request is not None:
            self._cancel(request)

    def logprobs_from(self, start: int) -> list[float]:
        """Logprobs of the tokens handed out so far, from the `start`-th on (empty unless requested):
        lets a transport stream them beside the ids before the generation ends."""
        return self._logprobs[start:]

    def top_logprobs_from(self, start: int) -> list[tuple[tuple[int, float], ...]]:
        """Likeliest alternatives of the tokens handed out so far, from the `start`-th on (empty unless
        requested)."""
        return self._top_logprobs[start:]

    def _record(self, event: Event) -> int:
        """Token id of a token event; for the finish event raise its error or StopIteration-like None."""
        if isinstance(event, TokenEvent):
            if self._first_token_at is None:
                self._first_token_at = time.perf_counter()
            self._token_ids.append(event.token_id)
            if event.logprob is not None:
                self._logprobs.append(event.logprob)
            if event.top_logprobs is not None:
                self._top_logprobs.append(event.top_logprobs)
            return event.token_id
        self._finish = event
        self._finished_at = time.perf_counter()
        if event.error is not None:
            raise event.error
        return -1

    def _result(self) -> GenerationResult:
        assert self._finish is not None
        return GenerationResult(
            token_ids=list(self._token_ids),
            logprobs=list(self._logprobs) if self._logprobs else None,
            finish_reason=self._finish.reason,
            usage=self._finish.usage,
            stop_string=self._finish.stop_string,
            time_to_first_token_s=None if self._first_token_at is None else self._first_token_at - self._started,
            total_s=self._finished_at - self._started,
            top_logprobs=list(self._top_logprobs) if self._top_logprobs else None,
        )

    def __del__(self) -> None:
        self.cancel()


class GenerationStream(BaseStream):
    """Iterates generated token ids. Leaving the loop early (or `cancel()`) stops the generation and
    frees its sequence; errors arrive as the typed exception the engine gave. After the loop,
    `result()` has the finish reason and usage."""

    def __init__(self, cancel: Callable[[Request], None]) -> None:
        super().__init__(cancel)
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()

    def emit(self, event: Event) -> None:
        self._events.put(event)

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        if self._finish is not None:
            raise StopIteration
        token = self._record(self._events.get())
        if token < 0:
            raise StopIteration
        return token

    def result(self) -> GenerationResult:
        """Wait for the end (consuming remaining tokens) and summarise the generation."""
        for _ in self:
            pass
        return self._result()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class AsyncGenerationStream(BaseStream):
    """The asyncio twin of GenerationStream: `async for token in stream`. Create it on the event loop
    that will consume it; the engine thread hands events over with call_soon_threadsafe."""

    def __init__(self, cancel: Callable[[Request], None]) -> None:
        super().__init__(cancel)
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()

    def emit(self, event: Event) -> None:
        """Hands the event to the consumer's loop. A loop that closed (its consumer gone for good) takes
        nothing, and the generation is cancelled: asking first whether it is closed would race with
        the closing, so the hand-over itself is tried."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # "Event loop is closed"
            if not isinstance(event, FinishEvent):
                self.cancel()

    def __aiter__(self) -> AsyncIterator[int]:
        return self

    async def __anext__(self) -> int:
        if self._finish is not None:
            raise StopAsyncIteration
        token = self._record(await self._events.get())
        if token < 0:
            raise StopAsyncIteration
        return token

    async def result(self) -> GenerationResult:
        async for _ in self:
            pass
        return self._result()
