"""A `kiln serve` node that the fault tests kill and restart: the same ports, store and flags every time,
as a supervisor restarts a crashed server with its own configuration (so whatever identity the server
derives from its address and store stays the same across incarnations)."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.server.conftest import ServerHandle, free_port, start_server, tiny_model_dir
from tests.tiny_models import TINY_CONFIGS

ARCH = "llama"
VOCAB = TINY_CONFIGS[ARCH].vocab_size
CONTEXT = TINY_CONFIGS[ARCH].max_position_embeddings
KV_BUDGET_MB = 64  # what start_server gives every server; the reference engine gets the same
# Bit-identical logits however a sequence was batched, chunked or appended: the server batches the agents'
# rows together while the in-process reference replays one session at a time, and the checks compare
# greedy tokens exactly (a near-tie broken differently would be a false alarm, not a lost turn).
EXACT = ("--deterministic",)


@dataclass(frozen=True)
class Model:
    """The tiny model directory and converted-weight cache every node of a run shares."""

    path: Path
    cache: Path

    @classmethod
    def under(cls, root: Path) -> Model:
        return cls(tiny_model_dir(root, ARCH), root / "cache")


@dataclass
class Node:
    """One server configuration; `start()` launches an incarnation on the same ports, `kill()` ends it
    with SIGKILL (no shutdown code runs), `stop()` with SIGTERM (graceful: saves every session)."""

    model: Model
    store: tuple[str, ...]  # ("--snapshot-dir", DIR) or ("--snapshot-store", URL)
    flags: tuple[str, ...] = ()
    ports: tuple[int, int] = field(default_factory=lambda: (free_port(), free_port()))
    server: ServerHandle | None = None
    killed_at: float | None = None  # time.monotonic() just before the last SIGKILL

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports[0]}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.ports[1]}"

    @property
    def pid(self) -> int:
        assert self.server is not None
        return self.server.process.pid

    def start(self, timeout: float = 120.0) -> Node:
        """start_server chooses free ports; repeating --grpc-port/--http-port after them makes this
        node's own ports win (argparse keeps an option's last value)."""
        grpc_port, http_port = self.ports
        extra = (*self.store, *EXACT, *self.flags, "--grpc-port", str(grpc_port), "--http-port", str(http_port))
        handle = start_server(str(self.model.path), self.model.cache, (), extra, VOCAB, timeout=timeout)
        self.server = dataclasses.replace(handle, grpc_address=self.address, http_url=self.http_url)
        return self

    def kill(self) -> None:
        """SIGKILL to this incarnation's PID, then reap it; it must still have been running."""
        assert self.server is not None
        status = self.server.process.poll()
        assert status is None, f"the server exited on its own (status {status}):\n{self.log()}"
        self.killed_at = time.monotonic()
        os.kill(self.pid, signal.SIGKILL)
        self.server.process.wait()

    def discard(self) -> None:
        """End this incarnation whatever its state (a test's cleanup)."""
        if self.server is not None and self.server.process.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.server.process.wait()

    def stop(self) -> int:
        """SIGTERM and wait: the exit status."""
        assert self.server is not None
        self.server.stop(timeout=60)
        return self.server.process.returncode

    def metric(self, sample: str) -> float:
        """One sample of this incarnation's /metrics, by its name and labels as Prometheus writes them
        (e.g. 'kiln_snapshot_save_failures_total{code="UNAVAILABLE"}')."""
        with urllib.request.urlopen(self.http_url + "/metrics", timeout=30) as reply:
            text = reply.read().decode()
        found = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
        assert found is not None, f"the server exports no {sample}"
        return float(found.group(1))

    def rss_bytes(self) -> int:
        """Resident memory of this incarnation's process."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no VmRSS for process {self.pid}")

    def log(self) -> str:
        return "" if self.server is None else "".join(self.server.log)
