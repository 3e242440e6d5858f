"""Persistence through real `kiln serve` processes: sessions survive a kill -9 and a graceful restart with
their id and history, and continue bit-identically; checkpoints over gRPC and REST, scoped to their key;
a corrupt blob is refused while the server keeps serving; two servers share one Redis, one owner per live
session (FAILED_PRECONDITION elsewhere until it is handed off)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import pytest

from kiln.client import AsyncClient, Client, FailedPreconditionError, NotFoundError
from kiln.snapshots.manifest import session_snapshot_id
from tests.server.conftest import start_server, tiny_model_dir
from tests.snapshots.synthetic import flip_blob_byte
from tests.tiny_models import TINY_CONFIGS

N = 8
GREEDY = {"max_tokens": N, "temperature": 0.0, "ignore_eos": True}
SEEDED = {"max_tokens": N, "temperature": 0.9, "top_p": 0.95, "ignore_eos": True}
PROMPT = list(range(40, 90))


@pytest.fixture(scope="module")
def model(servers_root) -> tuple[str, Path]:
    return str(tiny_model_dir(servers_root, "llama")), servers_root / "cache"


def serve(model: tuple[str, Path], *store: str, keys: tuple[str, ...] = ()):
    return start_server(model[0], model[1], keys, ("--speculative", "none", *store), TINY_CONFIGS["llama"].vocab_size)


def tokens(session, **options) -> list[int]:
    return session.generate(**options).result().token_ids


def wait_saved(root: Path, session_id: str, history: int) -> None:
    """Until the session's own snapshot on disk holds its whole history (saves run in the background)."""
    from kiln.snapshots.local import DirectoryStore

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        manifest = DirectoryStore(root).get_manifest(session_snapshot_id(session_id))
        if manifest is not None and len(manifest.token_ids) == history:
            return
        time.sleep(0.05)
    raise AssertionError(f"session {session_id} was not saved")


def saved_info(client: Client, session_id: str):
    """The session's info once its saver reports no unsaved change (the manifest lands just before)."""
    deadline = time.monotonic() + 30
    while (info := client.get_session(session_id).info()).unsaved_changes:
        assert time.monotonic() < deadline, "the session still reports unsaved changes"
        time.sleep(0.05)
    return info


def test_sessions_survive_kill_9_and_graceful_restarts_bit_exactly(model, tmp_path):
    """One instance id across the restarts: each new process takes over its predecessor's leases at once."""
    store = ("--snapshot-dir", str(tmp_path), "--instance-id", "node-1")
    first = serve(model, *store)
    with Client(first.grpc_address) as client:
        greedy, seeded = client.create_session(PROMPT), client.create_session(PROMPT)
        head = tokens(greedy, **GREEDY)
        tokens(seeded, **SEEDED, seed=1)
        histories = {s.id: s.info().history_tokens for s in (greedy, seeded)}
    for session_id, history in histories.items():
        wait_saved(tmp_path, session_id, history)
    with Client(first.grpc_address) as client:  # the saver's status travels over the wire
        status = saved_info(client, greedy.id)
        assert status.save_failures == 0 and time.time() - 60 < status.last_saved_at <= time.time()
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()

    second = serve(model, *store)
    with Client(second.grpc_address) as client:
        listed = {info.session_id: info for info in client.list_sessions()}  # saved, not yet back in memory
        assert {sid: (info.history_tokens, info.resident) for sid, info in listed.items()} == {
            sid: (history, False) for sid, history in histories.items()
        }
        back = client.get_session(greedy.id)
        assert {info.session_id: info.resident for info in client.list_sessions()} == {greedy.id: True, seeded.id: False}
        assert back.info().history_tokens == histories[greedy.id]
        continued = back.generate(**GREEDY).result()
        assert continued.usage.reused_tokens == histories[greedy.id] - 1  # K/V from disk, not recomputed
        reference = client.create_session(PROMPT)
        assert head + continued.token_ids == tokens(reference, **{**GREEDY, "max_tokens": 2 * N})
        seeded_back = tokens(client.get_session(seeded.id), **SEEDED, seed=2)
        uninterrupted = client.create_session(PROMPT)
        tokens(uninterrupted, **SEEDED, seed=1)
        assert seeded_back == tokens(uninterrupted, **SEEDED, seed=2)
        graceful = client.create_session(PROMPT[:30])
        graceful_head = tokens(graceful, **GREEDY)
    second.stop()  # SIGTERM: every session is saved on the way out

    third = serve(model, *store)
    with Client(third.grpc_address) as client:
        rest = tokens(client.get_session(graceful.id), **GREEDY)
        assert graceful_head + rest == tokens(client.create_session(PROMPT[:30]), **{**GREEDY, "max_tokens": 2 * N})
        assert client.get_session(greedy.id).info().history_tokens == histories[greedy.id] + N
    third.stop()


