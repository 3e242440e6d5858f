"""The fleet through its HTTP and gRPC addresses (real Ray Serve, two replicas, real redis-server): sessions
spread over both replicas and every later turn is served by the owner, prefilling only its new tokens (the
Python SDK and the `openai` package unchanged against the fleet's addresses); a replica
killed with SIGKILL loses no session (the next turn of each is restored on another replica and continues
greedy-identically, one lease holder at a time); a shared chat opening reaches the replica that holds it;
bad input gets the typed errors of one server, and a Redis outage refuses new sessions while resident ones
keep serving. The tests share one fleet and run in file order: the outage test is last."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="the fleet extra (ray[serve]) is not installed")

from kiln.client import Client, Session  # noqa: E402 - after the skip
from kiln.errors import (  # noqa: E402
    CancelledError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from kiln.fleet.app import replica_pids  # noqa: E402
from kiln.fleet.http_bridge import REPLICA_HEADER  # noqa: E402
from kiln.fleet.routing import replica_of_holder  # noqa: E402
from kiln.llm import LLM  # noqa: E402
from kiln.snapshots.redis_store import RedisStore  # noqa: E402
from tests.fleet.conftest import ENGINE, KEYS, Fleet  # noqa: E402
from tests.snapshots.conftest import RedisProcess  # noqa: E402

REPLICA = REPLICA_HEADER.decode()
PROMPT = list(range(40, 72))
N = 4
LONG = 900  # max_tokens of a generation still running when cancelled (~1000 tokens/s here; context 1024)
GREEDY = {"max_tokens": N, "temperature": 0.0, "ignore_eos": True}


def create(client, tokens: list[int]) -> tuple[str, str]:
    """A new session through the fleet: (its id, the replica that created it)."""
    response = client.post("/v1/sessions", json={"token_ids": tokens})
    assert response.status_code == 201, response.text
    return response.json()["session_id"], response.headers[REPLICA]


def turn(client, session_id: str, new_tokens: list[int]) -> tuple[list[int], str, dict]:
    """Append, generate greedily: (the generated ids, the replica that served it, the session's info after)."""
    appended = client.post(f"/v1/sessions/{session_id}/tokens", json={"token_ids": new_tokens})
    assert appended.status_code == 200, appended.text
    generated = client.post(f"/v1/sessions/{session_id}/generate", json=GREEDY)
    assert generated.status_code == 200, generated.text
    assert generated.headers[REPLICA] == appended.headers[REPLICA]
    return generated.json()["token_ids"], generated.headers[REPLICA], client.get(f"/v1/sessions/{session_id}").json()


def wait_saved(client, session_id: str) -> None:
    deadline = time.monotonic() + 30
    while client.get(f"/v1/sessions/{session_id}").json()["unsaved_changes"]:
        assert time.monotonic() < deadline, f"session {session_id} was never saved"
        time.sleep(0.05)


def test_sessions_spread_and_every_turn_is_served_by_its_owner(fleet: Fleet):
    with fleet.client() as client:
        sessions = [create(client, PROMPT[: 8 + i]) for i in range(20)]
        assert len({replica for _, replica in sessions}) == 2, "the sessions all landed on one replica"
        for session_id, owner in sessions:
            assert turn(client, session_id, [7])[1] == owner
            before = client.get(f"/v1/sessions/{session_id}").json()
            _, served_by, info = turn(client, session_id, [8, 9, 10])
            assert served_by == owner
            # only what was not resident: the three appended tokens and the last turn's final token
            assert info["last_prefill_tokens"] == before["history_tokens"] + 3 - before["computed_tokens"] <= 4
        listed = client.get("/v1/sessions").json()["data"]
        assert {session["session_id"] for session in listed} >= {session_id for session_id, _ in sessions}


def owner_of(store: RedisStore, session_id: str) -> str | None:
    """The replica whose lease holds the session (the one every turn of it is routed to)."""
    lease = store.lease_of(session_id)
    return None if lease is None else replica_of_holder(lease.holder)


def test_the_python_sdk_works_unchanged_through_the_fleets_grpc_address(fleet: Fleet):
    store = RedisStore(fleet.redis.url)
    with Client(fleet.grpc_address, api_key=KEYS[0]) as client:
        sessions = [client.create_session(PROMPT[: 8 + i]) for i in range(8)]
        owners = {session.id: owner_of(store, session.id) for session in sessions}
        assert len(set(owners.values())) == 2, f"the sessions did not spread over both replicas: {owners}"
        for session in sessions:
            session.append([7])
            assert len(list(session.generate(N, ignore_eos=True))) == N  # streamed token by token
            before = session.info()
            session.append([8, 9, 10])
            assert session.generate(N, ignore_eos=True).result().usage.generated_tokens == N
            info = session.info()
            assert owner_of(store, session.id) == owners[session.id]  # the owner served it: no lease moved
            assert info.last_prefill_tokens == before.history_tokens + 3 - before.computed_tokens <= 4
        assert {info.session_id for info in client.list_sessions()} >= set(owners)  # every replica's sessions
    with Client(fleet.grpc_address, api_key=KEYS[1]) as other:
        assert not {info.session_id for info in other.list_sessions()} & set(owners)  # scoped to the key
    store.close()


def test_grpc_through_the_fleet_gives_the_typed_errors_of_one_server(fleet: Fleet):
    with Client(fleet.grpc_address, api_key=KEYS[0]) as mine, Client(fleet.grpc_address, api_key=KEYS[1]) as theirs:
        session = mine.create_session(PROMPT)
        with pytest.raises(NotFoundError):
            mine.get_session("no-such-session")
        with pytest.raises(NotFoundError):  # another key's session is not there at all
            theirs.get_session(session.id)
        with pytest.raises(NotFoundError):  # a refused stream, too
            Session(theirs, session.id).generate(N)
        with pytest.raises(InvalidArgumentError):
            session.generate(N, temperature=-1.0)
        with pytest.raises(ResourceExhaustedError):  # over the request limit, as one server's gRPC says
            session.append([1000] * (fleet.spec.serve_options.max_request_bytes // 2))
        running = session.generate(LONG, ignore_eos=True)
        with pytest.raises(FailedPreconditionError, match="in flight"):
            session.append([1])
        running.cancel()
    with Client(fleet.grpc_address, api_key="wrong") as stranger, pytest.raises(UnauthenticatedError):
        stranger.list_sessions()


def test_cancelling_a_grpc_generate_through_the_fleet_stops_it(fleet: Fleet):
    """Ray Serve's gRPC proxy passes a client's cancel on only when it lands while the proxy awaits the next
    message; one landing while it writes a message is lost and the generation runs to its end (measured:
    2 of 12 at this tiny model's ~1000 tokens/s; docs/architecture.md § Fleet). So: some of a few tries stop
    early, and every cancel returns with the session free for the next generate."""
    with Client(fleet.grpc_address, api_key=KEYS[0]) as client:
        histories = []
        for _ in range(5):
            session = client.create_session(PROMPT)
            generation = session.generate(LONG, ignore_eos=True)
            received = [next(generation), next(generation)]
            generation.cancel()  # returns once the replica freed the session
            assert generation.token_ids[:2] == received
            with pytest.raises(CancelledError):
                generation.result()
            info = session.info()
            assert not info.generating
            histories.append(info.history_tokens)
            assert session.generate(3, ignore_eos=True).result().usage.generated_tokens == 3
        assert min(histories) < len(PROMPT) + LONG, f"no cancel reached the replica: {histories}"


def test_the_openai_package_works_unchanged_against_the_fleet(fleet: Fleet):
    import openai

    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=KEYS[0], max_retries=0)
    reply = client.chat.completions.create(model="kiln", max_tokens=3, temperature=0,
                                           messages=[{"role": "user", "content": "Hello?"}])
    assert reply.choices[0].message.content is not None and reply.usage.completion_tokens == 3
    streamed = client.completions.create(model="kiln", prompt="Once", max_tokens=3, temperature=0, stream=True)
    assert sum(1 for chunk in streamed if chunk.choices and chunk.choices[0].text) >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_a_named_session_is_served_by_its_owner_whichever_replica_the_proxy_picks(fleet: Fleet):
    import openai

    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=KEYS[0], max_retries=0,
                           default_headers={"Kiln-Session": "fleet-agent"})
    messages, served, previous = [], set(), 0
    for question in ["Hello?", "And then?", "Why?", "How so?", "Go on."]:
        messages.append({"role": "user", "content": question})
        raw = client.chat.completions.with_raw_response.create(model="kiln", messages=messages, max_tokens=3,
                                                               temperature=0)
        reply = raw.parse()
        served.add(raw.headers[REPLICA])
        # the owner's session, not a copy: at least the last prompt is reused (the tiny model's replies are
        # random bytes, which a client's echo of their text need not reproduce: then the reply is recomputed)
        assert reply.usage.prompt_tokens_details.cached_tokens >= previous
        previous = reply.usage.prompt_tokens
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert len(served) == 1
    store = RedisStore(fleet.redis.url)
    assert owner_of(store, raw.headers["Kiln-Session-Id"]) == served.pop()
    store.close()


def test_a_responses_chain_is_served_by_the_owner_of_its_session(fleet: Fleet):
    import openai

    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=KEYS[0], max_retries=0)
    previous, served, reused = None, set(), 0
    for question in ["Hello?", "And then?", "Why?", "How so?", "Go on."]:
        raw = client.responses.with_raw_response.create(model="kiln", input=question, previous_response_id=previous,
                                                        max_output_tokens=3, temperature=0)
        response = raw.parse()
        served.add(raw.headers[REPLICA])
        assert response.usage.input_tokens_details.cached_tokens >= reused  # its session's history, on its owner
        previous, reused = response.id, response.usage.input_tokens
    assert len(served) == 1


