"""One fleet per module: a real Ray (started once, 2 CPUs), two KilnReplicas over a tiny model, and a real
`redis-server` as their shared snapshot store, all on free loopback ports (Ray Serve's gRPC proxy binds
its free port on every interface)."""

from __future__ import annotations

import os
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
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        start_fleet(spec, FleetOptions(replicas=2, http_port=port, grpc_port=grpc_port, replica_cpus=0.5))
        yield handle
    finally:
        serve.shutdown()
        ray.shutdown()
        handle.redis.stop()  # a test may have restarted it (handle.redis is then the new process)
        if previous is None:
            os.environ.pop("KILN_CACHE_DIR", None)
        else:
            os.environ["KILN_CACHE_DIR"] = previous
