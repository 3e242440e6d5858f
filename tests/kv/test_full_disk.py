"""The KV disk tier on a real full filesystem (a 2 MiB tmpfs, filled): a page write fails with a typed
error and the page stays where it was, in the tiers and in the KVCache; nothing dies. The scenarios run in
a child process (tests/kv/full_disk_scenarios.py), so a SIGBUS fails the test rather than the run."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def full_filesystem(tmp_path) -> Iterator[Path]:
    """A 2 MiB tmpfs mounted for this test, filled to the last block by `filler`; unmounted after."""
    mount = tmp_path / "full"
    mount.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)]
    mounted = subprocess.run(command, capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root / CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        with open(mount / "filler", "wb") as filler:
            try:
                while True:
                    filler.write(b"\xff" * 65536)
                    filler.flush()
            except OSError:
                pass
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def run_scenario(name: str, directory: Path) -> None:
    child = subprocess.run([sys.executable, "-m", "tests.kv.full_disk_scenarios", name, str(directory)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode != -signal.SIGBUS, "writing the disk tier on a full filesystem killed the process (SIGBUS)"
    assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr[-3000:]


def test_a_full_disk_keeps_tier_pages_where_they_were(full_filesystem):
    run_scenario("tiers", full_filesystem)


def test_a_full_disk_keeps_cache_pages_resident_and_logits_exact(full_filesystem):
    run_scenario("cache", full_filesystem)
