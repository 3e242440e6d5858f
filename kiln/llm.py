"""LLM: the in-process Python API. One engine, one session store, the model's tokenizer."""

from __future__ import annotations

import logging
import numbers
import os
import threading
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from kiln.config import EngineConfig
from kiln.engine.constraints import Constraint
from kiln.engine.engine import Engine
from kiln.engine.sampler import SEED_RANGE, SamplingParams
from kiln.engine.sequence import Event, FinishEvent, Sequence
from kiln.engine.stream import BaseStream, GenerationStream
from kiln.errors import FailedPreconditionError, InvalidArgumentError, KilnError
from kiln.heap import release_free_memory
from kiln.models.loader import LoadedModel, load_model
from kiln.results import SessionInfo, SnapshotInfo, Usage
from kiln.sessions import SessionStore
from kiln.snapshots.ownership import Ownership
from kiln.snapshots.persistence import Persistence
from kiln.snapshots.prefix_store import PrefixStore
from kiln.snapshots.store import open_store
from kiln.text import TextDeltas
from kiln.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
S = TypeVar("S", bound=BaseStream)
CONSTRAINT_OPTIONS = ("json_schema", "regex", "grammar")  # keywords that constrain the generated text


@dataclass(frozen=True)
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated
    text: str  # generated text, cut before a matched stop string
    finish_reason: str
    usage: Usage
    logprobs: list[float] | None


