"""Snapshot directories that stop taking writes under a running server: a bind mount remounted read-only,
a small tmpfs filled up. chmod would not stop the root user these tests run as; a mount does. Both need
root and mount(8); elsewhere the tests that use them skip."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"mount {' '.join(args)}: {done.stderr.strip()}")


def _umount(target: Path) -> None:
    """Unmount; lazily if something (a killed server's last open file) still holds it busy."""
    if subprocess.run(["umount", str(target)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(target)], check=True, capture_output=True)


@contextmanager
def _mounted(target: Path, *args: str) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a snapshot directory needs root")
    target.mkdir(parents=True, exist_ok=True)
    try:
        _mount(*args, str(target))
    except OSError as error:
        pytest.skip(f"cannot mount here: {error}")
    try:
        yield target
    finally:
        _umount(target)


@contextmanager
def bind_mount(source: Path, target: Path) -> Iterator[Path]:
    """`source` seen at `target` (writable until `read_only(target)`); unmounted at the end."""
    source.mkdir(parents=True, exist_ok=True)
    with _mounted(target, "--bind", str(source)) as mounted:
        yield mounted


def read_only(target: Path, on: bool, timeout: float = 10.0) -> None:
    """Make a bind mount read-only (`on`) or writable again under a running server. The kernel refuses
    (EBUSY) while a file on the mount is open for writing, as during a save: retried until a moment
    between two writes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _mount("-o", f"remount,bind,{'ro' if on else 'rw'}", str(target))
            return
        except OSError as error:
            if "busy" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.001)


@contextmanager
def tmpfs(target: Path, size_mb: int) -> Iterator[Path]:
    with _mounted(target, "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs") as mounted:
        yield mounted


def fill(directory: Path) -> Path:
    """Write a file until the filesystem has no byte left; returns it (delete it to give the space back)."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as out:
        for chunk in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    out.write(b"\0" * chunk)
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
    return filler
