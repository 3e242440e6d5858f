"""What a client knows of one Generate call, the same for the sync and async SDKs: the token ids received
(and those not yet handed to the caller), then the final event with the finish reason and usage. The
transports (sync.Generation, aio.AsyncGeneration) only read events into it."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

from kiln.errors import CancelledError, FailedPreconditionError, KilnError
from kiln.results import GenerationResult, Usage
from kiln.v1 import runtime_pb2 as pb

from . import wire

CANCEL_WAIT_S = 10.0  # how long cancel() waits for the server to free the session


class BaseGeneration:
    """The read side of a generation: filled in as events arrive, complete once iteration ended."""

    def __init__(self) -> None:
        self._pending: deque[int] = deque()  # received, not yet handed to the caller
        self._token_ids: list[int] = []
        self._logprobs: list[float] = []
        self._finish: pb.Finish | None = None
        self._cancelled = False  # by this client
        self._started = time.perf_counter()
        self._first_token_at: float | None = None
        self._ended_at = 0.0

    @property
    def token_ids(self) -> list[int]:
        """Every token id received so far."""
        return list(self._token_ids)

    @property
    def logprobs(self) -> list[float] | None:
        """Log-probabilities of token_ids when requested with logprobs=True, else None."""
        return list(self._logprobs) if self._logprobs else None

    @property
    def finish_reason(self) -> str | None:
        """"stop" | "length" | "cancelled" once finished; None while running."""
        if self._finish is not None:
            return wire.finish_reason(self._finish.reason)
        return "cancelled" if self._cancelled else None

    @property
    def usage(self) -> Usage | None:
        """Token accounting from the server's final event; None while running or after cancel()."""
        return wire.usage(self._finish.usage) if self._finish is not None else None

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the generation, if one did."""
        finish = self._finish
        return finish.stop_string if finish is not None and finish.HasField("stop_string") else None

    @property
    def _done(self) -> bool:
        """Nothing more will arrive: the final event came, or this client cancelled."""
        return self._finish is not None or self._cancelled

    def _add(self, event: pb.GenerateEvent) -> None:
        if event.HasField("finish"):
            self._finish = event.finish
            self._ended_at = time.perf_counter()
            return
        if self._first_token_at is None:
            self._first_token_at = time.perf_counter()
        self._token_ids.extend(event.tokens.token_ids)
        self._logprobs.extend(event.tokens.logprobs)
        self._pending.extend(event.tokens.token_ids)

    def _take(self) -> list[int]:
        ids = list(self._pending)
        self._pending.clear()
        return ids

    def _stream_closed(self) -> None:
        """The stream ended with OK, which it may only do after its final event."""
        if not self._done:
            raise KilnError("the server ended the Generate stream without its final event")

    def _mark_cancelled(self) -> bool:
        """Marks a running generation cancelled by this client; False if it had already ended."""
        if self._done:
            return False
        self._cancelled = True
        self._ended_at = time.perf_counter()
        return True

    def _result(self) -> GenerationResult:
        """The finished generation, as the in-process API reports it (times as seen by the client)."""
        if self._finish is None:
            raise CancelledError("the generation was cancelled by this client; it has no final accounting")
        return GenerationResult(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=wire.finish_reason(self._finish.reason),
            usage=wire.usage(self._finish.usage),
            stop_string=self.stop_string,
            time_to_first_token_s=None if self._first_token_at is None else self._first_token_at - self._started,
            total_s=self._ended_at - self._started,
        )


def idle_polls(session_id: str, timeout_s: float = CANCEL_WAIT_S) -> Iterator[float]:
    """Pauses between checks that the server freed a session after a cancel: short at first (it usually
    takes one engine step), backing off; FailedPreconditionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while time.monotonic() < deadline:
        yield delay
        delay = min(2 * delay, 0.05)
    raise FailedPreconditionError(f"session {session_id} still has a generate in flight {timeout_s} s after cancel")