def test_checkpoints_over_grpc_and_rest_are_scoped_and_verified(model, tmp_path):
    server = serve(model, "--snapshot-dir", str(tmp_path), keys=("key-a", "key-b"))
    with Client(server.grpc_address, api_key="key-a") as a, Client(server.grpc_address, api_key="key-b") as b:
        session = a.create_session(PROMPT)
        head = tokens(session, **GREEDY)
        snapshot_id = session.snapshot()
        assert [s.snapshot_id for s in a.list_snapshots()] == [snapshot_id] and b.list_snapshots() == []
        assert a.list_snapshots()[0].history_tokens == len(PROMPT) + N
        with pytest.raises(NotFoundError):
            b.restore_session(snapshot_id)
        with pytest.raises(NotFoundError):
            b.delete_snapshot(snapshot_id)
        branch = a.restore_session(snapshot_id)
        assert branch.id != session.id and tokens(branch, **GREEDY) == tokens(session, **GREEDY)
        assert head

        http = httpx.Client(base_url=server.http_url, headers={"Authorization": "Bearer key-a"})
        made = http.post(f"/v1/sessions/{session.id}/snapshot")
        assert made.status_code == 201 and made.json()["history_tokens"] == len(PROMPT) + 2 * N
        rest_id = made.json()["snapshot_id"]
        assert {s["snapshot_id"] for s in http.get("/v1/snapshots").json()["data"]} == {snapshot_id, rest_id}
        restored = http.post(f"/v1/snapshots/{rest_id}/restore")
        assert restored.status_code == 201 and restored.json()["history_tokens"] == len(PROMPT) + 2 * N
        other = httpx.Client(base_url=server.http_url, headers={"Authorization": "Bearer key-b"})
        assert other.get(f"/v1/snapshots/{rest_id}").status_code == 404
        assert http.delete(f"/v1/snapshots/{rest_id}").json()["deleted"] is True
        assert http.get(f"/v1/snapshots/{rest_id}").status_code == 404
        assert http.get("/v1/snapshots/..%2F..%2Fetc").status_code in (400, 404)

        digest = sorted(_manifest(tmp_path, snapshot_id).digests())[0]
        flip_blob_byte(tmp_path, digest)
        with pytest.raises(FailedPreconditionError, match="corrupt|digest"):
            a.restore_session(snapshot_id)
        assert tokens(a.create_session(PROMPT[:10]), **GREEDY)  # the server keeps serving
        assert asyncio.run(_async_round_trip(server.grpc_address)) == len(PROMPT)
        metrics = httpx.get(f"{server.http_url}/metrics").text
        assert "kiln_snapshot_verification_failures_total 1.0" in metrics
        assert 'kiln_snapshot_saves_total{kind="checkpoint"} 3.0' in metrics
        assert "kiln_snapshot_seconds_count" in metrics
    server.stop()


async def _async_round_trip(address: str) -> int:
    """The asyncio SDK: snapshot, list, restore, delete; returns the restored history's length."""
    async with AsyncClient(address, api_key="key-b") as client:
        session = await client.create_session(PROMPT)
        snapshot_id = await session.snapshot()
        assert [s.snapshot_id for s in await client.list_snapshots()] == [snapshot_id]
        restored = await client.restore_session(snapshot_id)
        await client.delete_snapshot(snapshot_id)
        assert await client.list_snapshots() == []
        return (await restored.info()).history_tokens


def _manifest(root: Path, snapshot_id: str):
    from kiln.snapshots.local import DirectoryStore

    return DirectoryStore(root).get_manifest(snapshot_id)


def test_two_servers_share_one_redis(model, redis_url):
    one, two = serve(model, "--snapshot-store", redis_url), serve(model, "--snapshot-store", redis_url)
    with Client(one.grpc_address) as a, Client(two.grpc_address) as b:
        session = a.create_session(PROMPT)
        tokens(session, **GREEDY)
        snapshot_id = session.snapshot()
        moved = b.restore_session(snapshot_id)
        assert moved.info().computed_tokens == len(PROMPT) + N - 1  # K/V came over, nothing recomputed
        assert tokens(moved, **GREEDY) == tokens(session, **GREEDY)
        with pytest.raises(FailedPreconditionError, match="live on another server"):  # one owner at a time
            b.get_session(session.id)
        history = session.info().history_tokens
    one.stop()  # graceful: saves every session, then hands it off
    with Client(two.grpc_address) as b:
        assert b.get_session(session.id).info().history_tokens == history
    two.stop()
