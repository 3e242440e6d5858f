"""Keyed records on both backends (a named session's binding, a stored response): per kind, owner and key;
replaced whole, deleted, and never a path or key built from what a client named."""

from __future__ import annotations

import pytest

from kiln.errors import InvalidArgumentError
from kiln.server.owner_records import OwnerRecords
from kiln.snapshots.store import open_store


def test_records_are_per_kind_owner_and_key(store_target):
    store = open_store(store_target)
    assert store.record("response", "sha256:a", "resp_1") is None
    store.put_record("response", "sha256:a", "resp_1", b'{"v":1}')
    store.put_record("name", "sha256:a", "resp_1", b'{"n":1}')
    assert store.record("response", "sha256:a", "resp_1") == b'{"v":1}'
    assert store.record("name", "sha256:a", "resp_1") == b'{"n":1}'
    assert store.record("response", "sha256:b", "resp_1") is None  # another owner's
    store.put_record("response", "sha256:a", "resp_1", b'{"v":2}')
    assert store.record("response", "sha256:a", "resp_1") == b'{"v":2}'
    assert store.delete_record("response", "sha256:a", "resp_1")
    assert not store.delete_record("response", "sha256:a", "resp_1")
    assert store.record("response", "sha256:a", "resp_1") is None and store.record("name", "sha256:a", "resp_1")
    store.put_record("name", "sha256:a", "../../x", b"{}")  # a digest names it, never the key itself
    assert store.record("name", "sha256:a", "../../x") == b"{}"
    with pytest.raises(InvalidArgumentError):
        store.record("../names", "sha256:a", "k")
    store.close()


def test_owner_records_read_the_store_when_asked_and_forget_the_least_recently_used(tmp_path):
    store = open_store(str(tmp_path / "store"))
    records = OwnerRecords(store, "response", str.encode, bytes.decode, limit=2)
    records.put("alice", "r1", "one")
    assert OwnerRecords(store, "response", str.encode, bytes.decode).get("alice", "r1") == "one"  # another server
    assert records.get("bob", "r1") is None
    other = OwnerRecords(store, "response", str.encode, bytes.decode)
    assert other.delete("alice", "r1") and records.get("alice", "r1") == "one"  # memory: written records never change
    assert records.get("alice", "r1", fresh=True) is None  # the store: another server deleted it
    in_memory = OwnerRecords(None, "response", str.encode, bytes.decode, limit=2)
    for key in ("r1", "r2", "r3"):
        in_memory.put(None, key, key)
    assert [key for _, key, _ in in_memory.cached()] == ["r2", "r3"] and in_memory.get(None, "r1") is None
    store.close()
