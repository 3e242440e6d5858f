"""A real `redis-server` on a free loopback port that a test can stop and start again on the same port with
its data: an append-only file fsynced on every write, as a Redis that stores sessions would be run."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import redis

from tests.fault.ledger import eventually
from tests.server.conftest import free_port
from tests.snapshots.conftest import REDIS_SERVER


class DurableRedis:
    def __init__(self, root: Path) -> None:
        if not Path(REDIS_SERVER).exists():
            pytest.skip("redis-server is not installed (`make test` installs it when it runs as root)")
        self.root = root
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self, timeout: float = 10.0) -> None:
        """Start (again) on this port and directory; returns once it answers PING."""
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.root), "--save", "",
             "--appendonly", "yes", "--appendfsync", "always"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        eventually(lambda: self.process.poll() is not None or self.answers(), timeout, "redis-server answers PING")
        assert self.process.poll() is None, "redis-server exited at start"

    def answers(self) -> bool:
        with redis.Redis(port=self.port) as client:
            try:
                return bool(client.ping())
            except redis.exceptions.ConnectionError:
                return False

    def stop(self, sig: int = signal.SIGKILL) -> None:
        """End this process (SIGKILL by default: what every write fsynced so far survives)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait()
