"""Stores for the snapshot tests: a temporary directory, and a real `redis-server` on a free loopback port
(the Debian package; `make test` installs it when missing)."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.server.conftest import free_port, servers_root  # noqa: F401 - a fixture the server tests share

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisProcess:
    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = root
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(root), "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        client.close()

    def flush(self) -> None:
        with redis.Redis(port=self.port) as client:
            client.flushdb()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[RedisProcess]:
    if not Path(REDIS_SERVER).exists():
        pytest.skip("redis-server is not installed and could not be installed (`make test` runs "
                    "`apt-get install -y redis-server` when it runs as root)")
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """The shared Redis, emptied for this test."""
    redis_server.flush()
    return redis_server.url


@pytest.fixture(params=["directory", "redis"])
def store_target(request, tmp_path) -> str:
    """Where a store lives, for tests every backend must pass."""
    return str(tmp_path / "store") if request.param == "directory" else request.getfixturevalue("redis_url")
