"""`kiln fleet` as a user runs it: a subprocess that starts its own local Ray, serves the REST and OpenAI
API on --http-port and the SDKs' gRPC on --grpc-port, and on SIGTERM stops gracefully, exiting 0 with every session saved and handed off
(no lease left in the store)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from kiln.client import Client
from kiln.snapshots.manifest import session_snapshot_id
from kiln.snapshots.redis_store import RedisStore
from tests.fleet.conftest import KEYS
from tests.server.conftest import free_port, servers_root, tiny_model_dir, watch_log  # noqa: F401 - a fixture shared with the server tests
from tests.snapshots.conftest import REDIS_SERVER, RedisProcess

READY = "kiln fleet: ready"
pytestmark = pytest.mark.timeout(300)


def test_kiln_fleet_serves_and_hands_off_on_sigterm(servers_root, tmp_path):  # noqa: F811 - the fixture imported above
    pytest.importorskip("ray.serve", reason="the fleet extra (ray[serve]) is not installed")
    if not os.path.exists(REDIS_SERVER):
        pytest.skip("redis-server is not installed")
    redis = RedisProcess(tmp_path)
    port, grpc_port = free_port(), free_port()
    command = [sys.executable, "-m", "kiln.cli", "fleet", "--grpc-port", str(grpc_port), "--replicas", "1", "--replica-cpus", "0.5", "--threads", "1",
               "--model", str(tiny_model_dir(servers_root, "llama")), "--snapshot-store", redis.url,
               "--http-port", str(port), "--api-key", KEYS[0]]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                               env={**os.environ, "KILN_CACHE_DIR": str(servers_root / "cache")})
    log: list[str] = []
    ready = watch_log(process, log, READY)
    try:
        assert ready.wait(180), "kiln fleet did not start:\n" + "".join(log)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {KEYS[0]}"},
                          timeout=60) as client:
            created = client.post("/v1/sessions", json={"token_ids": [40, 41, 42]})
            assert created.status_code == 201, created.text
            session_id = created.json()["session_id"]
            generated = client.post(f"/v1/sessions/{session_id}/generate", json={"max_tokens": 3, "ignore_eos": True})
            assert len(generated.json()["token_ids"]) == 3
            assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        with Client(f"127.0.0.1:{grpc_port}", api_key=KEYS[0]) as sdk:
            assert sdk.get_session(session_id).info().history_tokens == 6
            assert sdk.health().status == "serving"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0, "".join(log)
        store = RedisStore(redis.url)
        assert store.lease_of(session_id) is None  # released after its final save: handed off
        assert store.get_manifest(session_snapshot_id(session_id)) is not None
        store.close()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        redis.stop()


def test_the_serve_config_builder_makes_the_fleet_application():
    pytest.importorskip("ray.serve", reason="the fleet extra (ray[serve]) is not installed")
    from ray.serve import Application

    from kiln.errors import InvalidArgumentError
    from kiln.fleet.app import application_from_args

    assert isinstance(application_from_args({"snapshot_store": "redis://kiln-redis:6379/0", "replicas": "3",
                                             "api_keys_file": "/etc/kiln/keys.toml"}), Application)
    with pytest.raises(InvalidArgumentError, match="snapshot_store"):
        application_from_args({"replicas": "2"})
    with pytest.raises(InvalidArgumentError, match="Redis"):
        application_from_args({"snapshot_store": "/var/kiln/snapshots"})


def test_a_grpc_port_without_an_api_key_is_refused_before_ray_starts(capsys, monkeypatch):
    """Ray Serve's gRPC proxy listens on every interface, whatever --host says."""
    ray = pytest.importorskip("ray", reason="the fleet extra (ray[serve]) is not installed")
    from kiln.cli import main

    monkeypatch.delenv("KILN_API_KEY", raising=False)
    assert main(["fleet", "--snapshot-store", "redis://127.0.0.1:1/0", "--grpc-port", "50051"]) == 2
    error = capsys.readouterr().err
    assert "INVALID_ARGUMENT" in error and "every interface" in error
    assert not ray.is_initialized()
