"""GenerationStream: the caller's side of one generation, as an iterator of token ids."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kiln.engine.sequence import Event, FinishEvent, Request, TokenEvent, Usage


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    usage: Usage
    stop_string: str | None
    time_to_first_token_s: float | None
    total_s: float


class GenerationStream:
    """Iterates generated token ids as the engine commits them. Leaving the loop early (or `cancel()`)
    stops the generation and frees its sequence; errors arrive as the typed exception the engine gave.
    After the loop, `result()` has the finish reason and usage."""

    def __init__(self, cancel: Callable[[Request], None]) -> None:
        self.request: Request | None = None  # set once the engine has accepted the request
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._cancel = cancel
        self._started = time.perf_counter()
        self._first_token_at: float | None = None
        self._token_ids: list[int] = []
        self._logprobs: list[float] = []
        self._finish: FinishEvent | None = None
        self._finished_at = 0.0

    def emit(self, event: Event) -> None:
        """Engine-thread side: never blocks."""
        self._events.put(event)

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        if self._finish is not None:
            raise StopIteration
        event = self._events.get()
        if isinstance(event, TokenEvent):
            if self._first_token_at is None:
                self._first_token_at = time.perf_counter()
            self._token_ids.append(event.token_id)
            if event.logprob is not None:
                self._logprobs.append(event.logprob)
            return event.token_id
        self._finish = event
        self._finished_at = time.perf_counter()
        if event.error is not None:
            raise event.error
        raise StopIteration

    def cancel(self) -> None:
        if self._finish is None and self.request is not None:
            self._cancel(self.request)

    def result(self) -> GenerationResult:
        """Wait for the end (consuming remaining tokens) and summarise the generation."""
        for _ in self:
            pass
        assert self._finish is not None
        return GenerationResult(
            token_ids=list(self._token_ids),
            logprobs=list(self._logprobs) if self._logprobs else None,
            finish_reason=self._finish.reason,
            usage=self._finish.usage,
            stop_string=self._finish.stop_string,
            time_to_first_token_s=None if self._first_token_at is None else self._first_token_at - self._started,
            total_s=self._finished_at - self._started,
        )

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        self.cancel()
