"""HTTP requests handed on over Ray from one of the fleet's replicas to another (docs/architecture.md § Fleet).

The replica Ray's proxy gave the request to turns it into an HttpRequest (plain, picklable data); the one
the router picks runs it through the same ASGI app `kiln serve` serves (kiln/server/http.py: the guard,
keys, OpenAI API, REST) and streams the answer back as one ResponseHead, then the body's pieces, so
server-sent events stay streamed.
When the caller goes away (Ray cancels the stream), the app sees the client disconnect, as under uvicorn,
and cancels its generation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

REPLICA_HEADER = b"x-kiln-replica"  # names the replica that answered, on every response through the fleet


@dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]  # as received, lower-case names
    body: bytes
    client: tuple[str, int] | None  # the peer's address (per-address limits count it)


@dataclass(frozen=True)
class ResponseHead:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]


async def call_asgi(app: Callable, request: HttpRequest,
                    extra_headers: tuple[tuple[bytes, bytes], ...] = ()) -> AsyncIterator[ResponseHead | bytes]:
    """Run one request through an ASGI app: its ResponseHead (with `extra_headers` added), then its body."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
        "query_string": request.query_string, "root_path": "", "headers": list(request.headers),
        "client": request.client, "server": ("127.0.0.1", 0),
    }
    messages: asyncio.Queue[dict | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    task = asyncio.create_task(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseHead(message["status"], (*((bytes(k), bytes(v)) for k, v in message.get("headers", ())),
                                                       *extra_headers))
            elif message["type"] == "http.response.body":
                if body := message.get("body", b""):
                    yield bytes(body)
                if not message.get("more_body", False):
                    break
    finally:
        gone.set()  # the app's disconnect listener ends a stream whose caller left
        with contextlib.suppress(asyncio.CancelledError):
            await task
