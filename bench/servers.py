"""A `kiln serve` subprocess for the benchmarks that go through the wire (gRPC SDK, OpenAI HTTP).

Each benchmark system gets a fresh server, so no system finds pages another one computed."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from common import THREADS

READY = "kiln serve: ready"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    grpc_address: str
    http_url: str

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)


def start(timeout_s: float = 300.0) -> Server:
    """The embedded model on loopback with the same two threads the in-process runs get."""
    grpc_port, http_port = _free_port(), _free_port()
    command = [sys.executable, "-m", "kiln.cli", "serve", "--threads", str(THREADS),
               "--grpc-port", str(grpc_port), "--http-port", str(http_port)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    ready = threading.Event()
    log: list[str] = []

    def read() -> None:
        for line in process.stderr:
            log.append(line)
            if line.startswith(READY):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.2):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("kiln serve did not start:\n" + "".join(log))
    return Server(process, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}")
