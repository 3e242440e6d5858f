"""The asyncio Python SDK: AsyncClient -> AsyncSession -> AsyncGeneration, the surface of sync.Client
with awaits. Create the client on the event loop that uses it.

    async with AsyncClient("127.0.0.1:50051", api_key=key) as client:
        session = await client.create_session(token_ids)
        async for token_id in await session.generate(max_tokens=16):
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any, TypeVar

import grpc
import grpc.aio

from kiln.errors import NotFoundError
from kiln.results import GenerationResult, SessionInfo, SnapshotInfo
from kiln.text import TextAssembler
from kiln.v1 import rpc
from kiln.v1 import runtime_pb2 as pb

from . import channel, wire
from .errors import check_timeout, error_for, require_open, typed_errors
from .generation import BaseGeneration, idle_polls
from .text import decode_locally, encode_locally, opt_in, require, uses_server

R = TypeVar("R")


class AsyncClient:
    """A connection to a Kiln server for asyncio code; see sync.Client for the options."""

    def __init__(self, address: str, api_key: str | None = None, tokenizer: Any = None, *, tls: bool = False,
                 ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
                 timeout_s: float | None = None) -> None:
        self.address = address
        self.tokenizer = opt_in(tokenizer)
        self._metadata = wire.auth_metadata(api_key)
        self.timeout_s = check_timeout(timeout_s)  # every call's deadline unless the call names its own
        self._channel = channel.open_channel(address, channel.ChannelSecurity.from_options(tls, ca_file, cert_file, key_file),
                                             aio=True)
        self._open_stub: SimpleNamespace | None = rpc.stub(self._channel)

    async def create_session(
        self, tokens: Iterable[int] | None = None, ttl_s: float | None = None, *,
        kv_policy: str | None = None, kv_sink_tokens: int | None = None, kv_window_tokens: int | None = None,
        timeout_s: float | None = None,
    ) -> AsyncSession:
        """As Client.create_session."""
        request = wire.message(pb.CreateSessionRequest, token_ids=wire.token_ids(tokens), ttl_s=ttl_s, kv_policy=kv_policy,
                               kv_sink_tokens=kv_sink_tokens, kv_window_tokens=kv_window_tokens)
        return AsyncSession(self, (await self._call(self._stub.CreateSession, request, timeout_s)).session.session_id)

    async def get_session(self, session_id: str, *, timeout_s: float | None = None) -> AsyncSession:
        """Reattach to a session by id (e.g. after this process restarted); NotFoundError if it is gone."""
        await self._call(self._stub.GetSessionInfo, wire.message(pb.GetSessionInfoRequest, session_id=session_id), timeout_s)
        return AsyncSession(self, session_id)

    async def list_sessions(self, *, timeout_s: float | None = None) -> list[SessionInfo]:
        """This API key's sessions: those in memory, least recently used first, then (on a server that
        persists sessions) those saved but not in memory, `resident` False, brought back by their next use."""
        reply = await self._call(self._stub.ListSessions, pb.ListSessionsRequest(), timeout_s)
        return [wire.session_info(s) for s in reply.sessions]

    async def restore_session(self, snapshot_id: str, *, timeout_s: float | None = None) -> AsyncSession:
        """A new session with a snapshot's history and K/V (FailedPreconditionError if it fails
        verification: another model or KV format, a corrupt page)."""
        request = wire.message(pb.RestoreSessionRequest, snapshot_id=snapshot_id)
        return AsyncSession(self, (await self._call(self._stub.RestoreSession, request, timeout_s)).session.session_id)

    async def list_snapshots(self, *, timeout_s: float | None = None) -> list[SnapshotInfo]:
        """This API key's checkpoints, oldest first."""
        reply = await self._call(self._stub.ListSnapshots, pb.ListSnapshotsRequest(), timeout_s)
        return [wire.snapshot_info(s) for s in reply.snapshots]

    async def delete_snapshot(self, snapshot_id: str, *, timeout_s: float | None = None) -> None:
        await self._call(self._stub.DeleteSnapshot, wire.message(pb.DeleteSnapshotRequest, snapshot_id=snapshot_id), timeout_s)

    async def tokenize(self, text: str, add_special_tokens: bool = False, *, timeout_s: float | None = None) -> list[int]:
        """Token ids of `text` by the server's tokenizer."""
        request = wire.message(pb.TokenizeRequest, text=text, add_special_tokens=add_special_tokens)
        return list((await self._call(self._stub.Tokenize, request, timeout_s)).token_ids)

    async def detokenize(self, token_ids: Iterable[int], skip_special_tokens: bool = False, *, timeout_s: float | None = None) -> str:
        """Text of token ids by the server's tokenizer."""
        request = wire.message(pb.DetokenizeRequest, token_ids=wire.token_ids(token_ids),
                               skip_special_tokens=skip_special_tokens)
        return (await self._call(self._stub.Detokenize, request, timeout_s)).text

    async def health(self, *, timeout_s: float | None = None) -> wire.Health:
        return wire.health(await self._call(self._stub.Health, pb.HealthRequest(), timeout_s))

    async def close(self) -> None:
        """Closes the channel; later calls raise FailedPreconditionError (sessions live on in the server
        until closed or evicted)."""
        self._open_stub = None
        await self._channel.close()

    @property
    def _stub(self) -> SimpleNamespace:
        return require_open(self._open_stub)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: Callable[..., Awaitable[R]], request: object, timeout_s: float | None = None) -> R:
        with typed_errors():
            return await method(request, metadata=self._metadata, timeout=self._timeout(timeout_s))

    def _timeout(self, timeout_s: float | None) -> float | None:
        return self.timeout_s if timeout_s is None else check_timeout(timeout_s)

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        require(self.tokenizer, "append_text")
        if uses_server(self.tokenizer):
            return await self.tokenize(text, add_special_tokens)
        return encode_locally(self.tokenizer, text, add_special_tokens)

    async def _decode(self, token_ids: list[int]) -> str:
        if uses_server(self.tokenizer):
            return await self.detokenize(token_ids, skip_special_tokens=True)
        return decode_locally(self.tokenizer, token_ids)


