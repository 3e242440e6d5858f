"""Listing through the fleet (kiln/fleet/listing.py), without Ray: every replica's sessions in one list,
for REST and for gRPC."""

from __future__ import annotations

import json

from kiln.fleet.listing import joined_grpc, joined_json
from kiln.v1 import runtime_pb2 as pb


def test_a_rest_listing_joins_every_replicas_sessions():
    rest = joined_json({"r1": b'{"object": "list", "data": [{"session_id": "a"}]}',
                        "r2": b'{"object": "list", "data": [{"session_id": "b"}, {"session_id": "c"}]}'})
    assert json.loads(rest)["object"] == "list"
    assert [session["session_id"] for session in json.loads(rest)["data"]] == ["a", "b", "c"]


def test_a_grpc_listing_joins_every_replicas_sessions():
    answers = {replica: pb.ListSessionsResponse(sessions=[pb.SessionInfo(session_id=s) for s in ids]).SerializeToString()
               for replica, ids in (("r1", ["a"]), ("r2", []), ("r3", ["b"]))}
    assert [info.session_id for info in pb.ListSessionsResponse.FromString(joined_grpc(answers)).sessions] == ["a", "b"]
