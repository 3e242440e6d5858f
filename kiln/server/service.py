"""RuntimeService: what every transport (gRPC, HTTP) calls. It validates wire-level input into engine
types, scopes sessions to the caller's identity, and hands generations out as asyncio streams, so the
transports only translate formats and errors."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import re
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from kiln.engine.constraints import Constraint
from kiln.engine.sampler import SamplingParams
from kiln.engine.stream import DEFAULT_STALL_TIMEOUT_S, AsyncGenerationStream, Backpressure
from kiln.errors import InvalidArgumentError, KilnError
from kiln.llm import LLM
from kiln.models.facts import model_facts
from kiln.results import SessionInfo, SnapshotInfo
from kiln.server import access_log
from kiln.server.chat_sessions import Bindings
from kiln.server.quotas import MeteredStream, Quotas
from kiln.server.stored_responses import ResponseBook

T = TypeVar("T")

MAX_REQUEST_BYTES = 4 << 20  # largest request body on both transports: gRPC's own default receive limit
# Threads that submit session generates, or prepare a named session's turn, which may wait for their
# session's turn: their own pool, so waiting calls never hold the threads every other call runs on. More
# wait for a thread, their deadlines running.
SESSION_GENERATE_THREADS = 64


class ShuttingDownError(KilnError):
    """The server stopped admitting work (graceful shutdown); transports answer UNAVAILABLE / 503."""

    code = "UNAVAILABLE"


@dataclass(frozen=True)
class GenerateRequest:
    """Wire-level sampling options, as every transport receives them (None = default)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: Sequence[tuple[int, float]] = ()
    constraint: Constraint | None = None


def served_name(name: str) -> str:
    """A model name as an API id: lower case, no spaces ("Gemma 3 270m" -> "gemma-3-270m")."""
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-") or "model"


