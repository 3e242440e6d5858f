"""Per-key limits (from the TOML keys file, kiln/server/auth.py) and their enforcement for RuntimeService,
so both transports refuse alike: QuotaExceededError, a RESOURCE_EXHAUSTED naming the limit and its value,
with the seconds after which a retry can succeed (HTTP 429 `Retry-After`, gRPC `retry-after` metadata).

The rules, per key (the anonymous caller of a server without keys has no limits):
- `max_sessions`: live sessions. A create, fork or restore is refused while the key has that many (sessions
  being created count). A session revived from its snapshot after an eviction is not a new one.
- `max_resident_kv_bytes`: the bytes of the pages resident for the key's sessions (a page shared by two of
  its sessions counts twice). A generate on a session is refused while the key is at or over the limit;
  one admitted generate may take it over by that generate's own K/V. Closing sessions frees the bytes
  (the key's idle K/V is also the first dropped under pool pressure, kiln/engine/scheduler.py).
- `max_concurrent_generations`: generations in flight (session generates and stateless completions; a
  completion with `n` choices takes n). A generation holds its slot until its finish event.
- `tokens_per_minute`: prefilled prompt tokens plus generated tokens in a sliding 60 s window. A
  generation is admitted while the window holds fewer than the budget, and charged as it goes: each
  generated token when it commits, the prefill once its first token commits (or at its end, whichever
  comes first), so one admitted generation may overshoot the budget by its own size; the next waits.
  Retry-After is then the time until enough of the window ages out to fall under the budget.
Refusals for the other limits carry a Retry-After of RETRY_AFTER_S: they free when the caller acts.
Limits apply as they are at admission: after a SIGHUP reload, work already admitted keeps running.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import ClassVar, TypeVar

from kiln.engine.sequence import Event, FinishEvent, Request, TokenEvent
from kiln.engine.stream import AsyncGenerationStream
from kiln.errors import InvalidArgumentError, ResourceExhaustedError
from kiln.results import OwnerUsage

T = TypeVar("T")

WINDOW_S = 60.0
RETRY_AFTER_S = 1.0
_SIZE = re.compile(r"\s*(\d+)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class Limits:
    """A key's limits; None is unlimited."""

    max_sessions: int | None = None
    max_resident_kv_bytes: int | None = None
    max_concurrent_generations: int | None = None
    tokens_per_minute: int | None = None

    FIELDS: ClassVar[frozenset[str]] = frozenset({"max_sessions", "max_resident_kv_bytes",
                                                  "max_concurrent_generations", "tokens_per_minute"})

    @classmethod
    def from_table(cls, table: dict, where: str) -> Limits:
        """The limits among a key's TOML fields (others ignored here): positive integers;
        max_resident_kv_bytes also as a size string ("512MiB", "2GB")."""
        values: dict[str, int] = {}
        for item in fields(cls):
            if item.name not in table:
                continue
            value = table[item.name]
            if item.name == "max_resident_kv_bytes" and isinstance(value, str):
                value = parse_size(value, f"{where}: {item.name}")
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgumentError(f"{where}: {item.name} must be a positive integer, got {value!r}")
            values[item.name] = value
        return cls(**values)


def parse_size(text: str, what: str) -> int:
    """Bytes of "512MiB", "2 GB", "4096" (binary units with i, decimal without)."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise InvalidArgumentError(f"{what} must be a size like 512MiB or 2GB, got {text!r}")
    return int(match.group(1)) * _UNITS[(match.group(2) or "B").lower()]


def retry_after(error: Exception) -> str | None:
    """The `Retry-After` value (whole seconds, at least 1) of an error that knows when a retry can succeed
    (`retry_after_s`: a quota, a throttled address); HTTP sends it as a header, gRPC as metadata."""
    seconds = getattr(error, "retry_after_s", None)
    return None if seconds is None else str(max(1, math.ceil(seconds)))


class QuotaExceededError(ResourceExhaustedError):
    """A key's limit refused the call: `limit` names it, `value` is its setting."""

    def __init__(self, limit: str, value: int, detail: str, retry_after_s: float = RETRY_AFTER_S) -> None:
        super().__init__(f"{limit} = {value} reached for this API key: {detail}")
        self.limit = limit
        self.value = value
        self.retry_after_s = retry_after_s


