"""Hostile snapshot files (issue 37 § 8): manifests whose fields lie, zstd bombs, compressed or oversized
archives, garbage leases. Each is refused with a typed error through `kiln snapshot import` and through a
shared store (written straight into the directory or Redis), nothing is stored, nothing is allocated by
what a file claims, and a bystander on another API key keeps working."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import subprocess
import sys
import tarfile
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import zstandard
from fastapi.testclient import TestClient

from kiln.cli import main
from kiln.errors import FailedPreconditionError
from kiln.server.auth import ApiKeys, identity_of
from kiln.server.http import build_http_app
from kiln.server.metrics import Metrics
from kiln.server.service import RuntimeService
from kiln.snapshots.local import DirectoryStore
from kiln.snapshots.manifest import MAX_PAGE_BYTES, owner_digest, session_snapshot_id
from kiln.snapshots.store import open_store
from tests.snapshots.synthetic import page, synthetic

ROOT = Path(__file__).resolve().parents[2]
KEYS = '[keys.alice]\nkey_sha256 = "{alice}"\n[keys.bob]\nkey_sha256 = "{bob}"\n'

# Each lie a manifest may tell, as a change to a valid manifest's JSON, and what the refusal names.
HOSTILE: dict[str, tuple[Callable[[dict], dict], str]] = {
    "ttl_s text": (lambda m: {**m, "ttl_s": "x"}, "ttl_s"),
    "ttl_s negative": (lambda m: {**m, "ttl_s": -5}, "ttl_s"),
    "ttl_s NaN": (lambda m: {**m, "ttl_s": math.nan}, "ttl_s"),
    "created_at text": (lambda m: {**m, "created_at": "yesterday"}, "created_at"),
    "format_version true": (lambda m: {**m, "format_version": True}, "format version"),
    "session id a path": (lambda m: {**m, "session_id": "../../../x"}, "session_id"),
    "owner not a string": (lambda m: {**m, "owner": 5}, "owner"),
    "pages larger than the shape": (lambda m: {**m, "shape": {**m["shape"], "page_bytes": 3 * 2**29}}, "page_bytes"),
    "an unknown field": (lambda m: {**m, "admin": True}, "unknown field"),
}


def as_session(manifest: dict, session_id: str) -> dict:
    """The manifest as session `session_id`'s own snapshot (what a revival reads)."""
    return {**manifest, "kind": "session", "snapshot_id": session_snapshot_id(session_id), "session_id": session_id}


