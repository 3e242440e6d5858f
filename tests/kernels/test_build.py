"""Start-up cannot brick itself (kiln/kernels/build.py): a start killed at any moment, during a cold build or
while loading a built library, and locks left behind by dead processes, never make a later start wait
beyond a bound; the library is found by what it is built from, not by where its sources lie; and a
non-editable install ships the sources and loads the same library.

The cold build runs once, into a private extensions directory (never the user's cache), and the other tests
load what it built, so the module costs one build and a killed part of another.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from kiln.kernels import build, supported
from tests.kernels.processes import ROOT, Run, dead_pid, start

pytestmark = pytest.mark.skipif(not supported(), reason="Kiln's CPU kernels do not run here")

COLD_S = 900  # a cold build of all the kernels on a busy 2-core machine, with room to spare
WARM_S = 120  # importing torch and a built library, on the same machine
COMPILING = "compiling Kiln's CPU kernels"
WARM_KILLS = 6


@dataclass
class ColdStart:
    extensions: Path  # TORCH_EXTENSIONS_DIR of the private build
    home: Path  # its kiln_kernels_<digest> directory
    killed: Run  # the first start, SIGKILLed during its build
    starts: list[Run]  # the starts after it, run together


def plant_stale_locks(extensions: Path, home: Path) -> None:
    """What dead starts leave: PyTorch's own build lock where its builder kept it (the lock that hung every
    later start), a build lock file naming a dead holder, a dead process's half-done build directory
    with PyTorch's lock inside, and an earlier failed build's log (whose name a dead build's directory's
    pattern also matches: the next build once failed on it)."""
    (extensions / home.name).mkdir(parents=True)
    (extensions / home.name / "lock").touch()
    home.mkdir(parents=True)
    (home / "lock").touch()
    (home / "build.lock").write_text(str(dead_pid()))
    leftover = home / f"build-{dead_pid()}-stale"
    leftover.mkdir()
    (leftover / "lock").touch()
    (leftover / "linear.o").write_bytes(b"half an object file")
    (home / "build-failure.log").write_text("an earlier failed build's compiler output\n")


def compiler_without_openmp(directory: Path) -> str:
    """The machine's C++ compiler, except that it refuses -fopenmp, as compilers built without OpenMP do
    (the kernels use their own thread pool and build without it)."""
    script = directory / "c++-without-openmp"
    script.write_text("""#!/bin/sh
for arg in "$@"; do
  if [ "$arg" = "-fopenmp" ]; then echo "c++-without-openmp: unsupported option -fopenmp" >&2; exit 1; fi
done
exec c++ "$@"
""")
    script.chmod(0o755)
    return str(script)


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> ColdStart:
    """A cold start killed at a random moment of its build, among stale locks; then two starts at once.
    Built by a compiler without OpenMP."""
    base = tmp_path_factory.mktemp("cold")
    extensions = base / "extensions"
    home = extensions / "kiln" / build.name()
    plant_stale_locks(extensions, home)
    compiler = compiler_without_openmp(base)
    killed = start(base / "run", extensions, CXX=compiler)
    killed.wait_for(COMPILING, WARM_S)
    killed.run_for(random.uniform(0.0, 20.0))  # a random moment of the build (or its end)
    killed.kill()
    starts = [start(base / "run", extensions, CXX=compiler) for _ in range(2)]
    for run in starts:
        assert run.wait(COLD_S) == 0, run.stderr[-3000:]
    return ColdStart(extensions, home, killed, starts)


@pytest.mark.timeout(2 * COLD_S)
def test_a_start_killed_during_the_cold_build_among_stale_locks_leaves_later_starts_working(cold: ColdStart) -> None:
    libraries = {run.loaded()[1] for run in cold.starts}
    assert len(libraries) == 1  # both loaded the one library (one built it, the other waited for it)
    compiled = [run for run in cold.starts if COMPILING in run.stderr]
    assert len(compiled) <= 1, "two concurrent first starts both compiled"
    if COMPILING in cold.killed.stderr and not compiled:  # the killed start had finished its build
        assert "compiled Kiln's CPU kernels" in cold.killed.stderr
    library = cold.home / f"{cold.home.name}.so"
    assert library.is_file()
    assert not list(cold.home.glob("build-*")), "a dead build's directory was left behind"


def test_kills_while_loading_a_built_library_never_block_the_next_start(cold: ColdStart, tmp_path: Path) -> None:
    for _ in range(WARM_KILLS):
        run = start(tmp_path, cold.extensions)
        run.run_for(random.uniform(0.0, 5.0))  # importing torch, kiln, the library, or done
        run.kill()
    after = start(tmp_path, cold.extensions)
    assert after.wait(WARM_S) == 0, after.stderr
    assert after.loaded()[1] == cold.home / f"{cold.home.name}.so"
    assert COMPILING not in after.stderr


def test_a_leftover_build_lock_does_not_hang_a_start(cold: ColdStart, tmp_path: Path) -> None:
    """The old hang, precisely: PyTorch's builder waited forever on a `lock` file a killed start left in the
    build directory. Locks of every kind left behind, with the library built: the start loads at once."""
    for directory in (cold.extensions / cold.home.name, cold.home, cold.home / f"build-{dead_pid()}-stale"):
        directory.mkdir(exist_ok=True)
        (directory / "lock").touch()
    (cold.home / "build.lock").write_text(str(dead_pid()))
    run = start(tmp_path, cold.extensions)
    assert run.wait(WARM_S) == 0, run.stderr
    assert COMPILING not in run.stderr


def copy_package(to: Path) -> Path:
    shutil.copytree(ROOT / "kiln", to / "kiln", ignore=shutil.ignore_patterns("__pycache__"))
    return to


def test_two_copies_of_the_sources_share_one_build(cold: ColdStart, tmp_path: Path) -> None:
    """The library is named by what it is built from: copies of the package elsewhere load the one built
    from this checkout, and neither compiles."""
    for name in ("first", "second"):
        copy = copy_package(tmp_path / name)
        run = start(tmp_path, cold.extensions, path=copy)
        assert run.wait(WARM_S) == 0, run.stderr
        package, library = run.loaded()
        assert package.is_relative_to(copy)
        assert library == cold.home / f"{cold.home.name}.so"
        assert COMPILING not in run.stderr


def test_a_non_editable_install_ships_the_sources_and_loads_the_kernels(cold: ColdStart, tmp_path: Path) -> None:
    source = copy_package(tmp_path / "source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", str(source), "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel")],
                   cwd=tmp_path, check=True, capture_output=True)
    (wheel,) = (tmp_path / "wheel").glob("kiln-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    sources = {f"kiln/kernels/{path.name}" for path in build.sources() + build.headers()}
    assert sources <= shipped, f"the wheel lacks {sorted(sources - shipped)}"
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], cwd=tmp_path, check=True,
                   capture_output=True)
    run = start(tmp_path, cold.extensions, path=site)
    assert run.wait(WARM_S) == 0, run.stderr
    package, library = run.loaded()
    assert package.is_relative_to(site)
    assert library == cold.home / f"{cold.home.name}.so"  # the same digest: the library built from the checkout
