"""Building and loading the kernels' shared library, found by the digest of what it is built from, never by
where the sources lie, and never behind a lock that a dead process can leave.

Under the root ($TORCH_EXTENSIONS_DIR/kiln, else ~/.cache/torch_extensions/kiln), for one digest:

    kiln_kernels_<digest>/kiln_kernels_<digest>.so   the finished library, imported directly: no lock, no ninja
    kiln_kernels_<digest>/build.lock                 flock(2)ed by the one process building it
    kiln_kernels_<digest>/build-<pid>-<random>/      a build in progress: sources copied in, compiled there by
                                                     PyTorch's builder, the library renamed into place when done;
                                                     its owner.lock flock(2)ed by the process building there

The digest covers the sources' bytes, the compiler flags, PyTorch's and Python's versions and the machine,
not their paths, so every checkout (or installed copy) of one version finds the same library, and a changed
source or PyTorch never loads a stale one. The library appears under its final name only by an atomic
rename of a complete, fsync'ed file, so a process killed at any moment leaves either no library or a
whole one. The build lock is an flock, which the kernel drops when its holder dies, so it cannot go stale;
a holder still alive after BUILD_WAIT_S is no longer waited for (a second build in a private directory
costs time, never correctness: the last rename wins and both files are whole). A build directory whose
owner.lock nobody holds (its process died) is removed by the next build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from kiln.errors import UnavailableError

SOURCE_DIR = Path(__file__).parent
# -ffp-contract=off: the compiler must not fuse a multiply and an add on its own, which it may do in one
# inlined copy of a loop and not in another; the kernels' results must not depend on which copy ran.
# -mf16c: float16 KV pages and scales (attention.cpp, kv_store.cpp); every AVX2 CPU has F16C.
# No -fopenmp: the kernels run on their own thread pool (pool.h), and a compiler without OpenMP builds them.
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off")
LDFLAGS: tuple[str, ...] = ()
# Longest wait for another live process's build before building here too: far longer than a build takes,
# even on a busy machine, so only a holder that is stuck (stopped, hung) is given up on.
BUILD_WAIT_S = 1200.0
_FORMAT = b"kiln-kernels/2"  # the layout above; a change of it is a new digest


def sources(source_dir: Path = SOURCE_DIR) -> list[Path]:
    """The translation units, in a fixed order."""
    return sorted(source_dir.glob("*.cpp"))


def headers(source_dir: Path = SOURCE_DIR) -> list[Path]:
    return sorted(source_dir.glob("*.h"))


def digest(source_dir: Path = SOURCE_DIR) -> str:
    """What the library is built from, as 16 hex digits: the name of its directory and module."""
    h = hashlib.sha256(_FORMAT)
    for path in sources(source_dir) + headers(source_dir):
        h.update(f"\0{path.name}\0{path.stat().st_size}\0".encode())
        h.update(path.read_bytes())
    abi = f"{sys.implementation.cache_tag}{getattr(sys, 'abiflags', '')}"
    for part in (*CFLAGS, "|", *LDFLAGS, "|", torch.__version__, abi, platform.machine()):
        h.update(f"\0{part}".encode())
    return h.hexdigest()[:16]


def root() -> Path:
    """Where built libraries live: per user and machine, shared by every checkout and installed copy."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "torch_extensions"
    return Path(base).expanduser() / "kiln"


def name(source_dir: Path = SOURCE_DIR) -> str:
    """The library's module name, and its directory's under the root."""
    return f"kiln_kernels_{digest(source_dir)}"


def library_path(source_dir: Path = SOURCE_DIR) -> Path:
    module = name(source_dir)
    return root() / module / f"{module}.so"


def load(source_dir: Path = SOURCE_DIR) -> ModuleType:
    """The extension built from `source_dir`: imported when built already, else built first (once per
    machine, each process that finds it missing printing what it does to stderr). Raises UnavailableError
    naming the cause when it cannot be built or imported."""
    if not sources(source_dir):
        raise UnavailableError(f"the kernels' sources are missing from {source_dir} (a package built without its data files)")
    library = library_path(source_dir)
    module = library.stem
    if library.exists():
        with contextlib.suppress(ImportError):
            return _import(module, library)
        library.unlink(missing_ok=True)  # unreadable (a damaged disk, a foreign file): built again below
    home = library.parent
    home.mkdir(parents=True, exist_ok=True)
    with _build_lock(home):
        if library.exists():  # built by the process we waited for
            return _import(module, library)
        _remove_dead_builds(home)
        return _build(module, source_dir, library)