class AsyncSession:
    """One server session, by id (`session.id`); see sync.Session. `async with` closes it at the end."""

    def __init__(self, client: AsyncClient, session_id: str) -> None:
        self.client = client
        self.id = session_id

    async def append(self, token_ids: Iterable[int], *, timeout_s: float | None = None) -> SessionInfo:
        """Appends to the history (computed by the next generate); returns the session after it."""
        request = wire.message(pb.AppendTokensRequest, session_id=self.id, token_ids=wire.token_ids(token_ids))
        return wire.session_info((await self.client._call(self.client._stub.AppendTokens, request, timeout_s)).session)

    async def append_text(self, text: str, *, timeout_s: float | None = None) -> SessionInfo:
        """Tokenizes with the client's opted-in tokenizer (special tokens such as BOS only at the very
        start of a history) and appends."""
        first = (await self.info(timeout_s=timeout_s)).history_tokens == 0
        return await self.append(await self.client._encode(text, add_special_tokens=first), timeout_s=timeout_s)

    async def generate(
        self,
        max_tokens: int | None = None,
        temperature: float = 0.0,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        *,
        stop_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        logprobs: bool = False,
        json_schema: Mapping[str, Any] | str | None = None,
        regex: str | None = None,
        grammar: str | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        timeout_s: float | None = None,
    ) -> AsyncGeneration:
        """Continues the history; returns once the server accepted (refusals raise here), then iterate
        with `async for` for token ids as they commit. max_tokens None: the server's default (256). At most one of
        json_schema (a dict or JSON text), regex and grammar (Lark) constrains the generated text. min_p and
        the penalties (repetition: HF/vLLM's, presence and frequency: OpenAI's) as in the proto; None: off. `timeout_s`
        bounds the whole call, stream included (past it, DeadlineExceededError); the client's default
        does not apply, as it is meant for quick calls. A generate behind another on the session waits its
        turn on the server, as does one right after a deadline or cancel (until the server stopped that one)."""
        request = wire.generate_request(self.id, max_tokens, temperature, top_p, top_k, seed, stop,
                                        stop_token_ids, ignore_eos, logprobs, json_schema, regex, grammar,
                                        min_p=min_p, repetition_penalty=repetition_penalty,
                                        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)
        return await AsyncGeneration.start(self, self.client._stub.Generate(request, metadata=self.client._metadata,
                                                          timeout=check_timeout(timeout_s)))

    async def generate_text(self, max_tokens: int | None = None, **options: Any) -> AsyncIterator[str]:
        """Like generate() (same options), yielding text as it becomes final: multi-byte characters
        whole, the reply cut before a matched stop string. Needs the client's opted-in tokenizer."""
        require(self.client.tokenizer, "generate_text")
        assembler = TextAssembler(wire.stop_strings(options.get("stop")))
        async with await self.generate(max_tokens, **options) as generation:
            async for chunk in generation.chunks():
                assembler.add(chunk)
                while (ids := assembler.to_decode()) is not None:
                    if piece := assembler.decoded(await self.client._decode(ids)):
                        yield piece
            if rest := assembler.finish(generation.stop_string):
                yield rest

    async def fork(self, at: int | None = None, *, timeout_s: float | None = None) -> AsyncSession:
        """A new session sharing the first `at` tokens (None: all) of this history, and their K/V."""
        request = wire.message(pb.ForkSessionRequest, session_id=self.id, at=at)
        reply = await self.client._call(self.client._stub.ForkSession, request, timeout_s)
        return AsyncSession(self.client, reply.session.session_id)

    async def snapshot(self, *, timeout_s: float | None = None) -> str:
        """Save this (idle) session as a checkpoint; returns its id once it is durable."""
        request = wire.message(pb.SnapshotSessionRequest, session_id=self.id)
        return (await self.client._call(self.client._stub.SnapshotSession, request, timeout_s)).snapshot.snapshot_id

    async def info(self, *, timeout_s: float | None = None) -> SessionInfo:
        request = wire.message(pb.GetSessionInfoRequest, session_id=self.id)
        return wire.session_info((await self.client._call(self.client._stub.GetSessionInfo, request, timeout_s)).session)

    async def close(self, *, timeout_s: float | None = None) -> None:
        """Ends the session and frees its K/V; later calls on it raise NotFoundError."""
        request = wire.message(pb.CloseSessionRequest, session_id=self.id)
        await self.client._call(self.client._stub.CloseSession, request, timeout_s)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(NotFoundError):  # already closed or evicted: gone either way
            await self.close()

    async def _wait_idle(self) -> None:
        for pause in idle_polls(self.id):
            try:
                if not (await self.info()).generating:
                    return
            except NotFoundError:
                return
            await asyncio.sleep(pause)