class LLM:
    """`LLM()` serves the embedded Gemma 3 270M; `LLM("smollm2-135m-instruct")` another model by name
    (kiln/models/catalog.py), `LLM("dir_or.gguf")` by path. Keyword options are EngineConfig fields
    (page_size, kv_budget_bytes, ...)."""

    def __init__(self, model: str | Path | None = None, *, loaded: LoadedModel | None = None, **options: object) -> None:
        self.config = EngineConfig.from_kwargs(model=None if model is None else str(model), **options)
        cache_dir = Path(self.config.cache_dir) if self.config.cache_dir else None
        self.loaded = loaded or load_model(self.config.model, cache_dir=cache_dir)
        self.engine = Engine(self.config, self.loaded)
        target = self.config.snapshot_store or self.config.snapshot_dir
        self.persistence = self._persistence(target) if target else None
        self.prefix_store = self._prefix_store()
        self.sessions = SessionStore(self.engine, self.config.max_sessions, self.config.session_ttl_s, self.persistence)
        if self.persistence is not None:
            _close_at_exit(self)
        release_free_memory()  # what loading freed (kiln/heap.py says why)

    def _persistence(self, target: str) -> Persistence:
        store = open_store(target)
        return Persistence(store, self.engine, Ownership(store, self.config.instance_id, self.config.lease_ttl_s))

    def _prefix_store(self) -> PrefixStore | None:
        """The persistent prefix store over persistence's snapshot store (off without one, or at 0 MiB)."""
        if self.persistence is None or not self.config.prefix_store_mb:
            return None
        prefix_store = PrefixStore.for_engine(self.persistence.store, self.engine, self.config.prefix_store_mb * 2**20)
        self.engine.use_prefix_store(prefix_store)
        return prefix_store

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    def generate(
        self, prompts: str | Seq[int] | Seq[str | Seq[int]], params: SamplingParams | None = None, **overrides: object
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, encoded with BOS, or token ids) together in one batch."""
        params = _params(params, overrides)
        items = [prompts] if isinstance(prompts, str) else list(prompts)
        batch = [items] if items and isinstance(items[0], numbers.Integral) else items
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else self.engine.validate_tokens(p) for p in batch]
        for tokens in token_lists:  # refuse the whole batch before any of it runs
            self.engine.check_request(len(tokens), params)
        streams = [self.start(tokens, params, GenerationStream(self.engine.cancel)) for tokens in token_lists]
        return [self._output(tokens, stream) for tokens, stream in zip(token_lists, streams, strict=True)]

    def start(self, token_ids: Seq[int], params: SamplingParams, stream: S, caller: str | None = None) -> S:
        """Start one stateless generation (prefix-cached, released when done) streaming into `stream`;
        `caller`: whose share of the batch slots it takes (Engine.submit)."""
        stream.request = self.engine.submit(self.engine.new_sequence(token_ids, session=False), params, stream.emit, caller)
        return stream

    def start_choices(self, token_ids: Seq[int], params: SamplingParams, streams: Seq[S],
                      caller: str | None = None) -> list[S]:
        """Several generations of one prompt (OpenAI's `n`) that compute it once: the first prefills it;
        at its first token each other one forks its sequence at the prompt's end (sharing the full pages,
        copying the partial last one), so a choice recomputes only the prompt's last token. With a seed,
        choice i samples with seed + i: seeded choices differ from each other and are reproducible."""
        first, rest = streams[0], list(streams[1:])
        parent = self.engine.new_sequence(token_ids, session=False)
        prompt = len(parent.tokens)
        forked = False

        def emit(event: Event) -> None:  # engine thread, engine lock not held
            nonlocal forked
            if not forked:
                forked = True
                for index, stream in enumerate(rest, start=1):
                    self._fork_choice(parent, prompt, _choice_params(params, index), stream, event, caller)
            first.emit(event)

        first.request = self.engine.submit(parent, params, emit, caller)
        return [first, *rest]

    def _fork_choice(self, parent: Sequence, prompt: int, params: SamplingParams, stream: S, first: Event,
                     caller: str | None) -> None:
        """Start one more choice from the first choice's first event: a fork once the prompt is computed;
        the same ending if the first ended before any token (cancelled, failed)."""
        if isinstance(first, FinishEvent):
            stream.emit(FinishEvent(first.reason, Usage(prompt, 0, 0, 0), error=first.error))
            return
        try:
            child = self.engine.fork_sequence(parent, prompt)
            stream.request = self.engine.submit(child, params, stream.emit, caller)
            self.engine.release_sequence(child)  # stateless: its pages go back when its request ends
        except KilnError as error:
            stream.emit(FinishEvent("error", Usage(prompt, 0, 0, 0), error=error))

    def _output(self, prompt: list[int], stream: GenerationStream) -> RequestOutput:
        result = stream.result()
        text = self.tokenizer.decode(result.token_ids)
        if result.stop_string:
            text = text[: text.find(result.stop_string)]
        return RequestOutput(prompt, result.token_ids, text, result.finish_reason, result.usage, result.logprobs)

    def create_session(
        self, tokens: Seq[int] | None = None, ttl_s: float | None = None, *,
        kv_policy: str | None = None, kv_sink_tokens: int | None = None, kv_window_tokens: int | None = None,
    ) -> Session:
        """A new session; kv_* override the engine's KV policy for this session (EngineConfig fields)."""
        return Session(self, self.sessions.create(tokens, ttl_s, None, kv_policy, kv_sink_tokens, kv_window_tokens))

    def get_session(self, session_id: str) -> Session:
        self.sessions.info(session_id)  # NotFoundError if it is gone (restored first if persisted)
        return Session(self, session_id)

    def restore_session(self, snapshot_id: str) -> Session:
        """A new session with a snapshot's history and K/V (verified before anything is loaded)."""
        return Session(self, self.sessions.restore(snapshot_id, None))

    def list_snapshots(self) -> list[SnapshotInfo]:
        return self.snapshots.list(None)

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.snapshots.delete(snapshot_id, None)

    @property
    def snapshots(self) -> Snapshots:
        """The checkpoint service; FailedPreconditionError when persistence is off."""
        if self.persistence is None:
            raise FailedPreconditionError("snapshots are off: set snapshot_dir or snapshot_store")
        return Snapshots(self.sessions, self.persistence)

    def close(self) -> None:
        """Stop the engine; with persistence, finish every queued save (and any checkpoint under way)
        and hand the sessions off before the store is released. An LLM with persistence that is never
        closed is closed so when the interpreter exits (`_close_at_exit`)."""
        with _unclosed_lock:
            _unclosed.discard(self)
        self.engine.shutdown()
        self.sessions.close_all()
        if self.prefix_store is not None:
            self.prefix_store.close()
            self.prefix_store = None
        if self.persistence is not None:
            self.persistence.close()
            self.persistence = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_unclosed: set[LLM] = set()  # LLMs with persistence that close() has not closed yet
_unclosed_lock = threading.Lock()
_exit_hooked = False


def _close_at_exit(llm: LLM) -> None:
    """Close `llm` when the interpreter exits, unless close() did first. A script that ends after its last
    turn without close() would otherwise lose the saves still queued (the saver's encoding pool refuses
    work once the interpreter shuts down) and leave its sessions leased to a dead process. The hook runs
    where executors stop (a threading exit hook, before non-daemon threads are joined; an `atexit` one runs
    after executors refuse work), registered after theirs so it runs first, and it takes as long as
    close() may: one attempt per queued save, failed ones retried for up to close_timeout_s."""
    global _exit_hooked
    with _unclosed_lock:
        if not _exit_hooked:
            threading._register_atexit(_close_unclosed)  # CPython's hook for the same need of concurrent.futures
            os.register_at_fork(after_in_child=_unclosed.clear)  # a forked child owns none of their threads
            _exit_hooked = True
        _unclosed.add(llm)


