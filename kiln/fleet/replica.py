"""KilnReplica: one replica of the fleet's Ray Serve deployment, one engine (docs/architecture.md § Fleet).

Each replica is an LLM over the fleet's shared snapshot store, under the instance id `fleet-<Ray replica
id>`, so the leases of the sessions it owns name it and the router (kiln/fleet/router.py) sends their
turns here. It serves the same HTTP app and gRPC servicer as `kiln serve` (ServingStack: keys, quotas, the OpenAI
API, REST, the Runtime service, metrics), called in process for each request the ingress hands it
(kiln/fleet/http_bridge.py, kiln/fleet/grpc_bridge.py), and tells the router its load every stats period.

Ray restarts a replica whose health check fails (its engine died) or whose process is gone; on a graceful
stop (scale-down, shutdown) Ray calls `__del__`, which saves every session and releases its lease (the
hand-off), so the next turn of each is routed to another replica and restored there.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace

from ray import serve

from kiln.errors import UnavailableError
from kiln.fleet.grpc_bridge import GrpcCall, GrpcStatus, call_servicer
from kiln.fleet.http_bridge import REPLICA_HEADER, HttpRequest, ResponseHead, call_asgi
from kiln.fleet.routing import LoadReport, Route, instance_id_for
from kiln.llm import LLM
from kiln.server.app import ServeOptions, ServingStack
from kiln.server.grpc import RuntimeServicer


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica is built from: the model, engine options, the shared store and the HTTP options."""

    model: str | None
    snapshot_store: str
    lease_ttl_s: float
    serve_options: ServeOptions
    engine_options: dict[str, object] = field(default_factory=dict)


class KilnReplica:
    def __init__(self, spec: ReplicaSpec) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.llm = LLM(spec.model, snapshot_store=spec.snapshot_store, instance_id=instance_id_for(self.replica_id),
                       lease_ttl_s=spec.lease_ttl_s, **spec.engine_options)
        self.stack = ServingStack.build(self.llm, spec.serve_options)
        self.servicer = RuntimeServicer(self.stack.service, self.stack.keys, self.stack.metrics,
                                        spec.serve_options.access_log)
        self._header = ((REPLICA_HEADER, self.replica_id.encode()),)

    async def http(self, route: Route, request: HttpRequest) -> AsyncIterator[ResponseHead | bytes]:
        """One HTTP request, routed here by `route` (the router reads it; the app needs only the request)."""
        async for piece in call_asgi(self.stack.http_app, request, self._header):
            yield piece

    async def grpc(self, route: Route, call: GrpcCall) -> AsyncIterator[bytes | GrpcStatus]:
        """One gRPC call, routed here by `route`: its response messages' bytes, then its status."""
        async for piece in call_servicer(self.servicer, call):
            yield replace(piece, replica=self.replica_id) if isinstance(piece, GrpcStatus) else piece

    def process(self, route: Route) -> tuple[str, int]:
        """This replica's id and process id, for whoever must signal it (kiln/fleet/app.py replica_pids)."""
        return self.replica_id, os.getpid()

    def record_routing_stats(self) -> dict[str, object]:
        engine, sessions = self.llm.engine, self.llm.sessions
        usage = engine.kv_usage()
        with sessions.lock:
            live = len(sessions)
        report = LoadReport(resident_kv_bytes=(usage.used + usage.cached) * engine.kv_page_bytes,
                            kv_capacity_bytes=engine.kv_pages * engine.kv_page_bytes, running=engine.pending(),
                            sessions=live, max_num_seqs=self.llm.config.max_num_seqs)
        return {**asdict(report), "reported_at": time.time()}  # each report differs: the router counts from it

    def check_health(self) -> None:
        if (failure := self.llm.engine.failure) is not None:  # Ray replaces the replica
            raise UnavailableError(f"the engine failed ({type(failure).__name__}: {failure})")

    def __del__(self) -> None:
        if getattr(self, "llm", None) is not None:
            self.llm.close()
            self.llm = None