class RuntimeService:
    DEFAULT_MAX_TOKENS = 256

    def __init__(self, llm: LLM, model_name: str, aliases: Sequence[str] = (), quotas: Quotas | None = None,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        self.llm = llm
        self.backpressure = Backpressure(llm.engine.resume, stall_timeout_s)  # a client that stops reading
        self.quotas = quotas or Quotas.unlimited()  # per-key limits (kiln/server/quotas.py)
        self.model_name = model_name
        self.aliases = tuple(alias for alias in aliases if alias != model_name)
        self.accepting = True
        persistence = llm.persistence
        store = persistence.store if persistence is not None else None
        self.session_names = Bindings(store)  # named sessions of the OpenAI API
        self.responses = ResponseBook(store)  # the Responses API's stored responses
        self.session_threads = ThreadPoolExecutor(SESSION_GENERATE_THREADS, thread_name_prefix="kiln-session-generate")

    @property
    def sessions(self):  # noqa: ANN201 - the SessionStore
        return self.llm.sessions

    def _admit(self) -> None:
        if not self.accepting:
            raise ShuttingDownError("the server is shutting down and takes no new work")

    def _stream(self) -> MeteredStream:
        stream = MeteredStream(self.llm.engine.cancel)
        stream.hold_back(self.backpressure)
        return stream

    def sampling_params(self, request: GenerateRequest) -> SamplingParams:
        """Defaults filled in, limits checked against this model (max_tokens past the context window is
        refused rather than silently cut)."""
        max_tokens = self.DEFAULT_MAX_TOKENS if request.max_tokens is None else request.max_tokens
        if isinstance(max_tokens, int) and max_tokens > self.llm.engine.max_model_len:
            raise InvalidArgumentError(
                f"max_tokens {max_tokens} exceeds the model's context of {self.llm.engine.max_model_len}", "max_tokens"
            )
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            min_p=0.0 if request.min_p is None else request.min_p,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            presence_penalty=0.0 if request.presence_penalty is None else request.presence_penalty,
            frequency_penalty=0.0 if request.frequency_penalty is None else request.frequency_penalty,
            seed=request.seed,
            stop=tuple(request.stop),
            stop_token_ids=tuple(request.stop_token_ids),  # checked against the vocabulary on submit
            ignore_eos=request.ignore_eos,
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs,
            logit_bias=tuple(request.logit_bias),
            constraint=request.constraint,
        )

    @functools.cached_property
    def model_facts(self) -> dict[str, object]:
        """What /v1/models says of the served model besides its id, read once from its files' headers
        (kiln/models/facts.py); nothing when they can no longer be read."""
        try:
            return model_facts(self.llm.loaded.source).to_json()
        except KilnError:
            return {}

    # ---- sessions -----------------------------------------------------------------------------------

    def create_session(
        self, owner: str | None, tokens: Sequence[int] = (), ttl_s: float | None = None,
        kv_policy: str | None = None, kv_sink_tokens: int | None = None, kv_window_tokens: int | None = None,
    ) -> SessionInfo:
        self._admit()
        with self.quotas.new_session(owner):
            session_id = self.sessions.create(list(tokens), ttl_s, owner, kv_policy, kv_sink_tokens, kv_window_tokens)
        return self.sessions.info(session_id, owner)

    def append(self, owner: str | None, session_id: str, tokens: Sequence[int]) -> SessionInfo:
        self._admit()
        self.sessions.append(session_id, list(tokens), owner)
        return self.sessions.info(session_id, owner)

    async def generate(self, owner: str | None, session_id: str, request: GenerateRequest,
                       connection: str | None = None, timeout_s: float | None = None) -> AsyncGenerationStream:
        """Await on the event loop that consumes the stream. The submission itself (session and engine
        locks, and the wait for the session's turn, SessionStore.generate) runs on a worker thread: the
        loop never waits on a lock. `connection`: the transport's name for the connection the call came
        over (caller_of). `timeout_s`: the seconds left to the caller's deadline (None: it set none).
        The key's quotas are checked once it is this generate's turn, so a retry queued behind its
        cancelled predecessor is not refused for the slot that one still holds."""
        self._admit()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stream = self._stream()
        params = self.sampling_params(request)
        caller = caller_of(owner, connection)
        await submitted([stream], lambda: self.sessions.generate(
            session_id, params, owner, stream, caller, deadline=deadline,
            admit=lambda start: self.quotas.admitted(owner, [stream], start, session=True)), self.session_threads)
        return stream

    def fork(self, owner: str | None, session_id: str, at: int | None = None) -> SessionInfo:
        self._admit()
        with self.quotas.new_session(owner):
            return self.sessions.info(self.sessions.fork(session_id, at, owner), owner)

    def close(self, owner: str | None, session_id: str) -> None:
        self.sessions.close(session_id, owner)

    def info(self, owner: str | None, session_id: str) -> SessionInfo:
        return self.sessions.info(session_id, owner)

    def list_sessions(self, owner: str | None) -> list[SessionInfo]:
        return self.sessions.list(owner)

    def history(self, owner: str | None, session_id: str) -> list[int]:
        return self.sessions.tokens(session_id, owner)

    # ---- snapshots ----------------------------------------------------------------------------------

    def snapshot(self, owner: str | None, session_id: str) -> SnapshotInfo:
        self._admit()
        snapshots = self.llm.snapshots
        return snapshots.info(snapshots.snapshot(session_id, owner), owner)

    def restore(self, owner: str | None, snapshot_id: str) -> SessionInfo:
        self._admit()
        with self.quotas.new_session(owner):
            return self.sessions.info(self.llm.snapshots.restore(snapshot_id, owner), owner)

    def list_snapshots(self, owner: str | None) -> list[SnapshotInfo]:
        return self.llm.snapshots.list(owner)

    def snapshot_info(self, owner: str | None, snapshot_id: str) -> SnapshotInfo:
        return self.llm.snapshots.info(snapshot_id, owner)

    def delete_snapshot(self, owner: str | None, snapshot_id: str) -> None:
        self.llm.snapshots.delete(snapshot_id, owner)

    # ---- stateless ----------------------------------------------------------------------------------

    async def complete(self, tokens: Sequence[int], request: GenerateRequest, owner: str | None = None,
                       connection: str | None = None) -> AsyncGenerationStream:
        """A stateless generation: shares cached pages with any earlier request of the same prefix.
        Submitted from a worker thread, like `generate`."""
        self._admit()
        stream = self._stream()
        params = self.sampling_params(request)
        caller = caller_of(owner, connection)
        await submitted([stream], lambda: self.quotas.admitted(
            owner, [stream], lambda: self.llm.start(list(tokens), params, stream, caller)))
        return stream

    async def complete_choices(self, tokens: Sequence[int], request: GenerateRequest, n: int,
                               owner: str | None = None, connection: str | None = None) -> list[AsyncGenerationStream]:
        """`n` stateless generations of one prompt that compute it once (LLM.start_choices)."""
        self._admit()
        streams = [self._stream() for _ in range(n)]
        params = self.sampling_params(request)
        caller = caller_of(owner, connection)
        return await submitted(streams, lambda: self.quotas.admitted(
            owner, streams, lambda: self.llm.start_choices(list(tokens), params, streams, caller)))

    def tokenize(self, text: str, add_special_tokens: bool = False, param: str = "text") -> list[int]:
        """Text that cannot be tokenized (a lone surrogate) is refused naming `param`, its request field."""
        with naming(param):
            return self.llm.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.llm.tokenizer.decode(self.llm.engine.validate_tokens(list(token_ids)), skip_special_tokens)

    def health(self) -> dict[str, object]:
        """Lock-free: a probe answers while a step or a slow session operation holds a lock."""
        usage = self.llm.engine.kv_usage_nowait()
        return {
            "status": self._status(),
            "model": self.model_name,
            "vocab_size": self.llm.loaded.config.vocab_size,
            "max_model_len": self.llm.engine.max_model_len,
            "sessions": len(self.sessions),
            "kv_pages_used": usage.used,
            "kv_pages_cached": usage.cached,
            "kv_pages_free": usage.free,
        }

    def _status(self) -> str:
        if not self.llm.engine.alive:
            return "engine_failed"
        return "serving" if self.accepting else "shutting_down"

    def stop_admitting(self) -> None:
        self.accepting = False


