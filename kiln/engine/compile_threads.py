"""Grammar compiles on threads of their own: a large stack and a time bound.

llguidance compiles recursively in Rust on the calling thread, so a deep enough grammar overflows the
stack of an ordinary thread (8 MiB) and the whole process dies with it. Every compile therefore runs on
a fresh thread with `stack_bytes` of stack (address space reserved, only the pages a compile touches
are committed), enough for everything constraint_limits.py lets through (bench/README.md § design
figures). The caller waits at most `timeout_s`; a compile still running then is refused with
InvalidArgumentError naming the time limit. Its thread cannot be stopped (it is inside Rust), so it
runs on and its result is dropped.

The rule that bounds them: at most `max_threads` compile threads exist at once, those past their time
limit included. A compile that finds none free waits for one within its own time bound, then is refused
with ResourceExhaustedError; a thread frees its place when its compile returns, late or not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kiln.errors import InvalidArgumentError, ResourceExhaustedError

T = TypeVar("T")

_stack_size_lock = threading.Lock()  # threading.stack_size is process-wide: set, start, restore


@dataclass
class _Job(Generic[T]):
    work: Callable[[], T]
    done: threading.Event = field(default_factory=threading.Event)
    result: T | None = None
    error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.work()
        except BaseException as error:  # handed to the waiting caller, who raises it
            self.error = error
        finally:
            self.done.set()


class CompileThreads:
    """Runs compiles on big-stack threads under a time bound and a bound on threads (module docstring).
    Thread-safe."""

    def __init__(self, timeout_s: float = 10.0, max_threads: int = 4, stack_bytes: int = 64 << 20) -> None:
        if not timeout_s > 0 or max_threads < 1 or stack_bytes < (1 << 20):
            raise InvalidArgumentError("compile threads need timeout_s > 0, max_threads >= 1 and a stack of >= 1 MiB")
        self.timeout_s = timeout_s
        self.max_threads = max_threads
        self.stack_bytes = stack_bytes
        self._places = threading.BoundedSemaphore(max_threads)

    def run(self, work: Callable[[], T], what: str, param: str | None = None) -> T:
        """`work()` on a compile thread: its result, or its exception re-raised here. Raises
        InvalidArgumentError naming `what`, `param` and the time limit if it takes longer than
        `timeout_s`, ResourceExhaustedError if no compile thread frees up within that time."""
        deadline = time.monotonic() + self.timeout_s
        if not self._places.acquire(timeout=self.timeout_s):
            raise ResourceExhaustedError(
                f"{self.max_threads} grammar compiles are running (some past their {self.timeout_s:g} s limit); "
                f"{what} was not compiled, try again"
            )
        job: _Job[T] = _Job(work)
        try:
            self._start(job)
        except BaseException:
            self._places.release()
            raise
        if not job.done.wait(max(deadline - time.monotonic(), 0.0)):
            raise InvalidArgumentError(
                f"{what} is over the compile_timeout_s limit: it took longer than {self.timeout_s:g} s to compile",
                param,
            )
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[return-value]

    def _start(self, job: _Job) -> None:
        def body() -> None:
            try:
                job.run()
            finally:
                self._places.release()

        thread = threading.Thread(target=body, name="kiln-grammar-compile", daemon=True)
        with _stack_size_lock:
            previous = threading.stack_size(self.stack_bytes)
            try:
                thread.start()
            finally:
                threading.stack_size(previous)
