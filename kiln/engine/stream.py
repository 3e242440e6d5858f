"""The caller's side of one generation: token ids as the engine commits them, for threads
(GenerationStream) and for asyncio (AsyncGenerationStream)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass

from kiln.engine.sequence import Event, FinishEvent, Request, TokenEvent
from kiln.errors import InvalidArgumentError
from kiln.results import GenerationResult

DEFAULT_STALL_TIMEOUT_S = 30.0  # a paused generation whose client has not read for this long is cancelled
# Unread tokens past which a generation pauses. Transports buffer tens of kilobytes (an HTTP/2 window, TCP
# and socket buffers: thousands of tokens) before their writes wait at all, so a client that reads, however
# slowly, is throttled to its pace rather than cut off; one that stopped reading costs at most this many
# more steps.
MAX_BACKLOG_TOKENS = 64


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

    @property
    def cancel_requested(self) -> bool:
        """Whether `cancel` was called: a submission still waiting (for its session's turn) gives up."""
        return self._cancel_asked

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


@dataclass(frozen=True)
class Backpressure:
    """How a stream holds its generation back when its consumer stops taking tokens (a client that
    stopped reading: its transport's writes wait on flow control, so tokens pile up here). Past
    `max_backlog` unread tokens the request is paused: the scheduler sets it aside, pages kept, and
    everyone else's requests go on. Once the consumer has taken all but `max_backlog // 2` of them it
    is resumed (`resume`, the engine's, wakes the engine). Paused while the consumer takes nothing for
    `stall_timeout_s` (a client reading however slowly is never cut off), it is cancelled like any
    cancel (finish reason "cancelled"; the tokens committed so far stay in a session's history) and the
    stream's `stalled` event is set, so its transport can end the call it can no longer deliver on.
    Streams one consumer reads in turn are held back together (ReadOrder)."""

    resume: Callable[[Request], None]
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    max_backlog: int = MAX_BACKLOG_TOKENS

    def __post_init__(self) -> None:
        if not self.stall_timeout_s > 0:
            raise InvalidArgumentError(f"stall_timeout_s must be positive, got {self.stall_timeout_s}", "stall_timeout_s")
        if self.max_backlog < 1:
            raise InvalidArgumentError(f"max_backlog must be at least 1, got {self.max_backlog}", "max_backlog")


class ReadOrder:
    """The streams one consumer reads one after another: one stream, or a response's choices streamed in
    turn (OpenAI's `n`, several prompts). Backpressure acts on the group, judged by the stream being
    read (the last one taken from): the others wait their turn and buffer, as any stream did, while the
    client keeps up. Past the backlog bound on the stream being read, every generation of the group is
    paused (the consumer reaches the others only after it); a token taken restarts the stall clock,
    and resumes them all once that backlog is down to half the bound; with nothing taken for the stall
    timeout, they are cancelled (`Request.stalled`) and every stream's `stalled` event is set."""

    def __init__(self, streams: Sequence[AsyncGenerationStream]) -> None:
        self.streams = tuple(streams)
        self.reading = self.streams[0]
        self.paused = False
        self._clock: asyncio.TimerHandle | None = None

    def arrived(self, stream: AsyncGenerationStream) -> None:
        held = stream.backpressure
        if held is None or self.paused or stream is not self.reading or stream.backlog <= held.max_backlog:
            return
        self.paused = True
        for other in self.streams:
            if other.request is not None and not other.finished:
                other.request.paused.set()  # the scheduler honours it at its next step
        self._restart_clock(stream, held)

    def taken(self, stream: AsyncGenerationStream) -> None:
        self.reading = stream
        held = stream.backpressure
        if not self.paused or held is None:
            return
        if stream.backlog > held.max_backlog // 2:
            self._restart_clock(stream, held)
            return
        self.paused = False
        self._stop_clock()
        for other in self.streams:
            if other.request is not None and other.request.paused.is_set():
                held.resume(other.request)

    def _restart_clock(self, stream: AsyncGenerationStream, held: Backpressure) -> None:
        self._stop_clock()
        self._clock = stream.loop.call_later(held.stall_timeout_s, self._stalled)

    def _stop_clock(self) -> None:
        if self._clock is not None:
            self._clock.cancel()
            self._clock = None

    def _stalled(self) -> None:
        self._clock = None
        if not self.paused:
            return
        for stream in self.streams:
            if stream.request is not None and stream.request.paused.is_set() and not stream.finished:
                stream.request.stalled = True
                stream.cancel()
            stream.stalled.set()


class AsyncGenerationStream(BaseStream):
    """The asyncio twin of GenerationStream: `async for token in stream`, or `batch()` for every token
    ready at once. Create it on the event loop that will consume it; the engine thread hands events
    over with call_soon_threadsafe, and everything else (the backlog, pausing, the stall clock) happens
    on that loop, so no decision races with the consumer's."""

    def __init__(self, cancel: Callable[[Request], None]) -> None:
        super().__init__(cancel)
        self.loop = asyncio.get_running_loop()
        self._events: deque[Event] = deque()
        self._arrived = asyncio.Event()
        self.backpressure: Backpressure | None = None
        self.backlog = 0  # token events not yet taken by the consumer
        self.order = ReadOrder((self,))
        self.stalled = asyncio.Event()  # set when the stall timeout cancelled the generation

    def hold_back(self, backpressure: Backpressure) -> None:
        """Pause the generation while the consumer does not keep up (see Backpressure); call it before the
        request is submitted. Without it the stream buffers whatever the engine commits."""
        self.backpressure = backpressure

    @staticmethod
    def read_in_turn(streams: Sequence[AsyncGenerationStream]) -> None:
        """Declares that one consumer reads these streams one after another (see ReadOrder)."""
        if not streams:
            return
        order = ReadOrder(streams)
        for stream in order.streams:
            stream.order = order

    def emit(self, event: Event) -> None:
        """Hands the event to the consumer's loop. A loop that closed (its consumer gone for good) takes
        nothing, and the generation is cancelled: asking first whether it is closed would race with
        the closing, so the hand-over itself is tried."""
        try:
            self.loop.call_soon_threadsafe(self._arrive, event)
        except RuntimeError:  # "Event loop is closed"
            if not isinstance(event, FinishEvent):
                self.cancel()

    def _arrive(self, event: Event) -> None:
        self._events.append(event)
        self._arrived.set()
        if isinstance(event, TokenEvent):
            self.backlog += 1
            self.order.arrived(self)

    def _taken(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self.backlog -= 1
            self.order.taken(self)

    async def _next_event(self) -> Event:
        while not self._events:
            self._arrived.clear()
            await self._arrived.wait()
        event = self._events.popleft()
        self._taken(event)
        return event

    def __aiter__(self) -> AsyncIterator[int]:
        return self

    async def __anext__(self) -> int:
        if self._finish is not None:
            raise StopAsyncIteration
        token = self._record(await self._next_event())
        if token < 0:
            raise StopAsyncIteration
        return token

    async def batch(self) -> list[int]:
        """Every token id ready now, waiting for at least one; empty once the generation ended. The
        generation's error is raised after its last tokens were handed out (on the next call)."""
        if self._finish is not None:
            return []
        ids = [token] if (token := self._record(await self._next_event())) >= 0 else []
        while ids and self._events and isinstance(self._events[0], TokenEvent):
            ids.append(self._record(self._next_ready()))
        return ids

    def _next_ready(self) -> Event:
        event = self._events.popleft()
        self._taken(event)
        return event

    async def result(self) -> GenerationResult:
        async for _ in self:
            pass
        return self._result()
