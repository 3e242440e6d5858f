"""KilnReplica: one replica of the fleet's Ray Serve deployment, one engine (docs/architecture.md § Fleet).

Each replica is an LLM over the fleet's shared snapshot store, under the instance id `fleet-<Ray replica
id>`, so the leases of the sessions it owns name it and the router (kiln/fleet/router.py) sends their
turns here. The replicas are the fleet application's ingress: Ray's HTTP and gRPC proxies hand a
request straight to the replica the router picks, which serves it in process with the same HTTP app and
gRPC servicer as `kiln serve` (ServingStack: keys, quotas, the OpenAI API, REST, the Runtime service,
metrics), or hands it on to other replicas (kiln/fleet/front.py). It also answers what other replicas
hand on (`http`, `grpc`: kiln/fleet/http_bridge.py, kiln/fleet/grpc_bridge.py), and tells the router its
load every stats period.

Ray restarts a replica whose health check fails (its engine died) or whose process is gone; on a graceful
stop (scale-down, shutdown) Ray calls `__del__`, which saves every session and releases its lease (the
hand-off), so the next turn of each is routed to another replica and restored there.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace

from ray import serve
from ray.serve.handle import DeploymentHandle

from kiln.errors import KilnError, UnavailableError
from kiln.fleet.front import GrpcFront, HttpFront, with_runtime_methods
from kiln.fleet.grpc_bridge import GrpcCall, GrpcStatus, call_servicer
from kiln.fleet.http_bridge import REPLICA_HEADER, HttpRequest, ResponseHead, call_asgi
from kiln.fleet.routing import LoadReport, Route, instance_id_for
from kiln.llm import LLM
from kiln.server import chat_sessions
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


@serve.ingress()
@with_runtime_methods
class KilnReplica:
    def __init__(self, spec: ReplicaSpec) -> None:
        context = serve.get_replica_context()
        self.replica_id, self._deployment = context.replica_id.unique_id, (context.deployment, context.app_name)
        self.llm = LLM(spec.model, snapshot_store=spec.snapshot_store, instance_id=instance_id_for(self.replica_id),
                       lease_ttl_s=spec.lease_ttl_s, **spec.engine_options)
        self.stack = ServingStack.build(self.llm, spec.serve_options)
        self.servicer = RuntimeServicer(self.stack.service, self.stack.keys, self.stack.metrics,
                                        spec.serve_options.access_log)
        self._header = ((REPLICA_HEADER, self.replica_id.encode()),)
        self._replicas: DeploymentHandle | None = None
        max_bytes = spec.serve_options.max_request_bytes
        self.grpc_front = GrpcFront(self.grpc, self.replicas, max_bytes)
        self._http_front = HttpFront(self.stack.http_app, self.replica_id, self.replicas, max_bytes,
                                     self._bound_session, self._holds)

    def __serve_build_asgi_app__(self) -> HttpFront:  # noqa: PLW3201 - Ray Serve's name for a late-bound ingress app
        return self._http_front

    def _bound_session(self, request: HttpRequest) -> str | None:
        """The session a request continues, for routing: the one its `Kiln-Session` name is bound to, or a
        Responses API follow-up's previous response's. None when it continues none (or names nothing valid:
        the app refuses it), its key is refused, or the store cannot say (then it is answered here)."""
        headers = dict(request.headers)
        authorization = headers.get(b"authorization")
        accepted, owner = self.stack.keys.routing_identity(authorization.decode("latin-1") if authorization else None)
        if not accepted:
            return None
        service = self.stack.service
        try:
            if request.path == "/v1/responses":
                previous = _previous_response_id(request.body)
                return None if previous is None else service.responses.get(owner, previous).session_id
            name = headers.get(chat_sessions.HEADER.encode(), b"").decode("latin-1")
            binding = service.session_names.get(owner, name) if chat_sessions.NAME.fullmatch(name) else None
        except KilnError:
            return None
        return binding.session_id if binding is not None else None

    def _holds(self, session_id: str) -> bool:
        persistence = self.llm.persistence
        return persistence is not None and persistence.ownership.fence(session_id) is not None

    def replicas(self) -> DeploymentHandle:
        """The handle on every replica of this deployment (this one included), for the requests handed on."""
        if self._replicas is None:
            self._replicas = serve.get_deployment_handle(*self._deployment)
        return self._replicas

    async def http(self, route: Route, request: HttpRequest) -> AsyncIterator[ResponseHead | bytes]:
        """One HTTP request another replica handed on, routed here by `route` (the router reads it; the app
        needs only the request)."""
        async for piece in call_asgi(self.stack.http_app, request, self._header):
            yield piece

    async def grpc(self, call: GrpcCall) -> AsyncIterator[bytes | GrpcStatus]:
        """One gRPC call, run in process: its response messages' bytes, then its status."""
        async for piece in call_servicer(self.servicer, call):
            yield replace(piece, replica=self.replica_id) if isinstance(piece, GrpcStatus) else piece

    async def http_whole(self, request: HttpRequest) -> tuple[ResponseHead, bytes]:
        """One HTTP request answered whole: this replica's part of a request asked of every replica."""
        head, *pieces = [piece async for piece in call_asgi(self.stack.http_app, request, self._header)]
        return head, b"".join(pieces)

    async def grpc_whole(self, call: GrpcCall) -> tuple[list[bytes], GrpcStatus]:
        """One unary gRPC call answered whole: this replica's part of a call asked of every replica."""
        *messages, status = [piece async for piece in self.grpc(call)]
        return messages, status

    def process(self) -> tuple[str, int]:
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


def _previous_response_id(body: bytes) -> str | None:
    """A Responses API request's previous_response_id, if its body names one."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    previous = request.get("previous_response_id") if isinstance(request, dict) else None
    return previous if isinstance(previous, str) else None