def caller_of(owner: str | None, connection: str | None) -> str | None:
    """Whose share of the batch slots a generation takes (Request.caller): its API key's identity, or on
    a server without keys the connection it came over (the transport's name for it: HTTP's client
    address and port, gRPC's peer). Without keys nothing tells clients apart, so one that opens several
    connections has a share for each; SECURITY.md says so."""
    if owner is not None:
        return owner
    return None if connection is None else f"connection {connection}"


@contextlib.contextmanager
def naming(param: str) -> Iterator[None]:
    """An InvalidArgumentError raised inside that names no request field is about `param` (the
    tokenizer and the chat template know text, not which field it came from)."""
    try:
        yield
    except InvalidArgumentError as error:
        error.param = error.param or param
        raise


async def submitted(streams: Sequence[AsyncGenerationStream], submit: Callable[[], T], executor: Executor | None = None) -> T:
    """`submit()` (which may wait for the store and engine locks, or a session's turn) on a worker thread
    of `executor` (None: the loop's default), in the caller's context. Should the awaiting caller be
    cancelled meanwhile (its RPC cancelled, its client gone), or the submission fail, the streams are
    cancelled: a submission still waiting for its turn gives up, and a request the worker submits
    afterwards is cancelled as it is accepted (BaseStream remembers the cancel), so no orphaned
    generation keeps running or keeps a session busy."""
    access_log.track(streams)  # the request's log line counts their tokens
    try:
        return await asyncio.get_running_loop().run_in_executor(executor, contextvars.copy_context().run, submit)
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
