"""Output processing: what a step's sampled tokens become for the callers, and the one finish event
every accepted request ends with.

`Outputs` appends each sampled token to its request, streams it, checks the stop conditions (stop ids,
a finished grammar, stop strings, max_tokens, the context), and delivers finish events. Delivery is the
engine's promise to its callers, so it holds whatever a callback does: a callback that raises is logged
and never stops the events of the other requests, and each request gets exactly one finish event, the
first one delivered (requests are tracked from submit to finish, so a dying engine can end every
request still open without reading the scheduler's state). Everything here runs on the engine thread
without the engine lock, except `track`, which submit calls under it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.engine.sequence import Event, FinishEvent, Request, TokenEvent
from kiln.engine.stats import EngineStats
from kiln.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

STOP_TAIL_MARGIN = 8  # characters decoded beyond what a stop-string check strictly needs
Finished = tuple[Request, FinishEvent]
Sampled = tuple[int, float | None, tuple[tuple[int, float], ...] | None]  # token, its logprob, top alternatives
FinishObserver = Callable[[Request, str], None]


@dataclass
class Accepted:
    """What one step's sampled tokens did to their requests (in the order they were given)."""

    appended: list[int] = field(default_factory=list)  # tokens that joined each request's sequence
    endings: list[tuple[Request, str, str | None]] = field(default_factory=list)  # (request, reason, stop string)
    failures: list[tuple[Request, Exception]] = field(default_factory=list)


class Outputs:
    """Token acceptance, stop conditions and event delivery for one engine."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, stats: EngineStats) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.stats = stats
        self._observers: list[FinishObserver] = []
        self._open: set[Request] = set()  # accepted requests whose finish event is not out yet
        self._open_lock = threading.Lock()  # guards _open only; nothing waits or calls out under it

    def add_observer(self, observe: FinishObserver) -> None:
        self._observers.append(observe)

    # ---- the requests that are owed a finish event ---------------------------------------------------

    def track(self, request: Request) -> None:
        """`request` was accepted: it will get exactly one finish event."""
        with self._open_lock:
            self._open.add(request)

    def open_requests(self) -> list[Request]:
        with self._open_lock:
            return list(self._open)

    def _claim(self, request: Request) -> bool:
        """True once per request: the caller delivers its finish event."""
        with self._open_lock:
            if request not in self._open:
                return False
            self._open.remove(request)
            return True

    # ---- tokens ---------------------------------------------------------------------------------------

    def accept(self, requests: list[Request], sampled: list[list[Sampled] | Exception]) -> Accepted:
        """Each request's sampled tokens join its sequence and stream out, up to the first that ends it.
        A running request's tokens are the engine thread's alone, so this needs no lock."""
        accepted = Accepted()
        for request, result in zip(requests, sampled, strict=True):
            before = len(request.generated)
            if request.cancelled.is_set():
                accepted.endings.append((request, "cancelled", None))
            elif isinstance(result, Exception):
                accepted.failures.append((request, result))
            else:
                self._accept_tokens(request, result, accepted)
            accepted.appended.append(len(request.generated) - before)
        return accepted

    def _accept_tokens(self, request: Request, tokens: list[Sampled], accepted: Accepted) -> None:
        for token, logprob, top in tokens:
            if request.matcher is not None and not request.matcher.accept(token):  # over the grammar engine's limits, or a bug
                accepted.failures.append((request, request.matcher.refusal(token)))
                return
            reason, stop_string = self._accept(request, token, logprob, top)
            if reason:
                accepted.endings.append((request, reason, stop_string))
                return

    def _accept(self, request: Request, token: int, logprob: float | None,
                top: tuple[tuple[int, float], ...] | None) -> tuple[str | None, str | None]:
        request.seq.tokens.append(token)
        request.generated.append(token)
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        self.stats.generated_tokens += 1
        self._send(request, TokenEvent(token, logprob, top))
        return self._stop_reason(request, token)

    def _stop_reason(self, request: Request, token: int) -> tuple[str | None, str | None]:
        params = request.params
        if token in request.stop_token_ids or (request.matcher is not None and request.matcher.is_terminated()):
            return "stop", None
        if params.stop and (stop := self._stop_string_at_end(request.generated, params.stop)):
            return "stop", stop
        if len(request.generated) >= params.max_tokens or len(request.seq.tokens) >= self.max_model_len:
            return "length", None
        return None, None

    def _stop_string_at_end(self, generated: list[int], stops: tuple[str, ...]) -> str | None:
        """A stop string in the text's tail. Earlier steps checked everything before the newest token,
        so only enough trailing tokens to hold the longest stop string next to the newest token's text
        are decoded: each step costs O(stop length), not O(reply length). The margin absorbs what
        decoding from mid-text changes at the tail's left edge (a split character, a leading space)."""
        need = max(map(len, stops)) + len(self.tokenizer.decode(generated[-1:])) + STOP_TAIL_MARGIN
        count = need
        while True:
            tail = self.tokenizer.decode(generated[-count:])
            if len(tail) >= need or count >= len(generated):
                break
            count *= 2  # tokens that decode to little (special, partial bytes): widen until it holds
        return next((stop for stop in stops if stop in tail), None)

    # ---- delivery -------------------------------------------------------------------------------------

    def deliver(self, ended: list[Finished]) -> None:
        """Each request's finish event, to the observers and then its caller, unless it already had one.
        Never raises: a raising observer or callback is logged and the rest are still served."""
        for request, event in ended:
            if not self._claim(request):
                continue
            for observe in self._observers:
                try:
                    observe(request, event.reason)
                except Exception:
                    logger.exception("a finish observer raised; the other requests are unaffected")
            self._send(request, event)

    def fail_open(self, error: Exception) -> int:
        """End every request still owed a finish event with `error` (the engine cannot run them any
        more). Returns how many there were."""
        with self._open_lock:
            requests = list(self._open)
        self.deliver([(request, FinishEvent("error", request.settle_usage(), error=error)) for request in requests])
        return len(requests)

    def _send(self, request: Request, event: Event) -> None:
        """Hand one event to the request's caller. A caller whose callback raises cannot take its
        tokens: the request is cancelled (it ends at the next step), and the engine goes on."""
        try:
            request.emit(event)
        except Exception:
            logger.exception("the event callback of request %d raised; cancelling it", request.request_id)
            request.cancelled.set()
