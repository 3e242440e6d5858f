"""What the fleet routes by (docs/architecture.md § Fleet), kept apart from Ray so it is plain data:
the Route of a request, each replica's load report, and the choices.

- A request (HTTP or gRPC) that names a session goes to the replica whose instance holds the session's lease.
- Any other request (creating a session, restoring a snapshot) goes to the least-loaded replica.
- GET /metrics and a listing of sessions (GET /v1/sessions, gRPC ListSessions) go to the least loaded,
  which asks every replica at once (Ray's broadcast) and merges their answers (kiln/fleet/metrics.py,
  kiln/fleet/listing.py).
- A stateless OpenAI request goes to the replica its prompt's opening picks (a hash of the first
  PREFIX_CHARS characters: the pages a prefix cache would hold) by rendezvous hashing over the running
  replicas, so every replica that takes such a request picks the same one without sharing memory, and a
  replica's loss moves only its own openings; a full replica's openings go to the least loaded.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from kiln.v1 import rpc

PREFIX_CHARS = 512  # the opening hashed: a few pages of prompt, shared by requests with one system prompt
INSTANCE_PREFIX = "fleet-"  # a replica's instance id in the snapshot store: fleet-<Ray replica id>
_SESSION_PATH = re.compile(r"^/v1/sessions/([^/]+)(?:/.*)?$")
_BODY_ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")  # POSTs routed by their body
EVERY_REPLICA_PATHS = ("/metrics", "/v1/sessions")  # GET: every replica answers its part
EVERY_REPLICA_METHODS = ("ListSessions",)  # the same over gRPC


@dataclass(frozen=True)
class Route:
    """How one request is routed: to the owner of `session_id`; to `replica` (a prompt opening's, chosen by
    the replica handing the request on) unless it is full or gone; else to the least loaded. `origin` is
    the replica handing the request on, never chosen for it while another runs: Ray Serve 2.60 can lose
    the streamed answer to a call a replica makes to itself (seen: ~4 % of such calls never returned)."""

    session_id: str | None = None
    replica: str | None = None
    origin: str | None = None


@dataclass(frozen=True)
class LoadReport:
    """What a replica reports to the router (Ray Serve's record_routing_stats), every stats period."""

    resident_kv_bytes: int
    kv_capacity_bytes: int
    running: int  # requests queued or running on its engine
    sessions: int  # live sessions
    max_num_seqs: int


def instance_id_for(replica_id: str) -> str:
    return INSTANCE_PREFIX + replica_id


def replica_of_holder(holder: str) -> str | None:
    """The Ray replica id of a lease holder (`fleet-<replica id>/<incarnation>`); None for another server."""
    instance = holder.split("/", 1)[0]
    return instance[len(INSTANCE_PREFIX):] if instance.startswith(INSTANCE_PREFIX) else None


def asks_every_replica(method: str, path: str) -> bool:
    return method == "GET" and path in EVERY_REPLICA_PATHS


def hands_on(method: str, path: str) -> bool:
    """Whether an HTTP request must be handed on by the replica Ray's proxy gave it to (which routes by
    what it holds before the body: the path): it asks every replica, or its route is in its body."""
    return asks_every_replica(method, path) or (method == "POST" and path in _BODY_ROUTED_PATHS)


def route_for(path: str) -> Route:
    """The Route of an HTTP request as Ray's proxy routes it, before its body: by the session its path names."""
    if match := _SESSION_PATH.match(path):
        return Route(session_id=match.group(1))
    return Route()


def grpc_route(method: str, request: bytes) -> Route:
    """The Route of a gRPC call to the fleet: by the session its request names. A malformed request or an
    unknown method goes to the least loaded, whose servicer answers it with the error one server gives."""
    if method not in rpc.METHODS or "session_id" not in rpc.request_type(method).DESCRIPTOR.fields_by_name:
        return Route()
    try:
        session_id = rpc.request_type(method).FromString(request).session_id
    except DecodeError:
        return Route()
    return Route(session_id=session_id or None)


def prefix_hash(body: bytes) -> str | None:
    """A hash of the opening of a completion's prompt or a chat's messages; None when the body has none."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict):
        return None
    if isinstance(messages := request.get("messages"), list):
        opening = json.dumps(messages, sort_keys=True, ensure_ascii=False)
    elif isinstance(prompt := request.get("prompt"), str | list):
        opening = json.dumps(prompt, ensure_ascii=False)
    else:
        return None
    return hashlib.sha256(opening[:PREFIX_CHARS].encode()).hexdigest()[:32]


def opening_holder(opening: str, replicas: Sequence[str]) -> str:
    """The replica a prompt opening goes to: the one whose hash with the opening is highest (rendezvous
    hashing: any caller that knows the same replicas picks the same one)."""
    return max(replicas, key=lambda replica: hashlib.sha256(f"{opening}/{replica}".encode()).digest())


def placement(route: Route, replicas: Sequence[str], reports: Mapping[str, LoadReport | None],
              placed_since_report: Mapping[str, int]) -> str:
    """Where a request no live owner holds goes: the replica its route names, unless that one is the
    origin, full or gone; else the least loaded of the others (of all, when the origin runs alone)."""
    others = sorted(replica for replica in replicas if replica != route.origin) or sorted(replicas)
    if route.replica in others and not is_full(route.replica, reports, placed_since_report):
        return route.replica
    return least_loaded(others, reports, placed_since_report)


def is_full(replica: str, reports: Mapping[str, LoadReport | None], placed_since_report: Mapping[str, int]) -> bool:
    """Whether a replica's KV pool or every sequence slot is taken (as it last reported)."""
    return reports.get(replica) is not None and _load(replica, reports, placed_since_report)[0] >= 1.0


def least_loaded(replicas: Sequence[str], reports: Mapping[str, LoadReport | None],
                 placed_since_report: Mapping[str, int]) -> str:
    """The replica with the least load; sessions placed on one since its last report count as one running
    request each (reports lag a stats period behind, and a burst of creates would otherwise all land on
    the replica that looked idlest). A replica that has not reported yet counts as empty but for what was
    placed on it, in the slots the others report (the replicas of a fleet share one spec)."""
    return min(replicas, key=lambda replica: _load(replica, reports, placed_since_report))


def _load(replica: str, reports: Mapping[str, LoadReport | None],
          placed_since_report: Mapping[str, int]) -> tuple[float, int, str]:
    """(the larger of its KV pool and sequence slots' fractions taken, its sessions, its id: a tie-break)."""
    report = reports.get(replica)
    placed = placed_since_report.get(replica, 0)
    if report is None:
        slots = max((other.max_num_seqs for other in reports.values() if other is not None), default=1)
        return placed / max(1, slots), placed, replica
    slots = max(1, report.max_num_seqs)
    return (max(report.resident_kv_bytes / max(1, report.kv_capacity_bytes), (report.running + placed) / slots),
            report.sessions + placed, replica)
