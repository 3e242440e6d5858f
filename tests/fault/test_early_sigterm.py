"""A `kiln serve` SIGTERMed within its first seconds (a supervisor's stop, Ctrl-C during a silent start),
several times, at random moments and once right while a kernel build lock file exists: the next start
still reaches ready within a bound, instead of waiting forever on a lock a dead process left.

The starts use a private copy of the kernel build directory (TORCH_EXTENSIONS_DIR): a lock left behind
there cannot hang the other tests and processes that share the machine's own. Torch's `lock` files
are not copied: a lock some other process holds or left must not decide this test."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.fault.node import VOCAB
from tests.server.conftest import free_port, start_server

TRIALS = 5
READY_BOUND_S = 90.0  # a warm start takes seconds; a start that waits on a dead process's lock never ends
LOCK_WAIT_S = 5.0  # how long the first trial watches for a lock file to appear


def private_extensions(target: Path) -> Path:
    """A copy of the machine's kernel build directory, built libraries included (no rebuild needed)."""
    source = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "torch_extensions")
    if source.exists():
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("lock"), symlinks=True)
    target.mkdir(parents=True, exist_ok=True)
    return target


def lock_appears(root: Path, process: subprocess.Popen, timeout: float) -> bool:
    """Whether a build lock file (torch's `lock`) appears under `root` while `process` runs, within
    `timeout`. The lock of a warm start lives a few milliseconds (ninja finds nothing to do), so this
    polls the directories that exist without sleeping, and looks for new ones now and then."""
    deadline = time.monotonic() + timeout
    directories: list[Path] = []
    for sweep in range(10**9):
        if sweep % 1000 == 0:
            directories = [root, *(path for path in root.rglob("*") if path.is_dir())]
            if process.poll() is not None or time.monotonic() > deadline:
                return False
        if any(os.path.exists(directory / "lock") for directory in directories):
            return True
    return False


def test_starts_sigtermed_early_never_stop_the_next_start(model, reference, tmp_path, monkeypatch):
    """`reference` is only asked for so that this checkout's kernels are built before they are copied."""
    extensions = private_extensions(tmp_path / "torch_extensions")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    rng = random.Random(3)
    command = [sys.executable, "-m", "kiln.cli", "serve", "--model", str(model.path), "--no-persist",
               "--kv-budget-mb", "64"]
    env = {**os.environ, "KILN_CACHE_DIR": str(model.cache)}
    for trial in range(TRIALS):
        process = subprocess.Popen([*command, "--grpc-port", str(free_port()), "--http-port", str(free_port())],
                                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if trial == 0:  # the moment the old bug needs: while a build lock file exists (a start that takes
            lock_appears(extensions, process, LOCK_WAIT_S)  # none is SIGTERMed after LOCK_WAIT_S all the same)
        else:
            time.sleep(rng.uniform(0.05, 3.0))
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    try:
        server = start_server(str(model.path), model.cache, vocab_size=VOCAB, timeout=READY_BOUND_S)
    except RuntimeError as error:
        locks = sorted(str(path.relative_to(extensions)) for path in extensions.rglob("lock"))
        raise AssertionError(f"not ready within {READY_BOUND_S} s after {TRIALS} early SIGTERMs; lock files "
                             f"left: {locks}") from error
    assert server.stop() < 30 and server.process.returncode == 0
