"""One fleet per module: a real Ray (started once, 2 CPUs), two KilnReplicas over a tiny model, and a real
`redis-server` as their shared snapshot store, all on free loopback ports (Ray Serve's gRPC proxy binds
its free port on every interface).

Ray's head runs in a process of its own (`ray start --head --block`, stopped by its PID), which the test
process joins: `ray.init` starting a head itself would fork the test process (Ray's launcher passes a
preexec_fn, so no vfork), and forking a test process that has grown over a long run can fail for memory
where starting a small process does not."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.server.conftest import free_port, servers_root, tiny_model_dir  # noqa: F401 - a fixture shared with the server tests
from tests.snapshots.conftest import REDIS_SERVER, RedisProcess

if TYPE_CHECKING:  # kiln.fleet needs the fleet extra, which the fixture skips without
    from kiln.fleet.replica import ReplicaSpec

KEYS = ("key-a", "key-b")
RAY_START_S = 120.0  # a cold head on a busy 2-core machine, with room to spare
RAY = Path(sys.executable).with_name("ray")
ENGINE = {"speculative": None, "deterministic": True, "num_threads": 1, "kv_budget_bytes": 64 * 2**20}


@dataclass
class Fleet:
    url: str
    grpc_address: str  # Ray Serve's gRPC proxy: kiln.v1.Runtime, for the SDKs
    redis: RedisProcess
    model: str
    cache: Path
    spec: ReplicaSpec  # what the replicas are built from: a test redeploys with it to scale

    def client(self, key: str = KEYS[0]) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


class RayHead:
    """A one-node Ray cluster (2 CPUs) in its own process group; the test process joins it at `address`. Its
    temporary directory is its own, so the machine's `/tmp/ray/ray_current_cluster` (which a plain
    `ray.init()`, such as `kiln fleet`'s, joins) never names this short-lived head; it is short, because Ray's
    Unix socket paths under it must fit 107 bytes."""

    def __init__(self, log: Path) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self.log = log
        self.temp_dir = Path(tempfile.mkdtemp(prefix="kiln-ray-"))
        # no drain on SIGTERM: Serve is shut down before the head is stopped, so there is nothing to drain;
        # no token authentication (`ray start` turns it on, `ray.init` does not): a loopback test cluster
        env = {**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "RAY_AUTH_MODE": "disabled"}
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                [str(RAY), "start", "--head", "--block", f"--port={self.address.split(':')[1]}", "--num-cpus=2",
                 "--node-ip-address=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={self.temp_dir}"],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + RAY_START_S
        while "Ray runtime started" not in log.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ray start did not come up:\n{log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM (the head stops the processes it started), SIGKILL to its group if that hangs."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def fleet(servers_root, tmp_path_factory) -> Iterator[Fleet]:  # noqa: F811 - the fixture imported above
    ray = pytest.importorskip("ray", reason="the fleet extra (ray[serve]) is not installed")
    serve = pytest.importorskip("ray.serve")
    from kiln.fleet.app import FleetOptions, start_fleet
    from kiln.fleet.replica import ReplicaSpec
    from kiln.server.app import ServeOptions

    if not Path(REDIS_SERVER).exists():
        pytest.skip("redis-server is not installed (`make test` installs it when it runs as root)")
    model, cache = str(tiny_model_dir(servers_root, "llama")), servers_root / "cache"
    redis = RedisProcess(tmp_path_factory.mktemp("fleet-redis"))
    spec = ReplicaSpec(model, redis.url, lease_ttl_s=3.0, serve_options=ServeOptions(api_keys=KEYS), engine_options=ENGINE)
    port, grpc_port = free_port(), free_port()
    handle = Fleet(f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", redis, model, cache, spec)
    previous = os.environ.get("KILN_CACHE_DIR")
    os.environ["KILN_CACHE_DIR"] = str(cache)  # Ray's workers inherit the driver's environment
    head = RayHead(tmp_path_factory.mktemp("ray-head") / "head.log")
    try:
        ray.init(address=head.address, log_to_driver=False)
        start_fleet(spec, FleetOptions(replicas=2, http_port=port, grpc_port=grpc_port, replica_cpus=0.5))
        yield handle
    finally:
        serve.shutdown()
        ray.shutdown()
        head.stop()
        handle.redis.stop()  # a test may have restarted it (handle.redis is then the new process)
        if previous is None:
            os.environ.pop("KILN_CACHE_DIR", None)
        else:
            os.environ["KILN_CACHE_DIR"] = previous
