"""The fleet on Ray Serve: N KilnReplicas, the application's ingress, each request's replica chosen by
SessionRouter in Ray's proxies (docs/architecture.md § Fleet). `kiln fleet` and the tests start it with
`start_fleet`.

Ray owns the processes: it places the replicas (one machine or a cluster), restarts the dead ones and
scales them (`num_replicas`); Kiln owns only the routing and the state, which lives in the shared
snapshot store.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from kiln.errors import InvalidArgumentError
from kiln.fleet.replica import KilnReplica, ReplicaSpec
from kiln.server.app import ServeOptions

APP_NAME = "kiln"
REPLICA_DEPLOYMENT = "KilnReplica"
FLEET_LEASE_TTL_S = 5.0  # a dead replica's sessions move after at most this (kiln serve's default is 30 s)
STATS_PERIOD_S = 1.0  # how often each replica reports its load to the router
GRPC_SERVICER = "kiln.server.grpc.add_runtime_handlers"  # what Ray's gRPC proxy serves: kiln.v1.Runtime
MAX_ONGOING_PER_REPLICA = 256  # streams in flight on one replica: the engine's scheduler queues the rest


@dataclass(frozen=True)
class FleetOptions:
    replicas: int
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int | None = None  # Ray Serve's gRPC proxy, serving kiln.v1.Runtime on every interface; None: off
    replica_cpus: float = 1.0  # Ray CPUs each replica reserves (its engine's threads: --threads)
    ray_address: str | None = None  # None: join a running local Ray, else start one

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise InvalidArgumentError(f"replicas must be at least 1, got {self.replicas}", "replicas")
        if not self.replica_cpus > 0:
            raise InvalidArgumentError(f"replica_cpus must be positive, got {self.replica_cpus}", "replica_cpus")


def fleet_application(spec: ReplicaSpec, replicas: int, replica_cpus: float) -> serve.Application:
    if not spec.snapshot_store.startswith(("redis://", "rediss://")):
        raise InvalidArgumentError("a fleet's replicas share their sessions through a Redis snapshot store: "
                                   f"--snapshot-store redis://host:port/db, got {spec.snapshot_store!r}",
                                   "snapshot_store")
    router = RequestRouterConfig(
        request_router_class="kiln.fleet.router:SessionRouter",
        request_router_kwargs={"snapshot_store": spec.snapshot_store, "lease_ttl_s": spec.lease_ttl_s},
        request_routing_stats_period_s=STATS_PERIOD_S, request_routing_stats_timeout_s=STATS_PERIOD_S * 5)
    replica = serve.deployment(KilnReplica, name=REPLICA_DEPLOYMENT, num_replicas=replicas,
                               max_ongoing_requests=MAX_ONGOING_PER_REPLICA, request_router_config=router,
                               ray_actor_options={"num_cpus": replica_cpus}, health_check_period_s=2.0,
                               graceful_shutdown_timeout_s=30.0)
    return replica.bind(spec)


def application_from_args(args: dict[str, str]) -> serve.Application:
    """Ray Serve's application builder, for a Serve config (`serve deploy`, KubeRay's RayService; deploy/):
    `import_path: kiln.fleet.app:application_from_args` with `args` snapshot_store (required), model,
    replicas, replica_cpus, host, api_keys_file, allowed_hosts (comma-separated), insecure_no_auth."""
    if not args.get("snapshot_store"):
        raise InvalidArgumentError("the fleet's args need snapshot_store: redis://host:port/db", "snapshot_store")
    serve_options = ServeOptions(
        host=args.get("host", "0.0.0.0"), api_keys_file=args.get("api_keys_file"),
        allowed_hosts=tuple(name for name in args.get("allowed_hosts", "").split(",") if name),
        insecure_no_auth=str(args.get("insecure_no_auth", "false")).lower() == "true")
    spec = ReplicaSpec(args.get("model"), args["snapshot_store"], FLEET_LEASE_TTL_S, serve_options)
    return fleet_application(spec, int(args.get("replicas", 2)), float(args.get("replica_cpus", 1.0)))


def start_fleet(spec: ReplicaSpec, options: FleetOptions, runtime_env: dict | None = None) -> DeploymentHandle:
    """Join (or start) Ray, start Serve's HTTP and gRPC proxies on the fleet's addresses and deploy the fleet;
    returns once every replica is up."""
    if not ray.is_initialized():
        ray.init(address=options.ray_address, runtime_env=runtime_env, include_dashboard=False,
                 log_to_driver=False)
    grpc_options = None if options.grpc_port is None else {"port": options.grpc_port,
                                                           "grpc_servicer_functions": [GRPC_SERVICER]}
    serve.start(http_options={"host": options.http_host, "port": options.http_port}, grpc_options=grpc_options)
    return serve.run(fleet_application(spec, options.replicas, options.replica_cpus), name=APP_NAME)


def replica_pids(app_name: str = APP_NAME) -> dict[str, int]:
    """Ray replica id -> process id of each running KilnReplica (for a test or bench that kills one). Call
    it from outside the fleet's deployments (it blocks)."""
    return dict(serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name).broadcast("process").results())
