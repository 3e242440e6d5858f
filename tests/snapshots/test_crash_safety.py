"""Fault injection: a process saving snapshots is killed (SIGKILL) at random points, 24 times, while gc
runs beside it. Afterwards every listed manifest restores (all its blobs present, each verifying), no
partial snapshot is listed, and gc keeps every referenced blob.

The writer runs the store's real save path (DirectoryStore.save over zstd blobs) without a model, so each
trial costs a process start, not a server start: hundreds of blob writes and fsyncs are in flight when
it dies."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from kiln.snapshots import blobs
from kiln.snapshots.local import DirectoryStore
from tests.snapshots.synthetic import PAGE_BYTES

TRIALS = 24
WRITER = f"""
import random, sys
from kiln.snapshots import blobs
from kiln.snapshots.local import DirectoryStore
from tests.snapshots.synthetic import synthetic
store = DirectoryStore(__import__("pathlib").Path(sys.argv[1]))
rng = random.Random(int(sys.argv[2]))
print("ready", flush=True)
for n in range(10**6):
    pages = [rng.randbytes({PAGE_BYTES}) for _ in range(rng.randint(20, 80))]
    pages += [bytes([k]) * {PAGE_BYTES} for k in range(rng.randint(0, 10))]  # shared between snapshots
    store.save(*synthetic(f"snap-{{n % 7}}", pages))
    if n % 5 == 4:
        store.delete_manifest(f"snap-{{rng.randrange(7)}}")
"""


def check_store(root: Path) -> int:
    """Every listed manifest is complete and verifies; returns how many there are."""
    store = DirectoryStore(root)
    ids = store.manifest_ids()
    assert all((root / "manifests" / f"{i}.json").is_file() for i in ids)
    for snapshot_id in ids:
        manifest = store.require_manifest(snapshot_id)
        for digest in manifest.digests():
            blob = store.get_blob(digest)
            assert blob is not None, f"{snapshot_id} lists a missing blob"
            blobs.decode(blob, digest, PAGE_BYTES)
    return len(ids)


def test_killed_writers_never_leave_a_partial_snapshot(tmp_path):
    rng = random.Random(1234)
    root = tmp_path / "store"
    DirectoryStore(root)
    seen = 0
    for trial in range(TRIALS):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(trial)], stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.25))
        if trial % 2:
            DirectoryStore(root).gc()  # gc while the writer saves: it must wait for the save in flight
            time.sleep(rng.uniform(0.0, 0.1))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        seen += check_store(root)
        referenced = set().union(*(m.digests() for m in DirectoryStore(root).manifests()))
        DirectoryStore(root).gc()
        assert not DirectoryStore(root).missing(referenced)
        assert not list((root / "tmp").iterdir())  # gc removed what the killed save left behind
        assert check_store(root) == len(DirectoryStore(root).manifest_ids())
    assert seen > TRIALS  # the writer got manifests written before most kills