def test_the_typescript_sdk_works_unchanged_through_the_fleets_grpc_address(fleet: Fleet):
    sdk = Path(__file__).resolve().parents[2] / "sdk" / "typescript" / "dist" / "esm" / "index.js"
    if shutil.which("node") is None or not sdk.exists():
        pytest.skip("node or the built TypeScript SDK is missing (`make test-ts` builds sdk/typescript/dist)")
    script = Path(__file__).with_name("ts_sdk_turns.mjs")
    run = subprocess.run(["node", str(script), sdk.as_uri(), fleet.grpc_address, KEYS[0]], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    turns = json.loads(run.stdout)
    assert turns["streamed"] == turns["generated"] == 4 and turns["missing"] == "NotFoundError"
    assert turns["lastPrefillTokens"] == turns["newTokens"] <= 4  # the owner served the second turn
    store = RedisStore(fleet.redis.url)
    assert owner_of(store, turns["sessionId"]) is not None
    store.close()


def test_metrics_give_the_fleets_aggregate_and_each_replicas_series(fleet: Fleet):
    from prometheus_client.parser import text_string_to_metric_families

    with fleet.client() as client:
        response = client.get("/metrics")
    assert response.status_code == 200, response.text
    families = {family.name: family for family in text_string_to_metric_families(response.text)}
    for name in ("kiln_sessions_active", "kiln_requests"):  # one HELP and one TYPE per family
        typed = name + ("_total" if name == "kiln_requests" else "")
        assert response.text.count(f"# TYPE {typed} ") == 1 and response.text.count(f"# HELP {typed} ") == 1
    active = families["kiln_sessions_active"].samples
    per_replica = {sample.labels["replica"]: sample.value for sample in active if "replica" in sample.labels}
    assert len(per_replica) == 2 and all(value > 0 for value in per_replica.values())  # earlier tests' sessions
    assert [sample.value for sample in active if "replica" not in sample.labels] == [sum(per_replica.values())]
    created = [sample for sample in families["kiln_requests"].samples
               if sample.labels.get("route") == "http/v1/sessions" and sample.labels["status"] == "OK"]
    total = next(sample.value for sample in created if "replica" not in sample.labels)
    assert total == sum(sample.value for sample in created if "replica" in sample.labels) >= 20


def test_a_killed_replicas_sessions_continue_elsewhere_greedy_identically(fleet: Fleet):
    with fleet.client() as client:
        sessions = [create(client, PROMPT[: 10 + i]) for i in range(6)]
        for session_id, _ in sessions:
            turn(client, session_id, [5])
            wait_saved(client, session_id)
        victim = sessions[0][1]
        owned = [session_id for session_id, replica in sessions if replica == victim]
        histories = {s: client.get(f"/v1/sessions/{s}/tokens").json()["token_ids"] for s in owned}
        os.kill(replica_pids()[victim], signal.SIGKILL)

        store = RedisStore(fleet.redis.url)
        with LLM(fleet.model, cache_dir=str(fleet.cache), **ENGINE) as reference:
            for session_id in owned:
                generated, served_by, _ = turn(client, session_id, [6])
                assert served_by != victim
                expected = reference.generate([*histories[session_id], 6], **GREEDY)[0].token_ids
                assert generated == expected
                lease = store.lease_of(session_id)
                assert lease is not None and replica_of_holder(lease.holder) == served_by  # one owner, the server
        store.close()


def test_a_shared_chat_opening_reaches_the_replica_that_holds_it(fleet: Fleet):
    system = {"role": "system", "content": "You answer in one word. " * 25}  # past the hashed opening
    with fleet.client() as client:
        replies = [client.post("/v1/chat/completions", json={
            "model": "kiln", "max_tokens": 2, "temperature": 0,
            "messages": [system, {"role": "user", "content": question}]}) for question in ("Red?", "Blue?")]
    assert all(reply.status_code == 200 for reply in replies), replies[0].text
    assert replies[0].headers[REPLICA] == replies[1].headers[REPLICA]
    assert replies[1].json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_bad_input_gets_the_typed_errors_of_one_server(fleet: Fleet):
    with fleet.client(KEYS[0]) as mine, fleet.client(KEYS[1]) as theirs:
        session_id, _ = create(mine, PROMPT)
        for client, target in ((mine, "no-such-session"), (theirs, session_id)):
            response = client.post(f"/v1/sessions/{target}/generate", json=GREEDY)
            assert response.status_code == 404
            assert response.json()["error"]["code"] == "NOT_FOUND"
        assert mine.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        too_large = mine.post("/v1/completions", content=b"x" * (fleet.spec.serve_options.max_request_bytes + 1))
        assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "RESOURCE_EXHAUSTED"


def test_scaling_down_to_one_replica_drains_sessions_without_a_lost_turn(fleet: Fleet):
    from ray import serve

    from kiln.fleet.app import APP_NAME, fleet_application

    with fleet.client() as client:
        sessions = [create(client, PROMPT[: 12 + i]) for i in range(4)]
        for session_id, _ in sessions:
            turn(client, session_id, [5])
        histories = {s: client.get(f"/v1/sessions/{s}/tokens").json()["token_ids"] for s, _ in sessions}
        serve.run(fleet_application(fleet.spec, 1, 0.5), name=APP_NAME)  # Ray stops one replica gracefully
        with LLM(fleet.model, cache_dir=str(fleet.cache), **ENGINE) as reference:
            for session_id, _ in sessions:
                generated, _, info = turn(client, session_id, [6])
                assert generated == reference.generate([*histories[session_id], 6], **GREEDY)[0].token_ids
                assert info["history_tokens"] == len(histories[session_id]) + 1 + N  # every turn kept


def test_redis_down_refuses_new_sessions_and_resident_ones_keep_serving(fleet: Fleet):
    with fleet.client() as client:
        session_id, owner = create(client, PROMPT)
        turn(client, session_id, [3])  # the router has now seen its owner
        fleet.redis.stop()
        try:
            refused = client.post("/v1/sessions", json={"token_ids": PROMPT})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "UNAVAILABLE"
            generated, served_by, _ = turn(client, session_id, [4])
            assert served_by == owner and len(generated) == N
        finally:  # back (empty) on its port, so the replicas' final saves end at once rather than retry
            fleet.redis = RedisProcess(fleet.redis.root, fleet.redis.port)


pytestmark = pytest.mark.timeout(300)
