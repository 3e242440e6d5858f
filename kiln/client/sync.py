"""The blocking Python SDK: Client -> Session -> Generation, over one gRPC channel.

    with Client("127.0.0.1:50051", api_key=key) as client:
        session = client.create_session(token_ids)
        for token_id in session.generate(max_tokens=16):
            ...

Every failure raises the typed error of kiln.errors (NotFoundError, InvalidArgumentError, ...). A Client
may be shared between threads; aio.AsyncClient is the same surface for asyncio.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any, TypeVar

import grpc

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


class Client:
    """A connection to a Kiln server. `api_key` is sent as `authorization: Bearer <key>`. `tokenizer`
    opts in to text helpers (append_text, generate_text): "server" for the server's tokenizer, or a
    local one with encode()/decode(); by default the client deals in token ids only. `tls=True` connects
    over TLS trusting the system's roots; `ca_file` trusts that CA instead (and implies TLS); `cert_file`
    + `key_file` present a client certificate (see channel.py). `timeout_s` is the default deadline of every
    unary call (a call's own `timeout_s=` overrides it; a generate has only its own): past it the call
    raises DeadlineExceededError."""

    def __init__(self, address: str, api_key: str | None = None, tokenizer: Any = None, *, tls: bool = False,
                 ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
                 timeout_s: float | None = None) -> None:
        self.address = address
        self.tokenizer = opt_in(tokenizer)
        self._metadata = wire.auth_metadata(api_key)
        self.timeout_s = check_timeout(timeout_s)  # every call's deadline unless the call names its own
        self._channel = channel.open_channel(address, channel.ChannelSecurity.from_options(tls, ca_file, cert_file, key_file))
        self._open_stub: SimpleNamespace | None = rpc.stub(self._channel)

    def create_session(
        self, tokens: Iterable[int] | None = None, ttl_s: float | None = None, *,
        kv_policy: str | None = None, kv_sink_tokens: int | None = None, kv_window_tokens: int | None = None,
        timeout_s: float | None = None,
    ) -> Session:
        """A new session with an optional initial history and idle TTL (seconds; None: the server's), and
        optionally its own KV policy ("full", "sink_window", "restore"; None: the server's settings)."""
        request = wire.message(pb.CreateSessionRequest, token_ids=wire.token_ids(tokens), ttl_s=ttl_s, kv_policy=kv_policy,
                               kv_sink_tokens=kv_sink_tokens, kv_window_tokens=kv_window_tokens)
        return Session(self, self._call(self._stub.CreateSession, request, timeout_s).session.session_id)

    def get_session(self, session_id: str, *, timeout_s: float | None = None) -> Session:
        """Reattach to a session by id (e.g. after this process restarted); NotFoundError if it is gone."""
        self._call(self._stub.GetSessionInfo, wire.message(pb.GetSessionInfoRequest, session_id=session_id), timeout_s)
        return Session(self, session_id)

    def list_sessions(self, *, timeout_s: float | None = None) -> list[SessionInfo]:
        """This API key's sessions: those in memory, least recently used first, then (on a server that
        persists sessions) those saved but not in memory, `resident` False, brought back by their next use."""
        return [wire.session_info(s) for s in self._call(self._stub.ListSessions, pb.ListSessionsRequest(), timeout_s).sessions]

    def restore_session(self, snapshot_id: str, *, timeout_s: float | None = None) -> Session:
        """A new session with a snapshot's history and K/V (FailedPreconditionError if it fails
        verification: another model or KV format, a corrupt page)."""
        request = wire.message(pb.RestoreSessionRequest, snapshot_id=snapshot_id)
        return Session(self, (self._call(self._stub.RestoreSession, request, timeout_s)).session.session_id)

    def list_snapshots(self, *, timeout_s: float | None = None) -> list[SnapshotInfo]:
        """This API key's checkpoints, oldest first."""
        reply = self._call(self._stub.ListSnapshots, pb.ListSnapshotsRequest(), timeout_s)
        return [wire.snapshot_info(s) for s in reply.snapshots]

    def delete_snapshot(self, snapshot_id: str, *, timeout_s: float | None = None) -> None:
        self._call(self._stub.DeleteSnapshot, wire.message(pb.DeleteSnapshotRequest, snapshot_id=snapshot_id), timeout_s)

    def tokenize(self, text: str, add_special_tokens: bool = False, *, timeout_s: float | None = None) -> list[int]:
        """Token ids of `text` by the server's tokenizer."""
        request = wire.message(pb.TokenizeRequest, text=text, add_special_tokens=add_special_tokens)
        return list(self._call(self._stub.Tokenize, request, timeout_s).token_ids)

    def detokenize(self, token_ids: Iterable[int], skip_special_tokens: bool = False, *, timeout_s: float | None = None) -> str:
        """Text of token ids by the server's tokenizer."""
        request = wire.message(pb.DetokenizeRequest, token_ids=wire.token_ids(token_ids),
                               skip_special_tokens=skip_special_tokens)
        return self._call(self._stub.Detokenize, request, timeout_s).text

    def health(self, *, timeout_s: float | None = None) -> wire.Health:
        return wire.health(self._call(self._stub.Health, pb.HealthRequest(), timeout_s))

    def close(self) -> None:
        """Closes the channel; later calls raise FailedPreconditionError (sessions live on in the server
        until closed or evicted)."""
        self._open_stub = None
        self._channel.close()

    @property
    def _stub(self) -> SimpleNamespace:
        return require_open(self._open_stub)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: Callable[..., R], request: object, timeout_s: float | None = None) -> R:
        with typed_errors():
            return method(request, metadata=self._metadata, timeout=self._timeout(timeout_s))

    def _timeout(self, timeout_s: float | None) -> float | None:
        return self.timeout_s if timeout_s is None else check_timeout(timeout_s)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        require(self.tokenizer, "append_text")
        if uses_server(self.tokenizer):
            return self.tokenize(text, add_special_tokens)
        return encode_locally(self.tokenizer, text, add_special_tokens)

    def _decode(self, token_ids: list[int]) -> str:
        if uses_server(self.tokenizer):
            return self.detokenize(token_ids, skip_special_tokens=True)
        return decode_locally(self.tokenizer, token_ids)


class Session:
    """One server session, by id (`session.id`): an append-only history of token ids whose K/V the
    server keeps between calls. Using it as a context manager closes it at the end."""

    def __init__(self, client: Client, session_id: str) -> None:
        self.client = client
        self.id = session_id

    def append(self, token_ids: Iterable[int], *, timeout_s: float | None = None) -> SessionInfo:
        """Appends to the history (computed by the next generate); returns the session after it."""
        request = wire.message(pb.AppendTokensRequest, session_id=self.id, token_ids=wire.token_ids(token_ids))
        return wire.session_info(self.client._call(self.client._stub.AppendTokens, request, timeout_s).session)

    def append_text(self, text: str, *, timeout_s: float | None = None) -> SessionInfo:
        """Tokenizes with the client's opted-in tokenizer (special tokens such as BOS only at the very
        start of a history) and appends."""
        first = self.info(timeout_s=timeout_s).history_tokens == 0
        return self.append(self.client._encode(text, add_special_tokens=first), timeout_s=timeout_s)

    def generate(
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
    ) -> Generation:
        """Continues the history; returns once the server accepted (refusals raise here), then iterate
        for token ids as they commit. max_tokens None: the server's default (256). At most one of
        json_schema (a dict or JSON text), regex and grammar (Lark) constrains the generated text. min_p and
        the penalties (repetition: HF/vLLM's, presence and frequency: OpenAI's) as in the proto; None: off. `timeout_s`
        bounds the whole call, stream included (past it, DeadlineExceededError); the client's default
        does not apply, as it is meant for quick calls. A generate behind another on the session waits its
        turn on the server, as does one right after a deadline or cancel (until the server stopped that one)."""
        request = wire.generate_request(self.id, max_tokens, temperature, top_p, top_k, seed, stop,
                                        stop_token_ids, ignore_eos, logprobs, json_schema, regex, grammar,
                                        min_p=min_p, repetition_penalty=repetition_penalty,
                                        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)
        return Generation(self, self.client._stub.Generate(request, metadata=self.client._metadata,
                                                       timeout=check_timeout(timeout_s)))

    def generate_text(self, max_tokens: int | None = None, **options: Any) -> Iterator[str]:
        """Like generate() (same options), yielding text as it becomes final: multi-byte characters
        whole, the reply cut before a matched stop string. Needs the client's opted-in tokenizer."""
        require(self.client.tokenizer, "generate_text")
        assembler = TextAssembler(wire.stop_strings(options.get("stop")))
        with self.generate(max_tokens, **options) as generation:
            for chunk in generation.chunks():
                assembler.add(chunk)
                while (ids := assembler.to_decode()) is not None:
                    if piece := assembler.decoded(self.client._decode(ids)):
                        yield piece
            if rest := assembler.finish(generation.stop_string):
                yield rest

    def fork(self, at: int | None = None, *, timeout_s: float | None = None) -> Session:
        """A new session sharing the first `at` tokens (None: all) of this history, and their K/V."""
        request = wire.message(pb.ForkSessionRequest, session_id=self.id, at=at)
        return Session(self.client, self.client._call(self.client._stub.ForkSession, request, timeout_s).session.session_id)

    def snapshot(self, *, timeout_s: float | None = None) -> str:
        """Save this (idle) session as a checkpoint; returns its id once it is durable."""
        request = wire.message(pb.SnapshotSessionRequest, session_id=self.id)
        return (self.client._call(self.client._stub.SnapshotSession, request, timeout_s)).snapshot.snapshot_id

    def info(self, *, timeout_s: float | None = None) -> SessionInfo:
        request = wire.message(pb.GetSessionInfoRequest, session_id=self.id)
        return wire.session_info(self.client._call(self.client._stub.GetSessionInfo, request, timeout_s).session)

    def close(self, *, timeout_s: float | None = None) -> None:
        """Ends the session and frees its K/V; later calls on it raise NotFoundError."""
        self.client._call(self.client._stub.CloseSession, wire.message(pb.CloseSessionRequest, session_id=self.id), timeout_s)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(NotFoundError):  # already closed or evicted: gone either way
            self.close()

    def _wait_idle(self) -> None:
        for pause in idle_polls(self.id):
            try:
                if not self.info().generating:
                    return
            except NotFoundError:
                return
            time.sleep(pause)


class Generation(BaseGeneration):
    """The token ids of one generation as they commit: `for token_id in generation`. Afterwards
    finish_reason, usage (what was reused vs prefilled) and result() tell how it went. Leaving early:
    cancel(), or use it as a context manager."""

    def __init__(self, session: Session, call: grpc.Call) -> None:
        super().__init__()
        self._session = session
        self._call = call
        call.initial_metadata()  # sent once the server accepted the generation, or with its refusal
        if call.done() and call.code() != grpc.StatusCode.OK:
            raise error_for(call.code(), call.details())

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        while not self._pending:
            if not self._receive():
                raise StopIteration
        return self._pending.popleft()

    def chunks(self) -> Iterator[list[int]]:
        """Token ids in the groups they arrived in (every token ready when the server sent them)."""
        while self._pending or self._receive():
            if self._pending:
                yield self._take()

    def result(self) -> GenerationResult:
        """Waits for the end and summarises the generation; CancelledError if it was cancelled here."""
        for _ in self.chunks():
            pass
        return self._result()

    def cancel(self) -> None:
        """Stops the generation and returns once the server has freed the session for the next call.
        Tokens generated before the cancel took effect stay in the history (see info())."""
        if self._mark_cancelled():
            self._call.cancel()
            self._session._wait_idle()

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def _receive(self) -> bool:
        """Reads the next event; False once nothing more will come."""
        if self._done:
            return False
        try:
            event = next(self._call)
        except StopIteration:
            self._stream_closed()
            return False
        except grpc.RpcError as error:
            if self._cancelled:
                return False
            require_open(self._session.client._open_stub)  # closing the client ended the stream
            raise error_for(error.code(), error.details()) from None
        self._add(event)
        return True