def write_tar(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def synthetic_export(tmp_path: Path, change: Callable[[dict], dict] = lambda m: m) -> Path:
    manifest, stored = synthetic("snap-one", [page(1), page(2)])
    members = {"manifest.json": json.dumps(change(json.loads(manifest.to_json()))).encode()}
    members |= {f"blobs/{digest}.zst": bytes(blob) for digest, blob in stored.items()}
    return write_tar(tmp_path / "export.tar", members)


def import_file(capsys, target: Path, archive: Path) -> tuple[int, str]:
    code = main(["snapshot", "--snapshot-dir", str(target), "import", str(archive)])
    return code, capsys.readouterr().err


# ---------------------------------------------------------------- through `kiln snapshot import`


def test_a_valid_export_still_imports(tmp_path, capsys):
    code, _ = import_file(capsys, tmp_path / "store", synthetic_export(tmp_path))
    assert code == 0 and DirectoryStore(tmp_path / "store").manifest_ids() == ["snap-one"]


@pytest.mark.parametrize("lie", HOSTILE)
def test_a_lying_manifest_is_refused_at_import_and_nothing_is_stored(tmp_path, capsys, lie):
    change, named = HOSTILE[lie]
    code, err = import_file(capsys, tmp_path / "store", synthetic_export(tmp_path, change))
    assert code == 2 and "FAILED_PRECONDITION" in err and named in err
    store = DirectoryStore(tmp_path / "store")
    assert store.manifest_ids() == [] and list((tmp_path / "store" / "packs").glob("*.pack")) == []


def test_a_session_snapshot_is_refused_unless_its_id_is_its_sessions(tmp_path, capsys):
    planted = synthetic_export(tmp_path, lambda m: {**as_session(m, "victim"), "snapshot_id": "session-other"})
    code, err = import_file(capsys, tmp_path / "store", planted)
    assert code == 2 and "session-" in err and DirectoryStore(tmp_path / "store").manifest_ids() == []


def test_an_archive_with_other_members_is_refused(tmp_path, capsys):
    manifest, stored = synthetic("snap-one", [page(1)])
    members = {"manifest.json": manifest.to_json(), **{f"blobs/{d}.zst": bytes(b) for d, b in stored.items()},
               "../../outside": b"x"}
    code, err = import_file(capsys, tmp_path / "store", write_tar(tmp_path / "extra.tar", members))
    assert code == 2 and "INVALID_ARGUMENT" in err and "outside" in err
    reordered = write_tar(tmp_path / "late.tar", dict(reversed(list(members.items())[:2])))  # manifest not first
    code, err = import_file(capsys, tmp_path / "store", reordered)
    assert code == 2 and "first member" in err
    assert DirectoryStore(tmp_path / "store").manifest_ids() == []


MEASURE = textwrap.dedent("""
    import resource, sys
    import kiln.kv.codec, kiln.snapshots.commands  # imported before measuring: torch is a baseline, not a cost
    from kiln.cli import main
    for target, archive in zip(sys.argv[1::2], sys.argv[2::2]):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        code = main(["snapshot", "--snapshot-dir", target, "import", archive])
        print("measured", code, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
""")


def imports_measured(*runs: tuple[Path, Path]) -> tuple[list[tuple[int, int]], str]:
    """Imports of (store, archive) one after another in a fresh process: each one's exit code and growth of
    the peak RSS in MiB, and their stderr."""
    done = subprocess.run([sys.executable, "-c", MEASURE, *(str(p) for run in runs for p in run)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    results = [tuple(map(int, line.split()[1:])) for line in done.stdout.splitlines() if line.startswith("measured ")]
    return results, done.stderr


def bomb_export(tmp_path: Path, page_bytes: int, slots: int) -> Path:
    """An export of one page of zeros of `page_bytes` (its shape implies that size: float32, 256-token pages
    of 64 heads of 512 channels, `slots` layers), stored as a zstd frame of a few KiB."""
    zeros, digest, frame = bytes(2**20), hashlib.sha256(), b"x"
    if page_bytes <= MAX_PAGE_BYTES:  # beyond, the manifest alone refuses it: its blob is never looked at
        for _ in range(page_bytes // len(zeros)):
            digest.update(zeros)
        frame = zstandard.ZstdCompressor(level=1).compress(bytes(page_bytes))
    manifest, _ = synthetic("bomb", [page(1)])
    raw = json.loads(manifest.to_json())
    raw["shape"] |= {"page_size": 256, "slots": slots, "num_kv_heads": 64, "head_dim": 512, "page_bytes": page_bytes}
    raw |= {"token_ids": list(range(256)), "num_computed": 256,
            "groups": [{"layers": list(range(slots)), "window": None, "pages": [digest.hexdigest()]}]}
    tmp_path.mkdir()
    return write_tar(tmp_path / "bomb.tar", {"manifest.json": json.dumps(raw).encode(),
                                             f"blobs/{digest.hexdigest()}.zst": frame})


def test_a_zstd_bomb_beyond_any_page_is_refused_and_one_within_is_checked_in_bounded_memory(tmp_path):
    """The 61 KB archive of the issue claimed 1.5 GiB pages and took the import to 1.84 GB: now a claim
    beyond MAX_PAGE_BYTES is refused from the manifest alone, and a page within it (64 MiB here) is
    decompressed and hashed a MiB at a time."""
    huge = bomb_export(tmp_path / "huge", 512 * 2**20, slots=8)
    within = bomb_export(tmp_path / "within", 64 * 2**20, slots=1)
    [(refused, _), (imported, grown)], err = imports_measured((tmp_path / "a", huge), (tmp_path / "b", within))
    assert refused == 2 and "page_bytes" in err and DirectoryStore(tmp_path / "a").manifest_ids() == []
    assert imported == 0, err
    assert grown < 24, f"verifying a 64 MiB page grew the import's peak memory by {grown} MiB"


class Zeros(io.RawIOBase):
    """An endless stream of zero bytes."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # noqa: ANN001 - io's signature
        buffer[:] = bytes(len(buffer))
        return len(buffer)


def test_a_compressed_archive_is_refused_unread(tmp_path):
    """The issue's 14 MB .tar.gz held one 3 GiB member of zeros, read whole before "no manifest.json";
    a 64 MiB one (64 KiB compressed) stands for it."""
    path = tmp_path / "zeros.tar.gz"
    with gzip.open(path, "wb", compresslevel=1) as packed, tarfile.open(fileobj=packed, mode="w") as archive:
        info = tarfile.TarInfo("manifest.json")
        info.size = 64 * 2**20
        archive.addfile(info, io.BufferedReader(Zeros()))
    [(code, grown)], err = imports_measured((tmp_path / "store", path))
    assert code == 2 and "gzip-compressed" in err and grown < 16
    assert DirectoryStore(tmp_path / "store").manifest_ids() == []


# ---------------------------------------------------------------- through a shared store


def plant(target: str, snapshot_id: str, data: bytes, owner: str) -> None:
    """A manifest written straight into a store, as whoever else can write it would."""
    if target.startswith("redis://"):
        with redis.Redis.from_url(target) as client:
            client.set(f"kiln:manifest:{snapshot_id}", data)
            client.sadd("kiln:manifests", snapshot_id)
            client.sadd(f"kiln:owner:{owner}", snapshot_id)
    else:
        (Path(target) / "manifests" / f"{snapshot_id}.json").write_bytes(data)


@pytest.mark.parametrize("lie", HOSTILE)
def test_a_lying_manifest_in_a_shared_store_is_unreadable_not_a_crash(store_target, lie):
    store = open_store(store_target)
    manifest, stored = synthetic("snap-good", [page(1)])
    store.save(manifest, stored)
    change, named = HOSTILE[lie]
    plant(store_target, "snap-bad", json.dumps(change({**json.loads(manifest.to_json()), "snapshot_id": "snap-bad"})).encode(),
          manifest.owner)
    with pytest.raises(FailedPreconditionError, match=named):
        store.get_manifest("snap-bad")
    assert [m.snapshot_id for m in store.manifests(manifest.owner)] == ["snap-good"]  # listing skips it
    with pytest.raises(FailedPreconditionError, match="snap-bad"):  # gc fails closed, deleting nothing
        store.gc()
    store.close()


def test_a_manifest_stored_under_another_id_is_refused(store_target):
    store = open_store(store_target)
    manifest, stored = synthetic("snap-good", [page(1)])
    store.save(manifest, stored)
    plant(store_target, "snap-alias", manifest.to_json(), manifest.owner)
    with pytest.raises(FailedPreconditionError, match="names another snapshot"):
        store.get_manifest("snap-alias")
    store.close()


def answered(call: Callable[[], object], timeout_s: float = 60.0) -> object:
    """The call's result, or a failed test if it does not answer (a hang must not hang the suite)."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(call).result(timeout=timeout_s)
    finally:
        pool.shutdown(wait=False)


def test_hostile_manifests_in_the_store_refuse_only_themselves_over_http(tiny_llm, tmp_path, store_target):
    """Alice's checkpoint, planted again with each lie (and as sessions of hers with each lie): restoring
    or reviving them answers a typed error, her listing answers, and Bob, on another key, keeps working."""
    digests = {name: hashlib.sha256(name.encode()).hexdigest() for name in ("alice", "bob")}
    (tmp_path / "keys.toml").write_text(KEYS.format(**digests))
    option = {"snapshot_store" if store_target.startswith("redis://") else "snapshot_dir": store_target}
    llm = tiny_llm("llama", speculative=None, **option)
    http = TestClient(build_http_app(RuntimeService(llm, "tiny"), ApiKeys(keys_file=str(tmp_path / "keys.toml")),
                                     Metrics(llm)), raise_server_exceptions=False)
    alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
    session = http.post("/v1/sessions", json={"token_ids": list(range(3, 40))}, headers=alice).json()["session_id"]
    checkpoint = http.post(f"/v1/sessions/{session}/snapshot", headers=alice).json()["snapshot_id"]
    good = json.loads(llm.persistence.store.manifest_bytes(checkpoint))
    owner = owner_digest(identity_of("alice"))
    for index, (lie, (change, _)) in enumerate(HOSTILE.items()):
        bad_id, victim = f"snap-bad-{index}", f"planted{index}"
        plant(store_target, bad_id, json.dumps(change({**good, "snapshot_id": bad_id})).encode(), owner)
        plant(store_target, session_snapshot_id(victim), json.dumps(change(as_session(good, victim))).encode(), owner)
        restore = answered(lambda bad_id=bad_id: http.post(f"/v1/snapshots/{bad_id}/restore", headers=alice))
        assert restore.status_code in (404, 409), (lie, restore.status_code, restore.text)
        revive = answered(lambda victim=victim: http.get(f"/v1/sessions/{victim}", headers=alice))
        assert revive.status_code in (404, 409), (lie, revive.status_code, revive.text)
        listed = answered(lambda: http.get("/v1/snapshots", headers=alice))
        assert listed.status_code == 200 and [s["snapshot_id"] for s in listed.json()["data"]] == [checkpoint], lie
        assert answered(lambda: http.get("/v1/sessions", headers=alice)).status_code == 200, lie
        mine = answered(lambda: http.post("/v1/sessions", json={"token_ids": [5, 6, 7]}, headers=bob))
        assert mine.status_code == 201, (lie, mine.text)
        turn = answered(lambda mine=mine: http.post(f"/v1/sessions/{mine.json()['session_id']}/generate",
                                                    json={"max_tokens": 2}, headers=bob))
        assert turn.status_code == 200, (lie, turn.text)
    assert http.post(f"/v1/snapshots/{checkpoint}/restore", headers=alice).status_code == 201  # the real one still works


# ---------------------------------------------------------------- leases and sessions


@pytest.mark.parametrize("fields", [{"expires_at": "Infinity"}, {"holder": 5}, {"token": "7"}, {"token": True},
                                    {"holder": "a b"}, {"pid": -1}])
def test_a_lease_file_with_bad_fields_is_no_lease(tmp_path, fields):
    store = DirectoryStore(tmp_path)
    record = {"holder": "squatter/1", "token": 7, "host": "", "pid": 0, "expires_at": time.time() + 3600, **fields}
    (tmp_path / "leases" / "s1.json").write_text(json.dumps(record).replace('"Infinity"', "Infinity"))
    assert store.lease_of("s1") is None
    assert store.acquire_lease("s1", "server-a", 30.0).holder == "server-a"


@pytest.mark.parametrize("record", [{"holder": "squatter/1", "token": "abc"}, {"holder": b"\xff\xfe", "token": "1x"}])
def test_a_redis_lease_with_bad_fields_or_no_expiry_is_no_lease(redis_url, record):
    """A lease hash planted without an expiry (or with a token that is not a number) held its session
    forever, and reading it raised ValueError (a 500): it is no lease, replaced by the next grant."""
    store = open_store(redis_url)
    with redis.Redis.from_url(redis_url) as client:
        client.hset("kiln:lease:s1", mapping=record)
    assert store.lease_of("s1") is None
    lease = store.acquire_lease("s1", "server-a", 30.0)
    assert lease.holder == "server-a" and store.lease_of("s1").same_grant(lease)
    store.close()


def test_a_call_that_finds_its_session_past_its_ttl_revives_it_instead_of_waiting_for_itself(tiny_llm, tmp_path):
    """The call's own expiry pass evicted the session, then waited for the eviction it had yet to finish:
    forever (the issue's ttl_s -5 restore hung a worker so; any TTL did, called just after it ran out)."""
    llm = tiny_llm("llama", speculative=None, snapshot_dir=str(tmp_path))
    now = [1000.0]
    llm.sessions._clock = lambda: now[0]
    session = llm.create_session([5, 6, 7], ttl_s=60)
    now[0] += 61
    info = answered(session.info, timeout_s=30)
    assert info.history_tokens == 3 and llm.sessions.evictions["ttl"] == 1


def test_a_thread_stuck_after_shutdown_does_not_keep_the_process_alive(tmp_path):
    """SIGTERM logged "shut down" and the process never exited while a worker thread waited forever: the
    exit watch ends it once the main thread is done."""
    script = textwrap.dedent("""
        import threading, time
        from kiln.server import app
        app.STRAGGLER_WAIT_S = 0.5
        threading.Thread(target=threading.Event().wait, name="stuck-worker").start()
        app.exit_despite_stragglers()
        print("main done", flush=True)
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "main done" in done.stdout and "stuck-worker" in done.stderr
    assert time.monotonic() - started < 60


def test_the_exit_watch_leaves_a_process_that_ends_by_itself_alone():
    script = "from kiln.server import app\napp.exit_despite_stragglers()\nimport threading\nthreading.Thread(target=lambda: None).start()"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == ""

