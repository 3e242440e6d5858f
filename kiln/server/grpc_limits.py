"""GrpcLimits: what one gRPC server grants its clients (concurrent calls, streams per connection,
keepalive pings, connection idle time and age), as the channel arguments and server argument that
enforce them. Over `max_concurrent_rpcs`, gRPC itself answers RESOURCE_EXHAUSTED before any handler
runs; the other limits end connections (GOAWAY), which clients redial transparently."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import InvalidArgumentError

HOUR_MS = 3_600_000


@dataclass(frozen=True)
class GrpcLimits:
    max_concurrent_rpcs: int = 1024  # calls in flight on the server (0: no limit); more get RESOURCE_EXHAUSTED
    max_streams_per_connection: int = 256  # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS; a client queues beyond it
    # Keepalive enforcement: a client may ping at most every 10 s while it has calls and not at all without
    # (gRPC allows one ping per 2 h then); the third ping too soon ends its connection (too_many_pings).
    min_client_ping_interval_ms: int = 10_000
    max_ping_strikes: int = 2
    # The server pings a connection quiet for a minute and closes it if no answer comes in 20 s: a peer
    # that vanished (a half-open TCP connection) frees its calls.
    keepalive_ms: int = 60_000
    keepalive_timeout_ms: int = 20_000
    max_connection_idle_ms: int = 5 * 60_000  # a connection without calls this long is closed
    # A connection is asked to go away (GOAWAY: no new calls on it) after an hour, so clients spread over
    # restarted or added servers; the calls in flight then get a day to end before it is closed. A
    # generation never runs that long: it commits a token every step while it runs, no context a server
    # loads takes a day to fill, and one whose client stops reading is cancelled after --stall-timeout-s.
    max_connection_age_ms: int = HOUR_MS
    max_connection_age_grace_ms: int = 24 * HOUR_MS

    def __post_init__(self) -> None:
        if self.max_concurrent_rpcs < 0:
            raise InvalidArgumentError(f"max_concurrent_rpcs must be 0 (no limit) or more, got {self.max_concurrent_rpcs}",
                                       "max_concurrent_rpcs")
        for name in ("max_streams_per_connection", "min_client_ping_interval_ms", "keepalive_ms", "keepalive_timeout_ms",
                     "max_connection_idle_ms", "max_connection_age_ms", "max_connection_age_grace_ms"):
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"{name} must be positive, got {getattr(self, name)}", name)
        if self.max_ping_strikes < 0:
            raise InvalidArgumentError(f"max_ping_strikes must be 0 or more, got {self.max_ping_strikes}", "max_ping_strikes")

    @property
    def rpc_limit(self) -> int | None:
        """grpc.aio.server's `maximum_concurrent_rpcs` (None: unlimited)."""
        return self.max_concurrent_rpcs or None

    def channel_options(self) -> list[tuple[str, int]]:
        """The grpc.aio.server options that enforce these limits."""
        return [
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
            ("grpc.keepalive_time_ms", self.keepalive_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", self.min_client_ping_interval_ms),
            ("grpc.http2.max_ping_strikes", self.max_ping_strikes),
            ("grpc.max_connection_idle_ms", self.max_connection_idle_ms),
            ("grpc.max_connection_age_ms", self.max_connection_age_ms),
            ("grpc.max_connection_age_grace_ms", self.max_connection_age_grace_ms),
        ]


DEFAULT_GRPC_LIMITS = GrpcLimits()