class Quotas:
    """The per-key state the limits need: sessions being created, generations in flight, the tokens of
    the last minute. Its lock guards only that state and is never held while calling out, so the engine
    thread (which charges tokens) never waits on anything else; counting a key's sessions calls the
    session store under a second lock, `_counting`, taken before the store's."""

    def __init__(self, limits_of: Callable[[str | None], Limits], usage_of: Callable[[str | None], OwnerUsage],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._limits_of = limits_of
        self._usage_of = usage_of
        self._clock = clock
        self._lock = threading.Lock()
        self._counting = threading.Lock()
        self._creating: Counter[str] = Counter()
        self._generating: Counter[str] = Counter()
        self._tokens: dict[str, deque[list[float]]] = {}  # [second, tokens] buckets within the window

    @classmethod
    def unlimited(cls) -> Quotas:
        return cls(lambda _: Limits(), lambda _: OwnerUsage(0, 0))

    # ---- sessions -----------------------------------------------------------------------------------

    @contextmanager
    def new_session(self, owner: str | None) -> Iterator[None]:
        """Around a create, fork or restore: refused at `max_sessions`, counted as live meanwhile."""
        limit = self._limits_of(owner).max_sessions
        if owner is None or limit is None:
            yield
            return
        with self._counting:
            live = self._usage_of(owner).sessions + self._creating[owner]
            if live >= limit:
                raise QuotaExceededError("max_sessions", limit, f"{live} sessions are live; close one first")
            self._creating[owner] += 1
        try:
            yield
        finally:
            with self._counting:
                self._creating[owner] -= 1

    # ---- generations --------------------------------------------------------------------------------

    def admitted(self, owner: str | None, streams: Sequence[MeteredStream], submit: Callable[[], T],
                 session: bool = False) -> T:
        """`submit()` once the key may start len(streams) generations (each stream then charges its
        tokens and frees its slot at its finish); `session`: over a session (the resident K/V limit
        applies). Call it on a worker thread: it may count the key's resident pages."""
        if owner is None:
            return submit()
        limits = self._limits_of(owner)
        if session and limits.max_resident_kv_bytes is not None:
            held = self._usage_of(owner).resident_kv_bytes
            if held >= limits.max_resident_kv_bytes:
                raise QuotaExceededError("max_resident_kv_bytes", limits.max_resident_kv_bytes,
                                         f"this key's sessions hold {held} bytes of K/V; close sessions to free it")
        with self._lock:
            self._check_generations(owner, limits, len(streams))
            self._generating[owner] += len(streams)
        for stream in streams:
            stream.meter(self, owner)
        try:
            return submit()
        except BaseException:
            for stream in streams:
                stream.release()
            raise

    def _check_generations(self, owner: str, limits: Limits, wanted: int) -> None:
        cap = limits.max_concurrent_generations
        if cap is not None and self._generating[owner] + wanted > cap:
            raise QuotaExceededError("max_concurrent_generations", cap,
                                     f"{self._generating[owner]} in flight, {wanted} more asked")
        budget = limits.tokens_per_minute
        if budget is None:
            return
        window = self._window(owner)
        used = sum(tokens for _, tokens in window)
        if used >= budget:
            raise QuotaExceededError("tokens_per_minute", budget, f"{int(used)} tokens in the last minute",
                                     retry_after_s=self._frees_at(window, used - budget + 1) - self._clock())

    def _window(self, owner: str) -> deque[list[float]]:
        window = self._tokens.setdefault(owner, deque())
        horizon = self._clock() - WINDOW_S
        while window and window[0][0] + 1 <= horizon:  # a bucket leaves once all of its second has
            window.popleft()
        return window

    @staticmethod
    def _frees_at(window: deque[list[float]], excess: float) -> float:
        """When the oldest buckets holding `excess` tokens have left the window."""
        for second, tokens in window:
            excess -= tokens
            if excess <= 0:
                return second + 1 + WINDOW_S
        return window[-1][0] + 1 + WINDOW_S

    def charge(self, owner: str, tokens: int) -> None:
        """Tokens a generation of `owner` computed (engine thread)."""
        if tokens <= 0:
            return
        second = float(int(self._clock()))
        with self._lock:
            window = self._window(owner)
            if window and window[-1][0] == second:
                window[-1][1] += tokens
            else:
                window.append([second, tokens])

    def release(self, owner: str) -> None:
        """A generation of `owner` ended: its slot is free."""
        with self._lock:
            self._generating[owner] -= 1
            if not self._generating[owner]:
                del self._generating[owner]


class MeteredStream(AsyncGenerationStream):
    """An AsyncGenerationStream that, once `meter`ed, charges its key's tokens as they commit and gives
    its generation slot back at its finish (or `release`, if it never started), exactly once."""

    def __init__(self, cancel: Callable[[Request], None]) -> None:
        super().__init__(cancel)
        self._quotas: Quotas | None = None
        self._owner = ""
        self._charged = 0
        self._prefill_charged = False

    def meter(self, quotas: Quotas, owner: str) -> None:
        self._quotas, self._owner = quotas, owner

    def emit(self, event: Event) -> None:
        if self._quotas is not None:
            if isinstance(event, TokenEvent):
                self._charge(1 + self._prefill())
            elif isinstance(event, FinishEvent):
                self._charge(event.usage.prefilled_tokens + event.usage.generated_tokens - self._charged)
                self.release()
        super().emit(event)

    def _prefill(self) -> int:
        request = self.request
        if self._prefill_charged or request is None or not request.prompt_tokens:
            return 0
        self._prefill_charged = True
        return request.prompt_tokens - request.reused_tokens

    def _charge(self, tokens: int) -> None:
        if self._quotas is not None and tokens > 0:
            self._charged += tokens
            self._quotas.charge(self._owner, tokens)

    def release(self) -> None:
        quotas, self._quotas = self._quotas, None
        if quotas is not None:
            quotas.release(self._owner)
