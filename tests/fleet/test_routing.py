"""The fleet's routing rules as data (kiln/fleet/routing.py), without Ray: which requests (HTTP and gRPC)
are routed by session, by prompt opening, to every replica or by load, how the least-loaded replica is
chosen, and which replica a prompt's opening picks."""

from __future__ import annotations

import json

from kiln.fleet.routing import (
    EVERY_REPLICA_METHODS,
    PREFIX_CHARS,
    LoadReport,
    Route,
    asks_every_replica,
    grpc_route,
    hands_on,
    instance_id_for,
    is_full,
    least_loaded,
    opening_holder,
    placement,
    prefix_hash,
    replica_of_holder,
    route_for,
)
from kiln.v1 import runtime_pb2 as pb


def chat(system: str, question: str) -> bytes:
    return json.dumps({"model": "kiln", "messages": [{"role": "system", "content": system},
                                                     {"role": "user", "content": question}]}).encode()


def test_session_paths_route_by_their_session():
    for path in ("/v1/sessions/abc", "/v1/sessions/abc/generate", "/v1/sessions/abc/tokens"):
        assert route_for(path) == Route(session_id="abc")
    for path in ("/v1/sessions", "/v1/snapshots/s1/restore", "/v1/models", "/healthz", "/v1/chat/completions"):
        assert route_for(path) == Route()


def test_openai_prompts_are_known_by_their_opening():
    system = "x" * PREFIX_CHARS
    first = prefix_hash(chat(system, "one?"))
    assert first is not None and first == prefix_hash(chat(system, "two?"))  # past the opening: the same
    assert first != prefix_hash(chat("y" * PREFIX_CHARS, "one?"))
    assert prefix_hash(json.dumps({"prompt": "Once upon"}).encode()) is not None
    assert prefix_hash(b"not json") is None and prefix_hash(b"[]") is None and prefix_hash(b"{}") is None


def test_the_replica_ray_gave_a_request_hands_on_listings_and_stateless_prompts_only():
    assert hands_on("GET", "/metrics") and hands_on("GET", "/v1/sessions")
    assert hands_on("POST", "/v1/chat/completions") and hands_on("POST", "/v1/completions")
    for method, path in (("POST", "/v1/sessions"), ("POST", "/v1/sessions/abc/generate"), ("GET", "/v1/models"),
                         ("GET", "/v1/sessions/abc"), ("DELETE", "/v1/sessions/abc"), ("GET", "/healthz")):
        assert not hands_on(method, path)


def test_an_opening_picks_one_replica_by_its_hash():
    replicas = ["a", "b", "c"]
    openings = [f"opening-{i}" for i in range(60)]
    chosen = {opening: opening_holder(opening, replicas) for opening in openings}
    assert set(chosen.values()) == set(replicas)  # openings spread over the replicas
    for opening, replica in chosen.items():  # whoever asks, in whatever order it knows the replicas
        assert opening_holder(opening, list(reversed(replicas))) == replica
    kept = [opening for opening in openings if chosen[opening] != "c"]  # losing c moves only c's openings
    assert all(opening_holder(opening, ["a", "b"]) == chosen[opening] for opening in kept)


def test_a_handed_on_request_goes_where_its_route_names_never_back_to_its_origin():
    def report(kv: int) -> LoadReport:
        return LoadReport(resident_kv_bytes=kv, kv_capacity_bytes=100, running=0, sessions=0, max_num_seqs=4)

    loads = {"a": report(0), "b": report(50), "c": report(90)}
    assert placement(Route(replica="c", origin="a"), ["a", "b", "c"], loads, {}) == "c"  # busy, not full
    assert placement(Route(replica="c", origin="a"), ["a", "b", "c"], {**loads, "c": report(100)}, {}) == "b"
    assert placement(Route(replica="gone", origin="a"), ["a", "b", "c"], loads, {}) == "b"  # not a, the idlest
    assert placement(Route(replica="a", origin="a"), ["a", "b"], loads, {}) == "b"
    assert placement(Route(origin="a"), ["a"], loads, {}) == "a"  # alone: the origin itself
    assert placement(Route(), ["a", "b", "c"], loads, {}) == "a"  # a new session: the least loaded


def test_a_replica_is_full_when_its_kv_pool_or_every_slot_is_taken():
    def report(kv: int, running: int = 0) -> LoadReport:
        return LoadReport(resident_kv_bytes=kv, kv_capacity_bytes=100, running=running, sessions=0, max_num_seqs=4)

    assert not is_full("a", {"a": report(50, 3)}, {})
    assert is_full("a", {"a": report(100)}, {}) and is_full("a", {"a": report(0, running=4)}, {})
    assert is_full("a", {"a": report(0, running=3)}, {"a": 1})  # one placed since its report
    assert not is_full("a", {"a": None}, {"a": 5})  # not reported yet: not known to be full


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
    placed: dict[str, int] = {}  # a replica just added (not reported yet) beside one holding a little KV
    for _ in range(8):
        chosen = least_loaded(["old", "new"], {"old": report(10, 0), "new": None}, placed)
        placed[chosen] = placed.get(chosen, 0) + 1
    assert placed == {"old": 4, "new": 4}  # a burst of creates is shared, not piled on the reported one


def test_grpc_calls_route_by_the_session_their_request_names():
    generate = pb.GenerateRequest(session_id="abc", max_tokens=3).SerializeToString()
    assert grpc_route("Generate", generate) == Route(session_id="abc")
    assert grpc_route("AppendTokens", pb.AppendTokensRequest(session_id="s1").SerializeToString()) == Route(session_id="s1")
    assert grpc_route("CreateSession", pb.CreateSessionRequest(token_ids=[1]).SerializeToString()) == Route()
    assert grpc_route("RestoreSession", pb.RestoreSessionRequest(snapshot_id="x").SerializeToString()) == Route()
    assert grpc_route("Generate", b"\xff\xff") == Route()  # malformed: the replica answers INVALID_ARGUMENT
    assert grpc_route("GetSessionInfo", b"") == Route()  # no id: the replica answers INVALID_ARGUMENT
    assert grpc_route("NoSuchMethod", generate) == Route()


def test_metrics_and_listings_go_to_the_least_loaded_which_asks_every_replica():
    for path in ("/metrics", "/v1/sessions"):
        assert route_for(path) == Route() and asks_every_replica("GET", path) and hands_on("GET", path)
    assert not asks_every_replica("POST", "/v1/sessions") and not hands_on("POST", "/v1/sessions")
    assert grpc_route("ListSessions", b"") == Route() and "ListSessions" in EVERY_REPLICA_METHODS
