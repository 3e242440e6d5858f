"""Access logs: one line per request, on both transports, to the `kiln.access` logger (stderr under
`kiln serve`).

A line says who asked what and how it went, never what was said: time (the request's end), request id,
transport, route (the request-metrics label: `http/<route template>` or `grpc/<Method>`), method, peer,
caller, status and Kiln code, request and response bytes, duration, and for generations their number
and the prompt and completion tokens. `caller` is the first 12 hex digits of the caller's identity,
itself the SHA-256 of its API key (kiln/server/auth.py), so it matches the start of the key's digest
and reveals nothing of the key; `-` when keys are off. Token ids, text and prompts appear only with
`--log-content`, which adds the request and response content (each cut at MAX_CONTENT_BYTES); keys
never do (they travel in headers and metadata, which are not logged).

Request ids: a client's `x-request-id` header (gRPC: metadata) is kept when it is a short token
(REQUEST_ID), else the server makes one; it is returned in the `x-request-id` response header (gRPC:
trailing metadata), so a client can quote it. Formats: `text` (key=value pairs; a value with spaces,
quotes or control characters is JSON-quoted, so no request can forge a line) or `json` (one object a
line). Lines are formatted on the event loop and written by a logging thread: a slow stderr reader
never stalls serving.
"""

from __future__ import annotations

import contextlib
import json
import logging
import logging.handlers
import queue
import re
import secrets
import sys
import time
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime

import grpc
from google.protobuf import text_format
from google.protobuf.message import Message as ProtoMessage
from starlette.datastructures import Headers
from starlette.types import Message, Receive, Scope, Send

from kiln.engine.stream import BaseStream
from kiln.errors import InvalidArgumentError
from kiln.server.generation import STATUS_KEY
from kiln.server.http_auth import _OWNER as OWNER_SCOPE_KEY
from kiln.server.http_errors import INTERNAL, code_name

LOGGER_NAME = "kiln.access"
FORMATS = ("text", "json")
REQUEST_ID_HEADER = "x-request-id"
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
CALLER_CHARS = 12
MAX_CONTENT_BYTES = 16_384
_FIELDS = "kiln_access"  # the LogRecord attribute holding a line's fields
SENT_STATUS_KEY = "kiln.sent_status"  # ASGI scope key: a status the connection sent in the app's stead
_BARE = re.compile(r"[A-Za-z0-9._:/{}\[\]@+-]+")

logger = logging.getLogger(LOGGER_NAME)
_current: ContextVar[AccessRecord | None] = ContextVar("kiln_access_record", default=None)


def request_id(offered: str | None) -> str:
    """The client's id when it is a sane short token, else a fresh random one."""
    return offered if offered is not None and REQUEST_ID.fullmatch(offered) else secrets.token_hex(8)


@dataclass
class AccessRecord:
    """What one request's line reports; filled in by its transport while it runs."""

    request_id: str
    transport: str
    route: str
    method: str
    peer: str | None
    content: bool = False  # keep the request's and response's content (--log-content)
    started: float = field(default_factory=time.perf_counter)
    caller: str | None = None
    status: int | None = None  # HTTP status sent (None on gRPC)
    code: str = INTERNAL  # Kiln / gRPC status name: INTERNAL until the outcome is known
    request_bytes: int = 0
    response_bytes: int | None = 0  # None: a gRPC stream (its size is its tokens)
    streams: list[BaseStream] = field(default_factory=list)
    request_content: bytearray = field(default_factory=bytearray)
    response_content: bytearray = field(default_factory=bytearray)

    @property
    def duration_s(self) -> float:
        return time.perf_counter() - self.started

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The gRPC trailing metadata that returns the request id."""
        return ((REQUEST_ID_HEADER, self.request_id),)

    def keep_request(self, data: bytes) -> None:
        if self.content:
            _keep(self.request_content, data)

    def keep_response(self, data: bytes) -> None:
        if self.content:
            _keep(self.response_content, data)

    def fields(self) -> dict[str, object]:
        fields: dict[str, object] = {
            "time": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "request_id": self.request_id, "transport": self.transport, "route": self.route, "method": self.method,
            "peer": self.peer, "caller": self.caller[:CALLER_CHARS] if self.caller else "-",
            "status": self.status, "code": self.code, "request_bytes": self.request_bytes,
            "response_bytes": self.response_bytes, "duration_ms": round(self.duration_s * 1000, 1),
        }
        usages = [stream.request.usage() for stream in self.streams if stream.request is not None]
        if self.streams:
            fields.update(generations=len(self.streams), prompt_tokens=sum(usage.prompt_tokens for usage in usages),
                          completion_tokens=sum(usage.generated_tokens for usage in usages))
        if self.content:
            generated = " ".join(str(stream.request.generated) for stream in self.streams if stream.request)
            fields.update(request_content=_text(self.request_content),
                          response_content=_text(self.response_content) if self.response_content else generated)
        return {name: value for name, value in fields.items() if value is not None}


def _keep(kept: bytearray, data: bytes) -> None:
    """Appends up to MAX_CONTENT_BYTES in all, one byte more marking a cut."""
    kept += data[: MAX_CONTENT_BYTES + 1 - len(kept)]


def _text(kept: bytearray) -> str:
    text = bytes(kept[:MAX_CONTENT_BYTES]).decode("utf-8", "replace")
    return text + "...(cut)" if len(kept) > MAX_CONTENT_BYTES else text


def track(streams: Sequence[BaseStream]) -> None:
    """Counts these generations' tokens in the current request's line (a no-op outside a request)."""
    if (record := _current.get()) is not None:
        record.streams.extend(streams)


def note_grpc_request(raw: bytes, message: ProtoMessage) -> None:
    if (record := _current.get()) is not None:
        record.request_bytes = len(raw)
        record.keep_request(text_format.MessageToString(message, as_one_line=True).encode())


def note_grpc_response(message: ProtoMessage) -> None:
    if (record := _current.get()) is not None:
        record.response_bytes = message.ByteSize()
        record.keep_response(text_format.MessageToString(message, as_one_line=True).encode())


def text_line(fields: dict[str, object]) -> str:
    """key=value pairs; values that could break a line's shape are JSON-quoted."""
    return " ".join(f"{name}={_text_value(value)}" for name, value in fields.items())


