"""SessionRouter: Ray Serve's request router for the Kiln replicas (docs/architecture.md § Fleet).

Ray Serve runs it inside each caller of the replicas' handle (Ray's HTTP and gRPC proxies, whose
requests it reads as the proxy hands them over, before their bodies; and the replicas, which hand some
requests on: kiln/fleet/front.py) and asks it, per request, which replica should take it; the rules are
kiln/fleet/routing.py's. A session's owner is read from its lease in the shared snapshot store, and a
prompt opening's replica is named by the replica handing the request on, so the router keeps no state a
restart could lose; it remembers the owners it saw only to keep resident sessions served while the store
is unreachable.

Failover: a session whose lease holder is no longer among Ray's running replicas is either on a replica
that is stopping (scale-down, shutdown: it saves and releases its sessions, so the router waits for the
release, or the lease's lapse) or on a dead one. Dead means Ray no longer knows the replica's actor (its
name is gone: Serve's replicas are never restarted in place). Then the router takes the lease away at
once, by the store's compare-and-delete on the dead holder's grant (holder and fencing token), and routes
the session like a new one: the chosen replica acquires the free lease (atomic; of two racing replicas
one wins, the other answers FAILED_PRECONDITION) and restores the session from the store. The dead
holder can write nothing more, and any write of a holder wrongly thought dead is refused by its fence.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from collections import OrderedDict

import ray
from ray.serve._private.common import (  # what Ray's HTTP and gRPC proxies send
    StreamingHTTPRequest,
    gRPCRequest,
)
from ray.serve._private.constants import SERVE_NAMESPACE  # the namespace of Serve's replica actors
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kiln.errors import KilnError
from kiln.fleet.routing import (
    LoadReport,
    Route,
    grpc_route,
    placement,
    replica_of_holder,
    route_for,
)
from kiln.snapshots.redis_store import RedisStore
from kiln.snapshots.store import Lease

logger = logging.getLogger(__name__)
REMEMBERED = 100_000  # owners remembered (least recently used go first)
LAPSE_POLL_S = 0.2


class SessionRouter(RequestRouter):
    def initialize_state(self, snapshot_store: str = "", lease_ttl_s: float = 5.0, **kwargs: object) -> None:
        self._store_url = snapshot_store
        self._store: RedisStore | None = None  # connected on first use: the store may be down at start
        self._lease_ttl_s = lease_ttl_s
        self._owners: OrderedDict[str, str] = OrderedDict()  # session id -> replica id, last seen
        self._placed: dict[str, int] = {}  # sessions placed on a replica since its last load report
        self._reports: dict[str, dict] = {}
        self._seen: OrderedDict[str, ReplicaID] = OrderedDict()  # every replica seen: its actor, once gone

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        if not by_id:
            return []
        for unique_id, replica in by_id.items():
            _remember(self._seen, unique_id, replica.replica_id)
        route = _route_of(pending_request)
        if route.session_id is not None:
            owner = await self._owner(route.session_id, set(by_id))
            if owner is not None:
                return [[by_id[owner]]]
        chosen = placement(route, list(by_id), self._load_reports(candidate_replicas), self._placed)
        self._placed[chosen] = self._placed.get(chosen, 0) + 1
        return [[by_id[chosen]]]

    async def _owner(self, session_id: str, live: set[str]) -> str | None:
        """The live replica that owns the session; None when no replica does (a new owner may take it).
        A dead owner's lease is taken away at once; a stopping owner's hand-off is waited for, up to the
        lease TTL."""
        deadline = time.monotonic() + self._lease_ttl_s + 1.0
        while True:
            try:
                lease = await asyncio.to_thread(self._lease_of, session_id)
            except KilnError as error:  # the store is unreachable: the owner it last had, if still live
                logger.warning("fleet: session %s routed by its last known owner: %s", session_id, error)
                known = self._owners.get(session_id)
                return known if known in live else None
            if lease is None:
                return None
            replica = replica_of_holder(lease.holder)
            if replica in live:
                _remember(self._owners, session_id, replica)
                return replica
            if replica is not None and await asyncio.to_thread(self._dead, replica):
                try:
                    taken = await asyncio.to_thread(self._store.release_lease, lease)  # only that very grant
                except KilnError as error:  # the store went away: the chosen replica answers UNAVAILABLE
                    logger.warning("fleet: session %s: its dead replica's lease was not taken: %s", session_id, error)
                    return None
                logger.info("fleet: session %s: its replica %s is dead; lease %s", session_id, replica,
                            "taken back for a live replica" if taken else "changed meanwhile")
                continue
            if time.monotonic() > deadline:
                return None  # a holder that is not a fleet replica: the chosen one answers FAILED_PRECONDITION
            await asyncio.sleep(LAPSE_POLL_S)

    def _dead(self, replica: str) -> bool:
        """Whether Ray no longer knows the replica's actor (never restarted in place: its name is gone)."""
        replica_id = self._seen.get(replica)
        if replica_id is None:  # never seen here: its lease is left to lapse
            return False
        try:
            ray.get_actor(replica_id.to_full_id_str(), namespace=SERVE_NAMESPACE)
        except ValueError:
            return True
        return False

    def _lease_of(self, session_id: str) -> Lease | None:
        if self._store is None:
            self._store = RedisStore(self._store_url)
        return self._store.lease_of(session_id)

    def _load_reports(self, replicas: list[RunningReplica]) -> dict[str, LoadReport | None]:
        reports: dict[str, LoadReport | None] = {}
        for replica in replicas:
            unique_id, stats = replica.replica_id.unique_id, dict(replica.routing_stats or {})
            if stats != self._reports.get(unique_id):  # a new report counts what was placed before it
                self._reports[unique_id] = stats
                self._placed[unique_id] = 0
            reports[unique_id] = LoadReport(**{k: v for k, v in stats.items() if k != "reported_at"}) if stats else None
        return reports


def _route_of(pending_request: PendingRequest | None) -> Route:
    """A replica's hand-on names its Route as the call's first argument (kiln/fleet/front.py); Ray's
    proxies pass the request they received, pickled: an HTTP request's scope (its path; the body is read
    later, by the replica) or a gRPC call's request bytes (its method is the call's)."""
    if pending_request is None or not pending_request.args:
        return Route()
    argument = pending_request.args[0]
    if isinstance(argument, Route):
        return argument
    if isinstance(argument, bytes):
        request = pickle.loads(argument)  # noqa: S301 - written by Ray's own proxy, inside the cluster
        if isinstance(request, StreamingHTTPRequest):
            return route_for(request.asgi_scope["path"])
        if isinstance(request, gRPCRequest):
            return grpc_route(pending_request.metadata.call_method, request.user_request_proto)
    return Route()


def _remember(memory: OrderedDict[str, str], key: str, replica: str) -> None:
    memory[key] = replica
    memory.move_to_end(key)
    while len(memory) > REMEMBERED:
        memory.popitem(last=False)
