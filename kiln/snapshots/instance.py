"""An instance's own snapshot directory: where `kiln serve` persists sessions unless told otherwise.

The rule (docs/architecture.md § Instances): every server is an instance with a name, `--instance-id`,
by default its model's name (`gemma-3-270m-q4_k_m` for the embedded Gemma, `smollm2-135m-instruct` for
the embedded SmolLM2, a directory's or file's name otherwise). Its default store is its own directory,
`<data>/kiln/instances/<name>/snapshots` (<data>: $XDG_DATA_HOME, else ~/.local/share), so a restart of
the same instance finds its sessions and a server of another model or name never lists them. While a
server runs, it holds the directory's lock (flock(2), dropped by the kernel when the process dies, so it
never goes stale): a second server of the same instance is refused at start, naming both ways on (another
--instance-id, or sharing the first one's store explicitly). Sharing is always explicit: `--snapshot-dir`/`--snapshot-store` given, the
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
from kiln.models.catalog import resolve
from kiln.models.embedded import DEFAULT_MODEL, EMBEDDED_MODELS
from kiln.paths import data_directory

INSTANCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
EMBEDDED_INSTANCE = EMBEDDED_MODELS[DEFAULT_MODEL].instance  # the default model's: gemma-3-270m-q4_k_m
_LOCK_FILE = "serve.lock"


def instance_for_model(model: str | None) -> str:
    """The default instance name of a server of `model`, a name or path as `--model` takes it (None: the
    default embedded model): an embedded model's own instance name, else the name `kiln models` gives it
    (a directory's or file's name), characters a directory name cannot safely hold replaced by '-'.
    UnknownModelError for a model that does not resolve."""
    entry = resolve(model)
    if entry.embedded is not None:
        return entry.embedded.instance
    return re.sub(r"[^A-Za-z0-9._-]+", "-", entry.name).strip(".-_")[:128] or "model"


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
