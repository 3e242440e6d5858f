"""Named sessions for the OpenAI API: a request header `Kiln-Session: NAME` binds /v1/chat/completions and
/v1/completions to one durable Kiln session per API key and name, created on first use. Agents re-send the
whole conversation every turn; the server renders it, keeps what the session already holds and appends
only the rest, so a turn costs its new tokens, before and after a restart.

What is kept is decided at the boundaries the session itself knows, never by re-tokenising its history
(docs/architecture.md § Named sessions): a binding records the history as segments, each either rendered
(prompt text the server encoded) or generated (a reply as the model wrote it). The new conversation's text
is walked segment by segment: a segment is kept when the text goes on with exactly its text, so a client's
echo of a reply keeps the reply's tokens as generated; the first rendered segment that differs is compared
token by token (its encoding starts at the same boundary), and the first reply that differs is recomputed
whole. Where the history must shrink, the session is forked at that token (sharing its pages), the name
moves to the fork and the old session is closed: histories stay append-only. Tokens after the recorded
segments (a reply whose binding was not yet written, or tokens appended by another path) count as one reply.

Bindings live in the snapshot store beside the sessions they name (memory only without persistence).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from kiln.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from kiln.server.owner_records import OwnerRecords
from kiln.snapshots.store import SnapshotStore
from kiln.tokenizer import Tokenizer

HEADER = "kiln-session"
ID_HEADER = "Kiln-Session-Id"
RECOMPUTED_HEADER = "Kiln-Session-Recomputed"  # why tokens the session held were computed again ("none")
NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
RENDERED, GENERATED = "rendered", "generated"
Prompt = tuple[str | list[int], bool]  # a prompt's text and whether its encoding adds BOS, or its token ids


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise InvalidArgumentError(f"the {HEADER.title()} header must be 1-128 characters of [A-Za-z0-9._-], "
                                   f"got {name[:64]!r}", "Kiln-Session")
    return name


@dataclass(frozen=True)
class Segment:
    end: int  # history position where it ends
    kind: str  # RENDERED or GENERATED


@dataclass
class Binding:
    """A name's session and how its history divides into segments."""

    session_id: str
    segments: list[Segment] = field(default_factory=list)

    def to_json(self) -> bytes:
        return json.dumps({"session_id": self.session_id,
                           "segments": [[s.end, s.kind] for s in self.segments]}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Binding:
        raw = json.loads(data)
        return cls(raw["session_id"], [Segment(int(end), kind) for end, kind in raw["segments"]])


@dataclass(frozen=True)
class Continuation:
    """How a session goes on to hold a new conversation: its first `keep` tokens stay, `append` follows;
    `segments` are the history's once it does."""

    keep: int
    append: list[int]
    segments: list[Segment]
    reason: str  # why history tokens after `keep` are computed again; "none" when nothing is


def continuation(history: Sequence[int], segments: Sequence[Segment], prompt: str | list[int], add_bos: bool,
                 tokenizer: Tokenizer) -> Continuation:
    """What the session keeps of `history` and appends for `prompt` (text encoded with BOS when `add_bos`,
    or token ids taken as they are). See the module docstring."""
    if isinstance(prompt, list):
        common = _common(history, prompt)
        reason = "none" if common == len(history) else f"the prompt's token ids differ from the session's at token {common}"
        return _continued(common, prompt[common:], [Segment(common, RENDERED)] if common else [], reason)
    lead = tokenizer.encode("", add_special_tokens=True) if add_bos else []  # BOS, where the tokenizer adds one
    if history[:len(lead)] != lead or not history:
        return _continued(0, tokenizer.encode(prompt, add_special_tokens=add_bos), [],
                          "the session does not start as the prompt does" if history else "none")
    start = len(lead)
    bounds = [s for s in segments if start < s.end <= len(history)]
    if not bounds or bounds[-1].end < len(history):
        bounds.append(Segment(len(history), GENERATED))  # tokens no binding recorded: taken as a reply
    position, kept = 0, []  # position in `prompt`; the segments kept whole
    for segment in bounds:
        text = tokenizer.decode(history[start:segment.end], skip_special_tokens=False)
        if not prompt.startswith(text, position):
            rest = tokenizer.encode(prompt[position:], add_special_tokens=False)
            if segment.kind == GENERATED:
                return _continued(start, rest, kept, f"the reply at token {start} differs from the one generated")
            common = _common(history[start:segment.end], rest)
            partial = [Segment(start + common, RENDERED)] if common else []
            return _continued(start + common, rest[common:], kept + partial,
                              f"the rendering of earlier messages changed at token {start + common}")
        position, start = position + len(text), segment.end
        kept.append(segment)
    return _continued(len(history), tokenizer.encode(prompt[position:], add_special_tokens=False), kept, "none")


def _continued(keep: int, append: list[int], kept: list[Segment], reason: str) -> Continuation:
    appended = [Segment(keep + len(append), RENDERED)] if append else []
    return Continuation(keep, append, kept + appended, reason)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class Bindings(OwnerRecords[Binding]):
    """Name -> Binding per owner: records of kind "name" (kiln/server/owner_records.py), read from the snapshot
    store every time when there is one (a fleet's replicas share it: another may have forked the session since)."""

    def __init__(self, store: SnapshotStore | None) -> None:
        super().__init__(store, "name", Binding.to_json, Binding.from_json)

    def get(self, owner: str | None, key: str, fresh: bool = True) -> Binding | None:
        return super().get(owner, key, fresh)


@dataclass(frozen=True)
class Turn:
    """The session a request generates in, why anything it held was computed again, and how its history
    divides into segments once the prompt is in."""

    session_id: str
    reason: str
    segments: list[Segment] = field(default_factory=list)


def started(service, owner: str | None, prompt: str | list[int], add_bos: bool,  # noqa: ANN001 - RuntimeService
            reason: str) -> Turn:
    """A new session holding `prompt` (text encoded with BOS when `add_bos`, or token ids)."""
    tokens = prompt if isinstance(prompt, list) else service.llm.tokenizer.encode(prompt, add_special_tokens=add_bos)
    info = service.create_session(owner, tokens)
    return Turn(info.session_id, reason, [Segment(len(tokens), RENDERED)])


def continued(service, owner: str | None, session_id: str, history: list[int],  # noqa: ANN001 - RuntimeService
              segments: Sequence[Segment], prompt: str | list[int], add_bos: bool, held: int | None = None,
              param: str = "messages") -> Turn:
    """The session whose history starts with `history` (divided as `segments`; it holds `held` tokens,
    default len(history)) brought to hold `prompt`: in place when the prompt keeps all it holds, else in a
    fork at the first difference (the session itself is left as it is). An empty prompt is refused naming
    `param`."""
    plan = continuation(history, segments, prompt, add_bos, service.llm.tokenizer)
    if plan.keep < (len(history) if held is None else held):
        session_id = service.fork(owner, session_id, plan.keep).session_id
    if plan.append:
        service.append(owner, session_id, plan.append)
    elif plan.keep == 0:
        raise InvalidArgumentError("the prompt is empty", param)
    return Turn(session_id, plan.reason, plan.segments)


class TurnLocks:
    """One asyncio lock per (owner, key): turns that start from the same session or name take it while they
    bring the session to hold their prompt and queue their generate. A lock lives while it is held or awaited."""

    def __init__(self) -> None:
        self._locks: weakref.WeakValueDictionary[tuple[str | None, str], asyncio.Lock] = weakref.WeakValueDictionary()

    def __call__(self, owner: str | None, key: str) -> asyncio.Lock:
        lock = self._locks.get((owner, key))
        if lock is None:
            lock = self._locks[(owner, key)] = asyncio.Lock()
        return lock


class NamedSessions:
    """One turn at a time per (owner, name): a turn's request reads the history only after the previous
    turn's generate ended (SessionStore.settled), and its own generate is queued before the next turn may
    start."""

    def __init__(self, service, bindings: Bindings) -> None:  # noqa: ANN001 - RuntimeService (a cycle)
        self.service = service
        self.bindings = bindings
        self.lock = TurnLocks()  # lock(owner, name)

    def prepare(self, owner: str | None, name: str, prompt: str | list[int], add_bos: bool) -> Turn:
        """Bring the name's session to hold `prompt` (worker thread; the name's lock held)."""
        binding = self.bindings.get(owner, name)
        history: list[int] | None = None
        if binding is not None:
            try:
                history = self.service.sessions.settled(binding.session_id, owner)
            except NotFoundError:  # closed, expired or evicted for good: the name starts over
                history = None
        if binding is None or history is None:
            turn = started(self.service, owner, prompt, add_bos,
                           "new session" if binding is None else "the named session had ended")
        else:
            turn = continued(self.service, owner, binding.session_id, history, binding.segments, prompt, add_bos)
        self.bindings.put(owner, name, Binding(turn.session_id, turn.segments))
        if history is not None and turn.session_id != binding.session_id:
            with contextlib.suppress(NotFoundError, FailedPreconditionError):  # gone, or busy with another's call
                self.service.close(owner, binding.session_id)
        return turn
