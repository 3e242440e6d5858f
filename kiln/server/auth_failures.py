"""Failed authentications by peer address: counted, and throttled after repeated failures.

The rule: an address with `threshold` (20; `kiln serve --auth-failure-threshold`, 0 turns it off, as
behind a proxy through which every client shares one address) failed attempts within `window_s` (60 s) is refused at once,
its key not even looked at, until `delay` has passed since its last failure; the delay doubles with
each failure past the threshold (1 s, 2 s, 4 s, ... at most `max_delay_s`, 60 s). The refusal is
UNAUTHENTICATED with the seconds left (HTTP `Retry-After`, gRPC `retry-after` trailing metadata), answered
at once rather than by sleeping: a sleeping attempt holds a connection and a task, which is what a
flood wants. A refused attempt is counted apart and does not lengthen the wait, so a client that waits
what it was told is let through; each further wrong key doubles the next wait, so a guesser gets about
one guess per delay. A success clears nothing: a caller holding one valid key cannot interleave it with
guesses to stay under the threshold; failures age out of the window.

Memory and metrics stay bounded whatever the number of addresses: at most `max_addresses` (10,000)
are remembered, the least recently failing forgotten first, each with at most threshold + 7 failure
times; metrics carry totals only (kiln_auth_failures_total, kiln_auth_throttled_total), never addresses.
"""

from __future__ import annotations

import math
import threading
import time
import urllib.parse
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from kiln.errors import UnauthenticatedError


class AuthThrottledError(UnauthenticatedError):
    """Too many failed authentications from the caller's address; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class ThrottleRule:
    threshold: int = 20  # 0: never throttle
    window_s: float = 60.0
    base_delay_s: float = 1.0
    max_delay_s: float = 60.0
    max_addresses: int = 10_000

    def delay_s(self, failures: int) -> float:
        """The wait after the latest of `failures` recent failures (0 below the threshold)."""
        if not self.threshold or failures < self.threshold:
            return 0.0
        return min(self.base_delay_s * 2.0 ** (failures - self.threshold), self.max_delay_s)

    @property
    def kept_failures(self) -> int:
        """Failure times worth keeping per address: past this many the delay is at its cap."""
        return self.threshold + max(0, math.ceil(math.log2(self.max_delay_s / self.base_delay_s))) + 1


class AuthFailures:
    """Per-address failure records and the totals; safe to call from any thread."""

    def __init__(self, rule: ThrottleRule | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.rule = rule or ThrottleRule()
        self._clock = clock
        self._lock = threading.Lock()
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()  # least recently failing first
        self.failures_total = 0
        self.throttled_total = 0

    def check(self, peer: str | None) -> None:
        """Raises AuthThrottledError while `peer` must wait (a peer of None is never throttled)."""
        if peer is None:
            return
        with self._lock:
            times = self._recent(peer)
            wait = times[-1] + self.rule.delay_s(len(times)) - self._clock() if times else 0.0
            if wait <= 0:
                return
            self.throttled_total += 1
        raise AuthThrottledError(f"too many failed authentications from this address: retry in {math.ceil(wait)} s",
                                 retry_after_s=wait)

    def record(self, peer: str | None) -> None:
        """One failed attempt from `peer`."""
        with self._lock:
            self.failures_total += 1
            if peer is None:
                return
            times = self._recent(peer)
            if not times:
                times = self._failures[peer] = deque(maxlen=self.rule.kept_failures)
            times.append(self._clock())
            self._failures.move_to_end(peer)
            while len(self._failures) > self.rule.max_addresses:
                self._failures.popitem(last=False)

    def _recent(self, peer: str) -> deque[float]:
        """The peer's failures within the window (older ones dropped); empty if none."""
        times = self._failures.get(peer)
        if times is None:
            return deque()
        horizon = self._clock() - self.rule.window_s
        while times and times[0] < horizon:
            times.popleft()
        if not times:
            del self._failures[peer]
        return times


def grpc_peer_address(peer: str | None) -> str | None:
    """The host of gRPC's `context.peer()` as HTTP's ASGI scope names it ("ipv4:127.0.0.1:5000" ->
    "127.0.0.1", "ipv6:[::1]:5000" -> "::1"), so a host is one peer on both ports, whatever its port."""
    if not peer:
        return None
    family, _, rest = urllib.parse.unquote(peer).partition(":")
    host, sep, port = rest.rpartition(":")
    if family not in ("ipv4", "ipv6") or not sep or not port.isdigit():
        return peer
    return host.removeprefix("[").removesuffix("]")
