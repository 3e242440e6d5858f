"""HTTP connections: how many may be open, and how long each may take to say what it wants.

uvicorn's h11 protocol bounds an idle keep-alive connection (`timeout_keep_alive`), caps connections
plus running requests (`limit_concurrency`, over it 503) and bounds one header block
(`h11_max_incomplete_event_size`), but nothing bounds a client that opens a connection and then sends
nothing, or its headers a byte a second (slowloris), or stops in the middle of its body: each such
client holds a socket and a file descriptor for ever. BoundedH11Protocol, the protocol `kiln serve`
hands uvicorn, adds the missing clocks. One connection moves through three waits, each with a bound:

- idle (`idle_timeout_s`): from the accept, and from the end of each response, until the first byte
  of the next request; then the connection is closed (uvicorn's keep-alive close, also armed at accept);
- headers (`header_timeout_s`): from the first byte of a request until its header block is complete;
  then the connection is closed (there is no request yet to answer);
- body (`body_timeout_s`): between two pieces of a request body; then the request is answered
  408 (unless its response already began) and the connection is closed. The app sees the client leave.

Once a request is complete nothing is timed here: a generation may take minutes (a stream whose client
stops reading is bounded elsewhere, by the stall timeout, which it reaches because each connection's
send buffer is capped at SEND_BUFFER_BYTES). A connection accepted while
`max_connections` are open is answered 503 at once and closed: its socket is never parked.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import resource
import socket
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kiln.errors import InvalidArgumentError
from kiln.server.access_log import SENT_STATUS_KEY
from kiln.server.generation import STATUS_KEY
from kiln.server.http_errors import envelope

MAX_HEADER_BYTES = 16 * 1024  # one request's header block (h11's own default, made explicit)
FD_RESERVE = 512  # descriptors beyond the HTTP connections: gRPC connections, model files, snapshots, logs
# One connection's kernel send buffer. Left to autotuning, loopback grows it to megabytes: a client that
# never reads a stream would park thousands of tokens there, so its generation never paused and ran to
# max_tokens. 64 KiB (the kernel doubles it) still fills no faster than a LAN drains it.
SEND_BUFFER_BYTES = 64 * 1024


@dataclass(frozen=True)
class HttpLimits:
    """The bounds of `kiln serve --max-connections --http-idle-timeout-s --http-header-timeout-s
    --http-body-timeout-s` (seconds; see the module docstring for when each clock runs)."""

    max_connections: int = 1024
    idle_timeout_s: float = 5.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) \
                or self.max_connections < 1:
            raise InvalidArgumentError(f"max_connections must be a positive integer, got {self.max_connections!r}")
        for name in ("idle_timeout_s", "header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive number of seconds, got {value!r}")

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """uvicorn.Config arguments. uvicorn refuses a request once connections or running requests
        reach `limit_concurrency`, counting the asking connection itself: one more than the connection
        cap, so that it bites only on requests that outlive their connection."""
        return {
            "http": functools.partial(BoundedH11Protocol, limits=self),
            "timeout_keep_alive": self.idle_timeout_s,
            "limit_concurrency": self.max_connections + 1,
            "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
        }


def _refusal(status: int, reason: str, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 response that closes the connection, with the usual error envelope."""
    body = json.dumps(envelope(message, code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n")
    if status == 503:
        head += "retry-after: 1\r\n"
    return head.encode() + b"\r\n" + body


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the idle, header and body clocks and the connection cap of `limits`."""

    def __init__(self, *args: Any, limits: HttpLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._clock: asyncio.TimerHandle | None = None  # the header or the body clock, whichever runs

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        if len(self.connections) > self.limits.max_connections:
            self._refuse()
            return
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._rewind()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        super().connection_lost(exc)

    def _rewind(self) -> None:
        """After bytes arrived: the header clock runs from a request's first byte until its headers are
        complete (it is not restarted by more header bytes); the body clock restarts with every piece."""
        state = self.conn.their_state
        if state is h11.IDLE and self.conn.trailing_data[0] and self._clock is None:
            self._clock = self.loop.call_later(self.limits.header_timeout_s, self._headers_late)
        elif state is h11.SEND_BODY:
            self._stop_clock()
            self._clock = self.loop.call_later(self.limits.body_timeout_s, self._body_stalled)
        elif state is not h11.IDLE:
            self._stop_clock()

    def _stop_clock(self) -> None:
        if self._clock is not None:
            self._clock.cancel()
            self._clock = None

    def _headers_late(self) -> None:
        self._clock = None
        self.timeout_keep_alive_handler()  # closes the connection, as an idle keep-alive one is

    def _body_stalled(self) -> None:
        """408 unless a response already began; either way the app sees the client leave (its reads end
        with http.disconnect and whatever it answers is dropped), and the connection closes."""
        self._clock = None
        cycle = self.cycle
        if cycle is None or self.transport.is_closing():
            return
        if not cycle.response_started:
            cycle.response_started = True
            cycle.scope.update({STATUS_KEY: "DEADLINE_EXCEEDED", SENT_STATUS_KEY: 408})  # type: ignore[typeddict-item]
            self.transport.write(_refusal(408, "Request Timeout", "the request body stalled for more than "
                                          f"{self.limits.body_timeout_s:g} s", "DEADLINE_EXCEEDED"))
        cycle.disconnected = True
        cycle.message_event.set()
        self.transport.close()

    def _refuse(self) -> None:
        """503 and close at once, without reading anything: a flood of connections past the cap costs
        a descriptor for no longer than the accept."""
        self.connections.discard(self)
        self.transport.write(_refusal(503, "Service Unavailable", "the server has its most open connections "
                                      f"({self.limits.max_connections}); retry later", "UNAVAILABLE"))
        self.transport.close()


def ensure_fd_limit(limits: HttpLimits) -> str | None:
    """Raises this process's soft RLIMIT_NOFILE to its hard limit when the soft one cannot hold
    `max_connections` sockets plus FD_RESERVE. Returns a warning to print when even the hard limit
    cannot (connections past it fail at accept, which asyncio survives by pausing accepts), else None."""
    needed = limits.max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    target = needed if hard == resource.RLIM_INFINITY else hard
    with contextlib.suppress(ValueError, OSError):  # e.g. past the kernel's fs.nr_open
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft < needed:
        return (f"kiln serve: only {soft} file descriptors (RLIMIT_NOFILE's hard limit) for --max-connections "
                f"{limits.max_connections}: raise the limit (ulimit -Hn) or lower --max-connections")
    return None
