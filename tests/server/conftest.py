"""Real `kiln serve` subprocesses on free loopback ports, over a tiny model directory."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import byte_tokenizer
from tests.tiny_models import TINY_CONFIGS, tiny_hf_model

READY = "kiln serve: ready"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class ServerHandle:
    process: subprocess.Popen
    grpc_address: str
    http_url: str
    vocab_size: int
    api_keys: tuple[str, ...] = ()
    log: list[str] = field(default_factory=list)

    def stop(self, timeout: float = 30.0) -> float:
        """SIGTERM, wait for exit; returns the seconds it took."""
        started = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=timeout)
        return time.monotonic() - started


def tiny_model_dir(root: Path, arch: str = "llama") -> Path:
    model_dir = root / f"tiny-{arch}"
    if not model_dir.exists():
        tiny_hf_model(arch).save_pretrained(model_dir)
        byte_tokenizer().backend.save(str(model_dir / "tokenizer.json"))
    return model_dir


def start_server(
    model: str | None,
    cache_dir: Path | None,
    api_keys: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
    vocab_size: int = 0,
    timeout: float = 240.0,
    launcher: tuple[str, ...] = ("-m", "kiln.cli"),
    default_store: bool = False,
) -> ServerHandle:
    """Start `kiln serve` (model None = the embedded one; cache_dir None = the default converted-weight
    cache) and wait for its ready line. Persistence is off unless `extra` names a snapshot store, or
    `default_store` asks for the instance's own (the caller points XDG_DATA_HOME at a temporary directory).
    `launcher`: the Python arguments that run the command line (e.g. `-c` with a script that injects
    a fault, then calls kiln.cli.main on the rest)."""
    grpc_port, http_port = free_port(), free_port()
    command = [sys.executable, *launcher, "serve", "--grpc-port", str(grpc_port),
               "--http-port", str(http_port), "--kv-budget-mb", "64", *extra]
    if not default_store and not any(arg.startswith("--snapshot") for arg in extra):  # never the home's data directory
        command.append("--no-persist")
    if model is not None:
        command += ["--model", model]
    for key in api_keys:
        command += ["--api-key", key]
    env = dict(os.environ) if cache_dir is None else {**os.environ, "KILN_CACHE_DIR": str(cache_dir)}
    env.pop("KILN_API_KEY", None)
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    handle = ServerHandle(process, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", vocab_size, api_keys)
    ready = watch_log(process, handle.log, READY)
    deadline = time.monotonic() + timeout
    while not ready.wait(0.1):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("kiln serve did not start:\n" + "".join(handle.log))
    return handle


def watch_log(process: subprocess.Popen, log: list[str], ready_line: str) -> threading.Event:
    """Collects `process`'s stderr into `log` on a thread; the event is set once a line starts with `ready_line`."""
    ready = threading.Event()

    def read() -> None:
        for line in process.stderr:
            log.append(line)
            if line.startswith(ready_line):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    return ready


@pytest.fixture(scope="session")
def servers_root(tmp_path_factory) -> Path:
    """The tiny model directories and the converted-weight cache every server of the run shares (the
    first start in a fresh cache converts weights and builds kernels: a minute or more)."""
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="session")
def server_factory(servers_root) -> Iterator:
    """start(arch="llama", api_keys=(), extra=()) -> ServerHandle; every server is stopped at the end."""
    root = servers_root
    started: list[ServerHandle] = []

    def start(arch: str = "llama", api_keys: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> ServerHandle:
        handle = start_server(str(tiny_model_dir(root, arch)), root / "cache", api_keys, extra,
                              vocab_size=TINY_CONFIGS[arch].vocab_size)
        started.append(handle)
        return handle

    yield start
    for handle in started:
        handle.stop()


@pytest.fixture(scope="session")
def tiny_server(server_factory) -> ServerHandle:
    return server_factory()


@pytest.fixture(scope="session")
def auth_server(server_factory) -> ServerHandle:
    return server_factory(api_keys=("key-a", "key-b"))


def held_until_released(monkeypatch, target: object, name: str) -> tuple[threading.Event, threading.Event]:
    """Replaces `target.name` with a call that signals `entered`, then waits for `release` before doing
    the real work. A call never released within 10 s fails (rather than hanging a server that blocks
    its event loop on it, where nothing else can run to release it)."""
    entered, release = threading.Event(), threading.Event()
    real = getattr(target, name)

    def held(*args: object, **kwargs: object) -> object:
        entered.set()
        if not release.wait(timeout=10):
            raise TimeoutError(f"{name} was never released")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, held)
    return entered, release
