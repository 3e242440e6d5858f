"""A caller's live sessions over the whole fleet (docs/architecture.md § Fleet): every replica lists the
sessions it holds, and the replica that took the request joins the lists, so listing through the fleet
answers what one server would (GET /v1/sessions, the gRPC ListSessions). Each replica scopes its list to
the caller's key."""

from __future__ import annotations

import json
from collections.abc import Mapping

from kiln.v1 import runtime_pb2 as pb


def joined_json(bodies: Mapping[str, bytes]) -> bytes:
    """One REST list from each replica's `{"object": "list", "data": [...]}` (replica id -> body)."""
    data = [session for body in bodies.values() for session in json.loads(body)["data"]]
    return json.dumps({"object": "list", "data": data}).encode()


def joined_grpc(messages: Mapping[str, bytes]) -> bytes:
    """One ListSessionsResponse from each replica's (replica id -> message)."""
    sessions = [session for message in messages.values()
                for session in pb.ListSessionsResponse.FromString(message).sessions]
    return pb.ListSessionsResponse(sessions=sessions).SerializeToString()
