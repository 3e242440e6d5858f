"""Stored responses of the Responses API (`store`, the default): each is a point in a Kiln session, the
session's id and its history's length once the response's output joined it, with the segments that
history divides into (kiln/server/chat_sessions.py: what was rendered, what the model generated), beside
what the API returns for it and the new input items it consumed. A follow-up (`previous_response_id`)
continues that session at that point (kiln/server/responses_api.py), and re-reads the conversation from
the chain of records it follows: each record holds its own input and output items only.

Records are keyed records of kind "response" in the snapshot store (kiln/server/owner_records.py), so they
are durable, shared by a fleet and scoped to the API key that made them: another key's response is
NOT_FOUND exactly as one that never existed. A response is kept RESPONSE_TTL_S after its creation (OpenAI's
retention of stored responses) or until DELETE; past it, a GET, DELETE or follow-up naming it is
NOT_FOUND. An expired record stays in the store, unread, while a later response of its chain lives (its
follow-ups read it); only DELETE removes records. A response's session is not closed with it: later
responses of the conversation may continue in it, and its own TTL governs it as any session's.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field

from kiln.errors import NotFoundError
from kiln.server.chat_sessions import Segment
from kiln.server.owner_records import OwnerRecords
from kiln.server.response_items import Item
from kiln.snapshots.store import SnapshotStore

RESPONSE_TTL_S = 30 * 86400.0  # how long a stored response can be read or followed up (OpenAI keeps them 30 days)


class ResponseNotFoundError(NotFoundError):
    """No such response for this caller (never stored, deleted, expired, or another key's)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StoredResponse:
    """A response as kept: the object the API returns (`body`), the input items it consumed, and where it
    is in its session (`position` tokens of history, divided as `segments`)."""

    body: dict
    input_items: list[Item]
    session_id: str
    position: int
    segments: list[Segment] = field(default_factory=list)
    expires_at: float = 0.0  # time.time() seconds

    @property
    def id(self) -> str:
        return str(self.body["id"])

    @property
    def previous_response_id(self) -> str | None:
        return self.body.get("previous_response_id")

    def items(self) -> list[Item]:
        """The conversation's items this response added: its input, then its output."""
        return [*self.input_items, *self.body["output"]]

    def to_json(self) -> bytes:
        return json.dumps({"body": self.body, "input_items": self.input_items, "session_id": self.session_id,
                           "position": self.position, "segments": [[s.end, s.kind] for s in self.segments],
                           "expires_at": self.expires_at}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> StoredResponse:
        raw = json.loads(data)
        return cls(raw["body"], raw["input_items"], raw["session_id"], int(raw["position"]),
                   [Segment(int(end), kind) for end, kind in raw["segments"]], float(raw["expires_at"]))


class ResponseBook:
    """The stored responses of every API key (see the module docstring)."""

    def __init__(self, store: SnapshotStore | None, ttl_s: float = RESPONSE_TTL_S) -> None:
        self.records = OwnerRecords(store, "response", StoredResponse.to_json, StoredResponse.from_json)
        self.ttl_s = ttl_s

    def expiry(self) -> float:
        """When a response stored now expires."""
        return time.time() + self.ttl_s

    def put(self, owner: str | None, response: StoredResponse) -> None:
        self.records.put(owner, response.id, response)

    def get(self, owner: str | None, response_id: str, param: str | None = None) -> StoredResponse:
        """The live response (read from the store, which a fleet shares); ResponseNotFoundError naming
        `param` if there is none."""
        response = self.records.get(owner, response_id, fresh=True)
        if response is None or response.expires_at <= time.time():
            raise ResponseNotFoundError(f"no response {response_id[:128]!r} (never stored, deleted, or expired)", param)
        return response

    def delete(self, owner: str | None, response_id: str) -> None:
        self.get(owner, response_id)
        self.records.delete(owner, response_id)

    def chain(self, owner: str | None, response_id: str) -> list[StoredResponse]:
        """The response named by a follow-up's previous_response_id and those it follows, oldest first.
        Earlier records never change once written: memory serves them."""
        chain = [self.get(owner, response_id, "previous_response_id")]
        while (earlier := chain[-1].previous_response_id) is not None:
            response = self.records.get(owner, earlier)
            if response is None:
                raise ResponseNotFoundError(f"response {response_id[:128]!r} follows {earlier!r}, which was deleted: "
                                            "its conversation is lost", "previous_response_id")
            chain.append(response)
        return chain[::-1]

    def survey(self) -> dict[str | None, Counter[str]]:
        """For the dashboard: per owner, how many live responses each session carries, of those this server
        holds in memory (made or read since it started)."""
        now = time.time()
        sessions: dict[str | None, Counter[str]] = {}
        for owner, _, response in self.records.cached():
            if response.expires_at > now:
                sessions.setdefault(owner, Counter())[response.session_id] += 1
        return sessions