def _import(module: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"{library} is not a loadable extension")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


@contextlib.contextmanager
def _build_lock(home: Path) -> Iterator[None]:
    """Held while this process builds, so concurrent first uses build once. Waits at most BUILD_WAIT_S
    for a live holder (telling the user whom it waits for), then goes on without the lock."""
    fd = os.open(home / "build.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + BUILD_WAIT_S
        if not _try_flock(fd):
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            _say(f"Kiln's CPU kernels: waiting for process {holder}, which is building them")
            while not _try_flock(fd):
                if time.monotonic() >= deadline:
                    _say(f"Kiln's CPU kernels: still being built elsewhere after {BUILD_WAIT_S:.0f} s; building here too")
                    break
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)  # whom the next waiter waits for
        yield
    finally:
        os.close(fd)  # drops the flock when held


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def _work_directory(home: Path) -> Iterator[Path]:
    """A private build directory, flock'ed (its `owner.lock`) for as long as this process uses it, and removed
    after: a directory whose lock can be taken has no live owner (_remove_dead_builds)."""
    work = Path(tempfile.mkdtemp(prefix=f"build-{os.getpid()}-", dir=home))
    fd = os.open(work / "owner.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)
        os.close(fd)


def _remove_dead_builds(home: Path) -> None:
    """Build directories whose process is gone (killed mid-build): never finished, never to be."""
    for work in home.glob("build-*"):
        if not work.is_dir():  # build-failure.log
            continue
        try:
            fd = os.open(work / "owner.lock", os.O_RDWR)
        except FileNotFoundError:  # killed before it took the lock
            shutil.rmtree(work, ignore_errors=True)
            continue
        try:
            if _try_flock(fd):
                shutil.rmtree(work, ignore_errors=True)
        finally:
            os.close(fd)


def _build(module: str, source_dir: Path, library: Path) -> ModuleType:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise UnavailableError(f"no C++ compiler to build Kiln's CPU kernels ({os.environ.get('CXX', 'c++')!r} is not on PATH; set CXX)")
    _ninja_on_path()
    with _work_directory(library.parent) as work:
        for path in sources(source_dir) + headers(source_dir):
            shutil.copyfile(path, work / path.name)
        _say(f"compiling Kiln's CPU kernels once for this machine (a minute or two) into {library.parent} ...")
        started = time.monotonic()
        from torch.utils.cpp_extension import load as torch_load  # imported late: it pulls in setuptools

        try:  # is_python_module=False: built (and dlopened) only; imported below from where every process finds it
            torch_load(name=module, sources=[str(work / p.name) for p in sources(source_dir)], extra_cflags=list(CFLAGS),
                       extra_ldflags=list(LDFLAGS), build_directory=str(work), is_python_module=False)
        except Exception as error:  # a compiler error, no ninja, a failed link or load: all mean "not here"
            raise UnavailableError(f"could not build Kiln's CPU kernels: {_summary(error, library.parent)}") from error
        _publish(work / library.name, library)
    (library.parent / "build-failure.log").unlink(missing_ok=True)  # an earlier failure's, now stale
    _say(f"compiled Kiln's CPU kernels in {time.monotonic() - started:.0f} s")
    return _import(module, library)


def _publish(built: Path, library: Path) -> None:
    """Move the finished library into place whole: its bytes on disk first, then one rename."""
    with open(built, "rb") as f:
        os.fsync(f.fileno())
    os.replace(built, library)
    directory = os.open(library.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _summary(error: Exception, home: Path) -> str:
    """The first line of the output that names an error (a compiler's first complaint; else the error's
    first line), the full text kept in `home`/build-failure.log: a compiler's output is long."""
    text = str(error).strip() or type(error).__name__
    log = home / "build-failure.log"
    with contextlib.suppress(OSError):
        log.write_text(text + "\n")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    complaints = [line for line in lines[1:] if re.search(r"\berror\b", line, re.IGNORECASE) and not line.startswith("[")]
    return f"{type(error).__name__}: {(complaints or lines)[0][:300]} (full output: {log})"


def _ninja_on_path() -> None:
    """PyTorch's builder runs `ninja` from PATH; the pip package's binary is found even outside an
    activated virtual environment."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
