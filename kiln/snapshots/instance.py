"""An instance's own snapshot directory: where `kiln serve` persists sessions unless told otherwise.

The rule (docs/architecture.md § Instances): every server is an instance with a name, `--instance-id`,
by default its model's name (`gemma-3-270m-q4_k_m` for the embedded model, a directory's or file's
name otherwise). Its default store is its own directory, `<data>/kiln/instances/<name>/snapshots`
(<data>: $XDG_DATA_HOME, else ~/.local/share), so a restart of the same instance finds its sessions
and a server of another model or name never lists them. While a server runs, it holds the directory's
lock (flock(2), dropped by the kernel when the process dies, so it never goes stale): a second server
of the same instance is refused at start, naming both ways on (another --instance-id, or sharing the
first one's store explicitly). Sharing is always explicit: `--snapshot-dir`/`--snapshot-store` given, the
servers name their instances apart themselves (the default then is host and gRPC address, unique per
machine, kiln/snapshots/ownership.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path

from kiln.errors import FailedPreconditionError, InvalidArgumentError

INSTANCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
EMBEDDED_INSTANCE = "gemma-3-270m-q4_k_m"  # the embedded model's file, gemma-3-270m-q4_k_m.gguf, by its stem
_LOCK_FILE = "serve.lock"


def data_directory() -> Path:
    """$XDG_DATA_HOME/kiln, else ~/.local/share/kiln."""
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data) / "kiln"


def instance_for_model(model: str | None) -> str:
    """The default instance name of a server of `model` (None: the embedded one): its directory's or
    file's name, characters a directory name cannot safely hold replaced by '-'."""
    if model is None:
        return EMBEDDED_INSTANCE
    path = Path(model).expanduser()
    stem = path.name if path.is_dir() or not path.suffix else path.stem
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip(".-_")[:128] or "model"


def default_directory(instance: str = EMBEDDED_INSTANCE) -> Path:
    """Where `kiln serve` of `instance` keeps its snapshots unless told otherwise."""
    if not isinstance(instance, str) or not INSTANCE_NAME.fullmatch(instance):
        raise InvalidArgumentError(f"--instance-id names a directory of this instance's sessions: 1-128 characters of "
                                   f"[A-Za-z0-9._-], starting with a letter or digit, got {str(instance)[:64]!r}",
                                   "instance_id")
    return data_directory() / "instances" / instance / "snapshots"


@contextlib.contextmanager
def instance_lock(instance: str) -> Iterator[Path]:
    """Hold `instance`'s directory (yielding its default snapshot directory) for as long as a server of it
    runs; FailedPreconditionError, at once, when another live process holds it."""
    snapshots = default_directory(instance)
    snapshots.mkdir(parents=True, exist_ok=True)
    fd = os.open(snapshots.parent / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise FailedPreconditionError(
                f"instance {instance} is already served by process {holder} (its sessions: {snapshots}); give "
                f"this server its own with --instance-id NAME, or share that one's sessions explicitly with "
                f"--snapshot-dir {snapshots}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield snapshots
    finally:
        os.close(fd)  # drops the flock when held
