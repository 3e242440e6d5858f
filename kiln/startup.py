"""What a `kiln` command shows while it starts, and how it stops when interrupted then.

A first start takes tens of seconds (describing a GGUF file, converting weights, compiling the kernels), a
warm one seconds, most of them importing torch. The command names each phase on stderr as it begins
(`phase`), and a conversion that runs for more than PROGRESS_AFTER_S draws a progress bar (`progress`).
Library use (an `LLM` in a program) stays silent: only `enabled` (the command line) turns the lines on.

Ctrl-C at any moment of a start exits with status 130 (the shell's for SIGINT) and no Python traceback:
importing this module as the command (`kiln`, `python -m kiln.cli`) sets that handler, before the command
imports torch, seconds during which Python's default handler prints a dozen lines of KeyboardInterrupt. A
second Ctrl-C while the first unwinds exits at once. A server replaces the handler with its graceful
shutdown once it listens (kiln/server/app.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C
PROGRESS_AFTER_S = 2.0  # a conversion shorter than this draws no bar
_REDRAW_S = 0.2
_BAR_WIDTH = 30
T = TypeVar("T")


class _Reporter:
    """The command's prefix ("kiln serve"), or None while the lines are off (library use)."""

    prefix: str | None = None


_reporter = _Reporter()


@contextlib.contextmanager
def enabled(prefix: str) -> Iterator[None]:
    """The phase lines on while the command runs, each starting with `prefix` ("kiln serve"); off again
    after (a test or a program that calls the command's `main` keeps its silence)."""
    previous, _reporter.prefix = _reporter.prefix, prefix
    try:
        yield
    finally:
        _reporter.prefix = previous


def phase(text: str) -> None:
    """One line on stderr naming what the start does now (nothing unless enabled)."""
    if _reporter.prefix is not None:
        print(f"{_reporter.prefix}: {text}", file=sys.stderr, flush=True)


def progress(items: Iterable[T], total: int, text: str, unit: str) -> Iterator[T]:
    """`items` as they are, announced as a phase (`text`) and, while it runs past PROGRESS_AFTER_S, drawn
    as a bar of `total` `unit`s: redrawn in place on a terminal; elsewhere (a log) one line when it ends."""
    phase(text)
    started = last = time.monotonic()
    drawn = False
    terminal = _reporter.prefix is not None and sys.stderr.isatty()
    for done, item in enumerate(items, 1):
        yield item
        now = time.monotonic()
        if terminal and now - started >= PROGRESS_AFTER_S and (now - last >= _REDRAW_S or done == total):
            filled = _BAR_WIDTH * done // max(total, 1)
            print(f"\r  [{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {done}/{total} {unit}, {now - started:.0f} s",
                  end="", file=sys.stderr, flush=True)
            drawn, last = True, now
    seconds = time.monotonic() - started
    if drawn:
        print(file=sys.stderr, flush=True)
    if seconds >= PROGRESS_AFTER_S:
        phase(f"done in {seconds:.1f} s")


def _interrupted(signum: int, frame: object) -> None:
    signal.signal(signal.SIGINT, lambda *_: os._exit(EXIT_INTERRUPTED))
    raise SystemExit(EXIT_INTERRUPTED)


def _started_as_command() -> bool:
    """Whether this process is the `kiln` command (the console script, or `python -m kiln.cli`), not a
    program or a test that imports kiln: only the command's Ctrl-C is this module's to handle."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == "kiln.cli" or Path(sys.argv[0]).name == "kiln"


if _started_as_command() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted)