class AsyncGeneration(BaseGeneration):
    """The token ids of one generation as they commit: `async for token_id in generation`; see
    sync.Generation."""

    def __init__(self, session: AsyncSession, call: grpc.aio.UnaryStreamCall) -> None:
        super().__init__()
        self._session = session
        self._call = call

    @classmethod
    async def start(cls, session: AsyncSession, call: grpc.aio.UnaryStreamCall) -> AsyncGeneration:
        """Waits for the server to accept the generation (initial metadata) or refuse it (raised)."""
        generation = cls(session, call)
        await call.initial_metadata()
        if call.done() and (code := await call.code()) != grpc.StatusCode.OK:
            raise error_for(code, await call.details())
        return generation

    def __aiter__(self) -> AsyncIterator[int]:
        return self

    async def __anext__(self) -> int:
        while not self._pending:
            if not await self._receive():
                raise StopAsyncIteration
        return self._pending.popleft()

    async def chunks(self) -> AsyncIterator[list[int]]:
        """Token ids in the groups they arrived in (every token ready when the server sent them)."""
        while self._pending or await self._receive():
            if self._pending:
                yield self._take()

    async def result(self) -> GenerationResult:
        """Waits for the end and summarises the generation; CancelledError if it was cancelled here."""
        async for _ in self.chunks():
            pass
        return self._result()

    async def cancel(self) -> None:
        """Stops the generation and returns once the server has freed the session for the next call.
        Tokens generated before the cancel took effect stay in the history (see info())."""
        if self._mark_cancelled():
            self._call.cancel()
            await self._session._wait_idle()

    async def __aenter__(self) -> AsyncGeneration:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.cancel()

    async def _receive(self) -> bool:
        """Reads the next event; False once nothing more will come."""
        if self._done:
            return False
        try:
            event = await self._call.read()
        except grpc.RpcError as error:
            if self._cancelled:
                return False
            raise error_for(error.code(), error.details()) from None
        except asyncio.CancelledError:  # a cancelled call cancels its reader too
            if not asyncio.current_task().cancelling():
                if self._cancelled:
                    return False
                require_open(self._session.client._open_stub)  # closing the client cancelled the call
            raise
        if event is grpc.aio.EOF:
            self._stream_closed()
            return False
        self._add(event)
        return True
