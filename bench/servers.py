"""A `kiln serve` subprocess for the benchmarks that go through the wire (gRPC SDK, OpenAI HTTP).

Each benchmark system gets a fresh server, so no system finds pages another one computed."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

from common import BENCH_DIR, THREADS

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
    log: list[str] = field(default_factory=list)  # the server's stderr so far (a crash's traceback)

    def metric(self, name: str) -> float:
        """The value of one unlabelled sample of the server's Prometheus metrics (GET /metrics), e.g.
        "kiln_prefill_tokens_total"."""
        with urllib.request.urlopen(self.http_url + "/metrics", timeout=30) as reply:
            text = reply.read().decode()
        found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        if found is None:
            raise KeyError(f"metric {name} not in the server's /metrics")
        return float(found.group(1))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)


def start(timeout_s: float = 300.0, extra_args: Sequence[str] = (), pythonpath: str | None = None) -> Server:
    """The embedded model on loopback with the same two threads the in-process runs get; `extra_args`
    are more `kiln serve` flags (e.g. ["--kv-budget-mb", "2048"]); `pythonpath`, a kiln tree to run
    instead of the one this process imports."""
    grpc_port, http_port = _free_port(), _free_port()
    command = [sys.executable, "-m", "kiln.cli", "serve", "--threads", str(THREADS),
               "--grpc-port", str(grpc_port), "--http-port", str(http_port), *extra_args]
    if not any(arg.startswith("--snapshot") for arg in extra_args):  # persistence only where a benchmark asks
        command.append("--no-persist")
    # Started from bench/ (no kiln there): `-m` puts the working directory first on sys.path, and from the
    # repository root that would shadow a tree the caller put first on PYTHONPATH to measure it.
    env = os.environ if pythonpath is None else {**os.environ, "PYTHONPATH": os.pathsep.join(
        [pythonpath, *filter(None, [os.environ.get("PYTHONPATH")])])}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=BENCH_DIR, env=env)
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
    return Server(process, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", log)
