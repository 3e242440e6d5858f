"""Hooks that force an interleaving: a gate that holds chosen calls until the test opens it, a call run on
a daemon thread whose result is awaited with a bound (a deadlock fails the test instead of hanging the
suite), and a generation stream that holds the engine thread at its first token."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kiln.engine.sequence import Event, TokenEvent
from kiln.engine.stream import GenerationStream

WAIT_S = 30.0  # bound on every wait: far longer than any step here takes, short enough to fail a hang


class Gate:
    """Holds the calls it wraps (those `when` accepts) until `open()`; `entered` is set by the first.
    An open gate lets calls through (and still announces them)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def wrap(self, fn: Callable[..., Any], when: Callable[..., bool] = lambda *a, **k: True) -> Callable[..., Any]:
        def held(*args: Any, **kwargs: Any) -> Any:
            if when(*args, **kwargs):
                self.entered.set()
                self.opened.wait(WAIT_S)
            return fn(*args, **kwargs)

        return held

    def open(self) -> None:
        self.opened.set()


def on_thread(name: str) -> Callable[..., bool]:
    """A `when` for Gate.wrap: calls made on the thread of that name."""
    return lambda *a, **k: threading.current_thread().name == name


class Call:
    """`fn(*args)` on a daemon thread; `result()` waits at most WAIT_S (TimeoutError: it is stuck)."""

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str | None = None) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            self._value = fn(*args)
        except BaseException as error:  # noqa: BLE001 - handed to the waiting test
            self._error = error
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout_s: float = WAIT_S) -> Any:
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"still blocked after {timeout_s:.0f} s")
        if self._error is not None:
            raise self._error
        return self._value


def wait_for(condition: Callable[[], bool], timeout_s: float = WAIT_S) -> bool:
    """Poll a condition another thread makes true (for states no event announces)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class HeldStream(GenerationStream):
    """Holds the engine thread at its first token until `release` is set: the session stays generating."""

    def __init__(self, cancel: Callable[..., None]) -> None:
        super().__init__(cancel)
        self.first_token = threading.Event()
        self.release = threading.Event()

    def emit(self, event: Event) -> None:
        if isinstance(event, TokenEvent) and not self.first_token.is_set():
            self.first_token.set()
            self.release.wait(WAIT_S)
        super().emit(event)
