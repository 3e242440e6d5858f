"""The fleet's routing rules as data (kiln/fleet/routing.py), without Ray: which requests (HTTP and gRPC)
are routed by session, by prompt opening, to every replica or by load, and how the least-loaded replica
is chosen."""

from __future__ import annotations

import json

from kiln.fleet.routing import (
    PREFIX_CHARS,
    LoadReport,
    Route,
    grpc_route,
    instance_id_for,
    least_loaded,
    next_unasked,
    replica_of_holder,
    route_for,
)
from kiln.v1 import runtime_pb2 as pb


def chat(system: str, question: str) -> bytes:
    return json.dumps({"model": "kiln", "messages": [{"role": "system", "content": system},
                                                     {"role": "user", "content": question}]}).encode()


def test_session_paths_route_by_their_session():
    for path in ("/v1/sessions/abc", "/v1/sessions/abc/generate", "/v1/sessions/abc/tokens"):
        assert route_for("POST", path, b"{}") == Route(session_id="abc")
    for path in ("/v1/sessions", "/v1/snapshots/s1/restore", "/v1/models", "/healthz"):
        assert route_for("POST", path, b"{}") == Route()


def test_openai_requests_route_by_the_opening_of_their_prompt():
    system = "x" * PREFIX_CHARS
    first = route_for("POST", "/v1/chat/completions", chat(system, "one?"))
    assert first.prefix is not None and first == route_for("POST", "/v1/chat/completions", chat(system, "two?"))
    assert first != route_for("POST", "/v1/chat/completions", chat("y" * PREFIX_CHARS, "one?"))
    completion = route_for("POST", "/v1/completions", json.dumps({"prompt": "Once upon"}).encode())
    assert completion.prefix is not None
    assert route_for("POST", "/v1/completions", b"not json") == Route()


def test_lease_holders_name_their_replica():
    assert replica_of_holder(f"{instance_id_for('r1')}/abc123") == "r1"
    assert replica_of_holder("host-127.0.0.1-50051/abc123") is None  # a plain kiln serve


def test_least_loaded_counts_kv_running_and_what_was_placed_since_the_report():
    def report(kv: int, running: int, sessions: int = 0) -> LoadReport:
        return LoadReport(resident_kv_bytes=kv, kv_capacity_bytes=100, running=running, sessions=sessions,
                          max_num_seqs=10)

    assert least_loaded(["a", "b"], {"a": report(90, 0), "b": report(10, 1)}, {}) == "b"
    assert least_loaded(["a", "b"], {"a": report(0, 5), "b": report(30, 0)}, {}) == "b"
    idle = {"a": report(0, 0), "b": report(0, 0)}
    assert least_loaded(["a", "b"], idle, {"a": 1}) == "b"  # a burst of creates alternates
    assert least_loaded(["a", "b"], {"a": report(0, 0), "b": None}, {"b": 2}) == "a"


def test_grpc_calls_route_by_the_session_their_request_names():
    generate = pb.GenerateRequest(session_id="abc", max_tokens=3).SerializeToString()
    assert grpc_route("Generate", generate) == Route(session_id="abc")
    assert grpc_route("AppendTokens", pb.AppendTokensRequest(session_id="s1").SerializeToString()) == Route(session_id="s1")
    assert grpc_route("CreateSession", pb.CreateSessionRequest(token_ids=[1]).SerializeToString()) == Route()
    assert grpc_route("RestoreSession", pb.RestoreSessionRequest(snapshot_id="x").SerializeToString()) == Route()
    assert grpc_route("Generate", b"\xff\xff") == Route()  # malformed: the replica answers INVALID_ARGUMENT
    assert grpc_route("GetSessionInfo", b"") == Route()  # no id: the replica answers INVALID_ARGUMENT
    assert grpc_route("NoSuchMethod", generate) == Route()


def test_metrics_and_listings_go_to_every_replica_in_turn():
    for path in ("/metrics", "/v1/sessions"):
        assert route_for("GET", path, b"") == Route(every_replica=True)
    assert route_for("POST", "/v1/sessions", b"{}") == Route()
    assert grpc_route("ListSessions", b"") == Route(every_replica=True)
    replicas = ["b", "a", "c"]
    asked: list[str] = []
    while (replica := next_unasked(replicas, frozenset(asked))) not in asked:
        asked.append(replica)
    assert asked == ["a", "b", "c"]