def _close_unclosed() -> None:
    with _unclosed_lock:
        left = list(_unclosed)
    for llm in left:
        try:
            llm.close()
        except Exception:  # noqa: BLE001 - an error here would skip the other exit hooks (executors' too)
            logger.exception("closing an LLM at interpreter exit failed; its sessions' leases lapse after their TTL")


@dataclass(frozen=True)
class Snapshots:
    """Checkpoints of sessions, as `LLM.snapshots` and the servers use them: taking and restoring one
    involves live sessions (the SessionStore), listing and deleting only the store (Persistence)."""

    sessions: SessionStore
    persistence: Persistence

    def snapshot(self, session_id: str, owner: str | None) -> str:
        """A checkpoint of an idle session; returns its id once it is durable."""
        return self.sessions.snapshot(session_id, owner)

    def restore(self, snapshot_id: str, owner: str | None) -> str:
        """A new session (new id, this owner) with a checkpoint's history and K/V; returns its id."""
        return self.sessions.restore(snapshot_id, owner)

    def info(self, snapshot_id: str, owner: str | None) -> SnapshotInfo:
        return self.persistence.info(snapshot_id, owner)

    def list(self, owner: str | None) -> list[SnapshotInfo]:
        return self.persistence.list(owner)

    def delete(self, snapshot_id: str, owner: str | None) -> None:
        self.persistence.delete(snapshot_id, owner)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every queued background save is written (False on timeout)."""
        return self.persistence.flush(timeout_s)

    def add_observer(self, observe: Callable[[str, float], None]) -> None:
        self.persistence.add_observer(observe)


class Session:
    """A handle on one session of an LLM's store; its history is append-only raw token ids."""

    def __init__(self, llm: LLM, session_id: str) -> None:
        self.llm = llm
        self.id = session_id

    def append(self, token_ids: Seq[int]) -> int:
        return self.llm.sessions.append(self.id, list(token_ids))

    def append_text(self, text: str) -> int:
        """Tokenize with the model's tokenizer (BOS only at the very start of a history) and append."""
        first = not self.llm.sessions.tokens(self.id)
        return self.append(self.llm.tokenizer.encode(text, add_special_tokens=first))

    def generate(self, params: SamplingParams | None = None, **overrides: object) -> GenerationStream:
        """Continue the history; the tokens join it as they commit. Keywords are SamplingParams fields,
        or one of json_schema (a dict or JSON text), regex, grammar (Lark) that the generated text must
        match: the constraint holds for this generate only and leaves the history as it is."""
        stream = GenerationStream(self.llm.engine.cancel)
        self.llm.sessions.generate(self.id, _params(params, overrides), stream=stream)
        return stream

    def generate_text(self, params: SamplingParams | None = None, **overrides: object) -> Iterator[str]:
        """Stream text as it becomes final: multi-byte characters whole, the reply cut before a matched
        stop string."""
        params = _params(params, overrides)
        deltas = TextDeltas(self.llm.tokenizer.decode, params.stop)
        with self.generate(params) as stream:
            for token in stream:
                if piece := deltas.push([token]):
                    yield piece
            if rest := deltas.finish(stream.result().stop_string):
                yield rest

    def fork(self, at: int | None = None) -> Session:
        return Session(self.llm, self.llm.sessions.fork(self.id, at))

    def snapshot(self) -> str:
        """Save this (idle) session as a checkpoint; returns its id once it is durable."""
        return self.llm.snapshots.snapshot(self.id, None)

    def close(self) -> None:
        self.llm.sessions.close(self.id)

    def info(self) -> SessionInfo:
        return self.llm.sessions.info(self.id)

    @property
    def tokens(self) -> list[int]:
        return self.llm.sessions.tokens(self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    if params.seed is None:
        return params
    low, high = SEED_RANGE
    return replace(params, seed=low + (params.seed - low + index) % (high - low + 1))


def _params(params: SamplingParams | None, overrides: dict[str, object]) -> SamplingParams:
    """SamplingParams fields as keywords, plus one of json_schema / regex / grammar to constrain the text."""
    named = {name: overrides.pop(name) for name in CONSTRAINT_OPTIONS if name in overrides}
    if (constraint := Constraint.one_of(**named)) is not None:
        overrides["constraint"] = constraint
    try:
        return replace(params or SamplingParams(), **overrides)  # type: ignore[arg-type]
    except TypeError as error:
        raise InvalidArgumentError(f"unknown sampling option: {error}") from None
