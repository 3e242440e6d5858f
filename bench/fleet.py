"""The fleet (kiln/fleet on Ray Serve) on this machine, on the embedded model, against one `kiln serve`:

- routing overhead: the same sequential session workload (`--sessions` sessions of a 64-token prompt,
  `--turns` turns each: append 8 ids, generate 8 greedy tokens over REST) directly against one
  `kiln serve` and through a one-replica fleet; the headline is the median turn latency difference;
- where the overhead goes: the median of a cheap call (a session's info, `--probes` times) directly,
  through the fleet's HTTP address (Ray's proxy, its router, the replica: one Ray hop), through its gRPC
  address, through a handle on the replicas from the bench process (router -> replica, one Ray hop,
  without a proxy), and the router's lease lookup in Redis alone; and Ray Serve's own floor, without
  Kiln: a deployment that answers at once, through the same HTTP proxy and through a handle (what any
  design on Ray Serve pays per request);
- scale: aggregate generated tokens/s of `--concurrency` sessions generating at once (3 turns of 32
  tokens each) through 1 and through 2 replicas;
- failover: two replicas, a session owned by one of them, that replica SIGKILLed; the next turn's time to
  first token (streamed), split into detection (until the session's lease in Redis lapses, when the
  router may place it elsewhere) and the rest (restore from Redis, prefill of the new ids, first token).

Every engine gets one thread (two replicas share the 2 cores); Redis is a local redis-server. Writes
bench/results/fleet.json and fleet.png.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median

import common
import httpx
import servers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' redis-server helper
from tests.snapshots.conftest import RedisProcess  # noqa: E402

PROMPT_TOKENS, APPEND, GENERATE = 64, 8, 8
GREEDY = {"max_tokens": GENERATE, "temperature": 0.0, "ignore_eos": True}
REPLICA = "x-kiln-replica"


def session_turns(url: str, sessions: int, turns: int, seed: int) -> list[float]:
    """Seconds per turn (append + generate) of a sequential session workload."""
    latencies = []
    with httpx.Client(base_url=url, timeout=300) as client:
        ids = [client.post("/v1/sessions", json={"token_ids": common.random_ids(PROMPT_TOKENS, seed + s)}).json()["session_id"]
               for s in range(sessions)]
        for t in range(turns):
            for s, session_id in enumerate(ids):
                started = time.perf_counter()
                client.post(f"/v1/sessions/{session_id}/tokens",
                            json={"token_ids": common.random_ids(APPEND, seed * 1000 + s * 100 + t)}).raise_for_status()
                client.post(f"/v1/sessions/{session_id}/generate", json=GREEDY).raise_for_status()
                latencies.append(time.perf_counter() - started)
        for session_id in ids:
            client.delete(f"/v1/sessions/{session_id}")
    return latencies[len(ids):]  # the first round prefills the prompts


def http_info_s(url: str, probes: int, seed: int) -> float:
    with httpx.Client(base_url=url, timeout=60) as client:
        session_id = client.post("/v1/sessions", json={"token_ids": common.random_ids(PROMPT_TOKENS, seed)}).json()["session_id"]
        return common.median_seconds(lambda: client.get(f"/v1/sessions/{session_id}").raise_for_status(), probes)


def fleet_hops_s(url: str, grpc_address: str, redis_url: str, probes: int, seed: int) -> dict[str, float]:
    """A session's info through each path into the fleet, and the router's lease lookup alone."""
    import asyncio

    from ray import serve

    from kiln.client import Client
    from kiln.fleet.app import APP_NAME
    from kiln.fleet.http_bridge import HttpRequest
    from kiln.fleet.routing import Route
    from kiln.snapshots.redis_store import RedisStore

    with Client(grpc_address) as client:
        session = client.create_session(common.random_ids(PROMPT_TOKENS, seed))
        grpc_s = common.median_seconds(session.info, probes)
    replicas = serve.get_deployment_handle("KilnReplica", APP_NAME).options(method_name="http", stream=True)
    request = HttpRequest("GET", f"/v1/sessions/{session.id}", b"", ((b"host", b"127.0.0.1"),), b"", None)

    async def via_handle() -> None:
        async for _ in replicas.remote(Route(session_id=session.id), request):
            pass

    loop = asyncio.new_event_loop()
    handle_s = common.median_seconds(lambda: loop.run_until_complete(via_handle()), probes)
    loop.close()
    store = RedisStore(redis_url)
    lease_s = common.median_seconds(lambda: store.lease_of(session.id), probes)
    store.close()
    return {"fleet_http": http_info_s(url, probes, seed + 1), "fleet_grpc": grpc_s,
            "replica_handle": handle_s, "lease_lookup": lease_s}


def serve_floor_s(url: str, probes: int) -> dict[str, float]:
    """Ray Serve's cost per request on this machine with no Kiln code in the path."""
    from ray import serve

    @serve.deployment(name="Floor", ray_actor_options={"num_cpus": 0})
    class Floor:
        async def __call__(self, request: object) -> str:
            return "ok"

        async def ping(self) -> str:
            return "ok"

    handle = serve.run(Floor.bind(), name="floor", route_prefix="/floor")
    try:
        with httpx.Client(base_url=url, timeout=30.0) as client:
            http_s = common.median_seconds(lambda: client.get("/floor").raise_for_status(), probes)
        handle_s = common.median_seconds(lambda: handle.ping.remote().result(), probes)
    finally:
        serve.delete("floor")
    return {"serve_floor_http": http_s, "serve_floor_handle": handle_s}