def _text_value(value: object) -> str:
    text = str(value)
    return text if isinstance(value, int | float) or _BARE.fullmatch(text) else json.dumps(text)


class AccessFormatter(logging.Formatter):
    def __init__(self, format: str = "text") -> None:  # noqa: A002 - the flag's name
        super().__init__()
        if format not in FORMATS:
            raise InvalidArgumentError(f"log format must be one of {', '.join(FORMATS)}, got {format!r}")
        self.json = format == "json"

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, _FIELDS, None)
        if fields is None:
            return super().format(record)
        return json.dumps(fields, ensure_ascii=False) if self.json else text_line(fields)


@dataclass(frozen=True)
class AccessLog:
    """The access log of one server: `format` (text | json) and whether lines carry content."""

    format: str = "text"
    content: bool = False

    def __post_init__(self) -> None:
        AccessFormatter(self.format)  # refuses an unknown format at start-up

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Sends `kiln.access` lines to stderr for the duration, through a queue drained by a thread."""
        records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        handler = logging.handlers.QueueHandler(records)
        handler.setFormatter(AccessFormatter(self.format))
        listener = logging.handlers.QueueListener(records, logging.StreamHandler(sys.stderr))
        level, propagate = logger.level, logger.propagate
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        listener.start()
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate
            listener.stop()

    @contextlib.contextmanager
    def request(self, record: AccessRecord) -> Iterator[AccessRecord]:
        """The current request's record while the block runs (track() and the note_* calls fill it in);
        its line is written when the block ends, however it ends."""
        token = _current.set(record)
        try:
            yield record
        finally:
            _current.reset(token)
            if logger.isEnabledFor(logging.INFO):
                fields = record.fields()
                logger.info("%s", text_line(fields), extra={_FIELDS: fields})

    @contextlib.contextmanager
    def http(self, scope: Scope, route: str, receive: Receive, send: Send) -> Iterator[HttpExchange]:
        """One HTTP request: receive/send that count bytes and return its id; call `settle` once the app
        has answered, before the line is written as the block ends."""
        headers = Headers(scope=scope)
        client = scope.get("client")
        record = AccessRecord(request_id(headers.get(REQUEST_ID_HEADER)), "http", route, scope["method"],
                              f"{client[0]}:{client[1]}" if client else None, self.content)
        with self.request(record):
            yield HttpExchange(record, scope, receive, send)

    @contextlib.contextmanager
    def grpc(self, method: str, context: grpc.aio.ServicerContext) -> Iterator[AccessRecord]:
        """One RPC: its record; the id goes back in the trailing metadata (kept by an abort too)."""
        offered = next((value for name, value in context.invocation_metadata() or () if name == REQUEST_ID_HEADER),
                       None)
        record = AccessRecord(request_id(offered if isinstance(offered, str) else None), "grpc", f"grpc/{method}",
                              method, context.peer(), self.content)
        record.response_bytes = None
        context.set_trailing_metadata(record.metadata)
        with self.request(record):
            yield record


class HttpExchange:
    """receive/send wrappers for one HTTP request: bytes each way, the status, the id header."""

    def __init__(self, record: AccessRecord, scope: Scope, receive: Receive, send: Send) -> None:
        self.record = record
        self.scope = scope
        self._receive = receive
        self._send = send
        self._id_header = (REQUEST_ID_HEADER.encode(), record.request_id.encode())

    async def receive(self) -> Message:
        message = await self._receive()
        body = message.get("body", b"")
        self.record.request_bytes += len(body)
        self.record.keep_request(body)
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.record.status = message["status"]
            self.record.code = code_name(message["status"])
            message = {**message, "headers": [*message.get("headers", ()), self._id_header]}
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            self.record.response_bytes = (self.record.response_bytes or 0) + len(body)
            self.record.keep_response(body)
        await self._send(message)

    def settle(self) -> AccessRecord:
        """The record once the app is done: the caller authentication found, a streamed response's
        outcome (kiln/server/generation.py) rather than the 200 sent before it, and the 408 of a stalled
        body (kiln/server/http_connections.py) rather than the answer the app gave too late."""
        self.record.caller = self.scope.get(OWNER_SCOPE_KEY)
        self.record.status = self.scope.get(SENT_STATUS_KEY, self.record.status)
        self.record.code = self.scope.get(STATUS_KEY, self.record.code)
        return self.record
