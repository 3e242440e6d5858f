"""What the fleet routes by (docs/architecture.md § Fleet), kept apart from Ray so it is plain data:
the Route the ingress derives from an HTTP request, each replica's load report, and the choices.

- A request (HTTP or gRPC) that names a session goes to the replica whose instance holds the session's lease.
- Any other request (creating a session, restoring a snapshot, listing) goes to the least-loaded replica.
- GET /metrics and a listing of sessions (GET /v1/sessions, gRPC ListSessions) go to every replica in
  turn (the ingress merges their answers: kiln/fleet/metrics.py, kiln/fleet/listing.py): each call to a
  replica not yet asked, then one more to any, whose repeated id says all were asked.
- A stateless OpenAI request goes to the replica that last served the same opening (a hash of the first
  PREFIX_CHARS characters of its prompt: the pages a prefix cache would hold), else the least-loaded.
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
_STATELESS_PATHS = ("/v1/chat/completions", "/v1/completions")
EVERY_REPLICA_PATHS = ("/metrics", "/v1/sessions")  # GET: every replica answers its part
EVERY_REPLICA_METHODS = ("ListSessions",)


@dataclass(frozen=True)
class Route:
    """How one request is routed: by `session_id`, by `prefix` (a hash), to each replica (`every_replica`:
    one not in `asked`), or to the least loaded."""

    session_id: str | None = None
    prefix: str | None = None
    every_replica: bool = False
    asked: frozenset[str] = frozenset()


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


def route_for(method: str, path: str, body: bytes) -> Route:
    """The Route of an HTTP request to the fleet (its path and, for the OpenAI API, its prompt)."""
    if match := _SESSION_PATH.match(path):
        return Route(session_id=match.group(1))
    if method == "GET" and path in EVERY_REPLICA_PATHS:
        return Route(every_replica=True)
    if method == "POST" and path in _STATELESS_PATHS:
        return Route(prefix=prefix_hash(body))
    return Route()


def grpc_route(method: str, request: bytes) -> Route:
    """The Route of a gRPC call to the fleet: by the session its request names. A malformed request or an
    unknown method goes to the least loaded, whose servicer answers it with the error one server gives."""
    if method in EVERY_REPLICA_METHODS:
        return Route(every_replica=True)
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


def next_unasked(replicas: Sequence[str], asked: frozenset[str]) -> str:
    """The first replica (by id) not yet asked; once all were, the first of all (its id repeats)."""
    ordered = sorted(replicas)
    return next((replica for replica in ordered if replica not in asked), ordered[0])


def least_loaded(replicas: Sequence[str], reports: Mapping[str, LoadReport | None],
                 placed_since_report: Mapping[str, int]) -> str:
    """The replica with the least load; sessions placed on one since its last report count as one running
    request each (reports lag a stats period behind, and a burst of creates would otherwise all land on
    the replica that looked idlest). A replica that has not reported yet counts as empty."""

    def load(replica: str) -> tuple[float, int, str]:
        report = reports.get(replica)
        placed = placed_since_report.get(replica, 0)
        if report is None:
            return placed, placed, replica
        slots = max(1, report.max_num_seqs)
        return (max(report.resident_kv_bytes / max(1, report.kv_capacity_bytes), (report.running + placed) / slots),
                report.sessions + placed, replica)

    return min(replicas, key=load)