def aggregate_tokens_per_s(url: str, concurrency: int, seed: int) -> float:
    tokens = 0
    lock = threading.Lock()

    def agent(index: int) -> None:
        nonlocal tokens
        with httpx.Client(base_url=url, timeout=600) as client:
            session_id = client.post("/v1/sessions", json={"token_ids": common.random_ids(PROMPT_TOKENS, seed + index)}
                                     ).json()["session_id"]
            for _ in range(3):
                reply = client.post(f"/v1/sessions/{session_id}/generate", json={**GREEDY, "max_tokens": 32})
                with lock:
                    tokens += len(reply.json()["token_ids"])
            client.delete(f"/v1/sessions/{session_id}")

    started = time.perf_counter()
    workers = [threading.Thread(target=agent, args=(i,)) for i in range(concurrency)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return tokens / (time.perf_counter() - started)


def failover(url: str, redis_url: str, seed: int) -> dict[str, float]:
    from kiln.fleet.app import replica_pids
    from kiln.snapshots.redis_store import RedisStore

    store = RedisStore(redis_url)
    with httpx.Client(base_url=url, timeout=300) as client:
        created = client.post("/v1/sessions", json={"token_ids": common.random_ids(PROMPT_TOKENS * 4, seed)})
        session_id, victim = created.json()["session_id"], created.headers[REPLICA]
        client.post(f"/v1/sessions/{session_id}/generate", json=GREEDY).raise_for_status()
        while client.get(f"/v1/sessions/{session_id}").json()["unsaved_changes"]:
            time.sleep(0.02)
        pid = replica_pids()[victim]
        holder = store.lease_of(session_id).holder
        lapsed: list[float] = []

        def watch() -> None:
            while (lease := store.lease_of(session_id)) is not None and lease.holder == holder:
                time.sleep(0.01)
            lapsed.append(time.perf_counter())

        killed = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        watcher = threading.Thread(target=watch)
        watcher.start()
        client.post(f"/v1/sessions/{session_id}/tokens", json={"token_ids": common.random_ids(APPEND, seed + 1)})
        with client.stream("POST", f"/v1/sessions/{session_id}/generate", json={**GREEDY, "stream": True}) as reply:
            for line in reply.iter_lines():
                if line.startswith("data:"):
                    first_token = time.perf_counter()
                    break
            served_by = reply.headers[REPLICA]
        watcher.join()
    store.close()
    detection = lapsed[0] - killed
    return {"first_token_s": first_token - killed, "detection_s": detection,
            "restore_prefill_first_token_s": first_token - max(lapsed[0], killed), "moved_to_other_replica": served_by != victim}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--probes", type=int, default=200)
    args = common.parse_run_args(parser, "fleet", "2 sessions x 3 turns, 4 at once, 30 probes",
                                 lambda a: vars(a).update(sessions=2, turns=3, concurrency=4, probes=30))
    import ray
    from ray import serve

    from kiln.fleet.app import APP_NAME, FLEET_LEASE_TTL_S, FleetOptions, fleet_application, start_fleet
    from kiln.fleet.replica import ReplicaSpec
    from kiln.server.app import ServeOptions

    machine = common.machine_info()
    redis = RedisProcess(Path(tempfile.mkdtemp(prefix="kiln-fleet-bench-")))
    engine = {"num_threads": 1, "speculative": None}
    direct = servers.start(extra_args=["--threads", "1", "--speculative", "none", "--snapshot-store", redis.url])
    try:
        direct_turns = session_turns(direct.http_url, args.sessions, args.turns, seed=1)
        direct_info = http_info_s(direct.http_url, args.probes, seed=400)
    finally:
        direct.stop()
    port, grpc_port = servers._free_port(), servers._free_port()
    url = f"http://127.0.0.1:{port}"
    spec = ReplicaSpec(None, redis.url, FLEET_LEASE_TTL_S, ServeOptions(), engine)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        start_fleet(spec, FleetOptions(replicas=1, http_port=port, grpc_port=grpc_port, replica_cpus=1.0))
        fleet_turns = session_turns(url, args.sessions, args.turns, seed=1)
        hops = {"direct_http": direct_info, **fleet_hops_s(url, f"127.0.0.1:{grpc_port}", redis.url, args.probes, 500),
                **serve_floor_s(url, args.probes)}
        one = aggregate_tokens_per_s(url, args.concurrency, seed=100)
        serve.run(fleet_application(spec, 2, 1.0), name=APP_NAME)
        two = aggregate_tokens_per_s(url, args.concurrency, seed=200)
        failed_over = failover(url, redis.url, seed=300)
    finally:
        serve.shutdown()
        ray.shutdown()
        redis.stop()
    overhead_ms = (median(fleet_turns) - median(direct_turns)) * 1000
    payload = {
        "method": __doc__, "machine": machine, "args": vars(args),
        "turn_latency_s": {"direct": common.summarize(direct_turns), "fleet_1_replica": common.summarize(fleet_turns),
                           "direct_samples": direct_turns, "fleet_samples": fleet_turns},
        "routing_overhead_median_ms": overhead_ms,
        "session_info_median_ms": {path: seconds * 1000 for path, seconds in hops.items()},
        "aggregate_tokens_per_s": {"1_replica": one, "2_replicas": two},
        "failover": failed_over,
    }
    path = common.write_results(args.name, payload)
    common.plot_bars(args.name, [
        ("turn latency, median (ms)", ["direct", "fleet (1 replica)"],
         {"median": [median(direct_turns) * 1000, median(fleet_turns) * 1000]}),
        ("aggregate tokens/s", ["1 replica", "2 replicas"], {"tokens/s": [one, two]}),
        ("failover (s)", ["detection", "restore+prefill+1st token"],
         {"seconds": [failed_over["detection_s"], failed_over["restore_prefill_first_token_s"]]}),
    ], "Kiln fleet on Ray Serve (2 cores)")
    print(f"routing overhead {overhead_ms:.1f} ms at the median; session info (ms) "
          f"{ {path: round(seconds * 1000, 2) for path, seconds in hops.items()} }; tokens/s 1 replica {one:.1f}, 2 replicas {two:.1f}; "
          f"failover {failed_over}; {path}")


if __name__ == "__main__":
    main()
