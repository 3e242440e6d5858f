"""Records the OpenAI API keeps beside the sessions, per API key: a named session's binding
(kiln/server/chat_sessions.py), a stored response (kiln/server/stored_responses.py). The snapshot store holds
them (durable, and shared by every server of a fleet: kiln/snapshots/store.py § Keyed records); memory keeps
the most recently used MEMORY_RECORDS of a kind, so a conversation's next turn reads none from the store.
Without persistence memory is all there is: past that many, the least recently used are forgotten.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from kiln.snapshots.manifest import owner_digest
from kiln.snapshots.store import SnapshotStore

T = TypeVar("T")
MEMORY_RECORDS = 10_000  # records of one kind kept in memory (all of them without a snapshot store)


class OwnerRecords(Generic[T]):
    """Key -> record per owner (an API key's identity; None with auth off), of one `kind`."""

    def __init__(self, store: SnapshotStore | None, kind: str, encode: Callable[[T], bytes],
                 decode: Callable[[bytes], T], limit: int = MEMORY_RECORDS) -> None:
        self.store = store
        self.kind = kind
        self._encode = encode
        self._decode = decode
        self._limit = limit
        self._memory: OrderedDict[tuple[str | None, str], T] = OrderedDict()
        self._lock = threading.Lock()  # a leaf: held for dictionary work only, never across store I/O

    def get(self, owner: str | None, key: str, fresh: bool = False) -> T | None:
        """The record, from memory unless `fresh` asks the store (another server of a fleet may have
        deleted it; memory serves records that never change once written)."""
        if not fresh or self.store is None:
            with self._lock:
                value = self._memory.get((owner, key))
                if value is not None:
                    self._memory.move_to_end((owner, key))
            if value is not None or self.store is None:
                return value
        data = self.store.record(self.kind, owner_digest(owner), key)
        if data is None:
            self._forget(owner, key)
            return None
        value = self._decode(data)
        self._remember(owner, key, value)
        return value

    def put(self, owner: str | None, key: str, value: T) -> None:
        if self.store is not None:
            self.store.put_record(self.kind, owner_digest(owner), key, self._encode(value))
        self._remember(owner, key, value)

    def delete(self, owner: str | None, key: str) -> bool:
        """True if there was such a record."""
        known = self._forget(owner, key)
        if self.store is not None:
            return self.store.delete_record(self.kind, owner_digest(owner), key)
        return known

    def cached(self) -> list[tuple[str | None, str, T]]:
        """The records in memory (owner, key, record), least recently used first."""
        with self._lock:
            return [(owner, key, value) for (owner, key), value in self._memory.items()]

    def _remember(self, owner: str | None, key: str, value: T) -> None:
        with self._lock:
            self._memory[(owner, key)] = value
            self._memory.move_to_end((owner, key))
            while len(self._memory) > self._limit:
                self._memory.popitem(last=False)

    def _forget(self, owner: str | None, key: str) -> bool:
        with self._lock:
            return self._memory.pop((owner, key), None) is not None
