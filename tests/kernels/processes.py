"""Python subprocesses that load the kernels, for the build tests: each in a session of its own, so that a
kill takes the compilers it started with it, and with its output in files the test reads while it runs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Loads the kernels of whichever `kiln` the path finds first and says which package and library it got.
LOAD = (
    "import kiln, kiln.kernels as k; m = k.kernels(); "
    "print('loaded', kiln.__file__, m.__file__, sep='\\n', flush=True)"
)


@dataclass
class Run:
    process: subprocess.Popen
    out: Path
    err: Path

    @property
    def stdout(self) -> str:
        return self.out.read_text()

    @property
    def stderr(self) -> str:
        return self.err.read_text()

    def wait(self, timeout: float) -> int:
        """The exit status; the process group is killed (and the test fails) when it runs past `timeout`."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout:.0f} s:\n{self.stderr[-3000:]}") from None

    def run_for(self, seconds: float) -> None:
        """Lets it run for `seconds`, or until it exits if sooner (a moment to kill it at)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(seconds)

    def wait_for(self, text: str, timeout: float) -> None:
        """Until `text` appears on stderr (the process still running)."""
        deadline = time.monotonic() + timeout
        while text not in self.stderr:
            assert self.process.poll() is None, f"exited {self.process.returncode} before {text!r}:\n{self.stderr[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout:.0f} s"
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL to the process and everything it started (its own session, so its own group)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def loaded(self) -> tuple[Path, Path]:
        """(kiln package, kernels library) the run reported."""
        lines = self.stdout.splitlines()
        assert lines and lines[0] == "loaded", f"no kernels loaded:\n{self.stderr[-3000:]}"
        return Path(lines[1]), Path(lines[2])


def start(directory: Path, extensions: Path, code: str = LOAD, path: Path | None = None, **env: str) -> Run:
    """`python -c code` with TORCH_EXTENSIONS_DIR=extensions and `path` (default: this checkout) first on
    sys.path, run in `directory` (outside any checkout, so the path decides which kiln is imported)."""
    directory.mkdir(parents=True, exist_ok=True)
    out, err = (directory / f"{time.monotonic_ns()}.{name}" for name in ("out", "err"))
    full_env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "PYTHONPATH": str(path or ROOT), **env}
    with open(out, "w") as stdout, open(err, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-c", code], cwd=directory, env=full_env, stdout=stdout,
                                   stderr=stderr, start_new_session=True)
    return Run(process, out, err)


def dead_pid() -> int:
    """The id of a process that has exited (a killed build's owner, for leftovers)."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid
