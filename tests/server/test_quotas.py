"""API keys file (line and TOML formats, digests, SIGHUP reload), strict bearer parsing, per-key limits on
both transports, fair sharing of the KV pool between keys, and the failed-authentication throttle."""

from __future__ import annotations

import hashlib
import logging
import re
import signal
import time
from pathlib import Path

import grpc
import httpx
import pytest

from kiln import SamplingParams
from kiln.cli import main
from kiln.client import Client, ResourceExhaustedError, UnauthenticatedError
from kiln.errors import InvalidArgumentError
from kiln.errors import UnauthenticatedError as ServerUnauthenticated
from kiln.results import OwnerUsage
from kiln.server.auth import ApiKeys, identity_of, read_keys_file
from kiln.server.auth_failures import AuthFailures, AuthThrottledError, ThrottleRule, grpc_peer_address
from kiln.server.quotas import Limits, QuotaExceededError, Quotas
from kiln.v1 import runtime_pb2 as pb
from tests.server.conftest import ServerHandle, start_server, tiny_model_dir
from tests.tiny_models import TINY_CONFIGS

TIMEOUT = 60.0


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- the keys file -------------------------------------------------------------------------------

def test_line_format_keeps_working(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nalpha\n\n  beta  \n# gamma\n")
    keys = ApiKeys.from_sources(["cli-key"], str(path), env={})
    assert keys.identify("Bearer alpha") == identity_of("alpha")
    assert keys.identify("Bearer beta") == identity_of("beta")
    assert keys.identify("Bearer cli-key") == identity_of("cli-key")
    with pytest.raises(ServerUnauthenticated):
        keys.identify("Bearer gamma")


def test_toml_file_holds_digests_and_limits(tmp_path, caplog):
    path = tmp_path / "keys.toml"
    path.write_text(f"""
[keys.alice]
key_sha256 = "{sha('alice-secret').upper()}"
max_sessions = 3
max_resident_kv_bytes = "512MiB"
max_concurrent_generations = 2
tokens_per_minute = 1000
admin = true

[keys.bob]
key = "bob-secret"
max_resident_kv_bytes = 4096
""")
    with caplog.at_level(logging.WARNING):
        keys = ApiKeys(keys_file=str(path))
    assert "keys.bob" in caplog.text and "plaintext" in caplog.text and "bob-secret" not in caplog.text
    alice, bob = identity_of("alice-secret"), identity_of("bob-secret")
    assert keys.identify("Bearer alice-secret") == alice  # the identity a --api-key gives: sessions carry over
    assert keys.identify("Bearer bob-secret") == bob
    assert keys.limits(alice) == Limits(3, 512 * 2**20, 2, 1000)
    assert keys.limits(bob) == Limits(max_resident_kv_bytes=4096)
    assert keys.limits(None) == Limits()
    assert [entry.admin for entry in keys.entries] == [True, False]
    assert "bob-secret" not in repr(keys.entries) and "bob-secret" not in repr(vars(keys))  # digests only


@pytest.mark.parametrize(("text", "fault"), [
    ("[keys.a]\nkey_sha256 = 'abc'\n", "64 hexadecimal"),
    ("[keys.a]\nkey = 'x'\nkey_sha256 = '" + "0" * 64 + "'\n", "exactly one"),
    ("[keys.a]\nmax_sessions = 2\n", "exactly one"),
    ("[keys.a]\nkey = 'x'\nmax_session = 2\n", "unknown fields"),
    ("[keys.a]\nkey = 'x'\nmax_sessions = 0\n", "max_sessions must be a positive integer"),
    ("[keys.a]\nkey = 'x'\ntokens_per_minute = true\n", "tokens_per_minute must be a positive integer"),
    ("[keys.a]\nkey = 'x'\nmax_resident_kv_bytes = '12 parsecs'\n", "size like 512MiB"),
    ("[keys.a]\nkey = 'two words'\n", "bearer token"),
    ("[keys.a]\nkey = 'x'\nadmin = 'yes'\n", "admin must be true or false"),
    ("[keys.a\nkey = 'x'\n", "not valid TOML"),
    ("[users.a]\nkey = 'x'\n", "unknown top-level"),
    ("[keys.a]\nkey = 'x'\n[keys.b]\nkey = 'x'\nmax_sessions = 1\n", "same key with different settings"),
])
def test_bad_toml_files_are_refused_naming_the_fault(tmp_path, text, fault):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(InvalidArgumentError, match=fault):
        ApiKeys(keys_file=str(path))


def test_a_line_key_a_bearer_header_cannot_carry_is_refused_at_start(tmp_path):
    path = tmp_path / "keys"
    path.write_text("good\nbad key\n")
    with pytest.raises(InvalidArgumentError, match="line 2") as refused:
        read_keys_file(str(path))
    assert "bad key" not in str(refused.value)


@pytest.mark.parametrize("header", ["Bearer  alpha", "Bearer alpha ", " Bearer alpha", "Bearer\talpha", "Bearer alpha beta",
                                    "Bearer", "Bearer ", "Basic alpha", "Bearer al\u00e9pha", "Bearer alpha\n"])
def test_only_one_exact_bearer_form_authenticates(header):
    keys = ApiKeys(["alpha"])
    assert keys.identify("Bearer alpha") == identity_of("alpha")
    assert keys.identify("bearer alpha") == identity_of("alpha")  # the scheme is case-insensitive (RFC 7235)
    with pytest.raises(ServerUnauthenticated):
        keys.identify(header)


def test_reload_swaps_keys_and_a_bad_file_keeps_the_old_ones(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text("[keys.a]\nkey = 'old-key'\n")
    keys = ApiKeys(["fixed-key"], str(path))
    path.write_text(f"[keys.b]\nkey_sha256 = '{sha('new-key')}'\nmax_sessions = 1\n")
    assert keys.reload() == 2
    assert keys.identify("Bearer new-key") == identity_of("new-key")
    assert keys.limits(identity_of("new-key")).max_sessions == 1
    assert keys.identify("Bearer fixed-key") == identity_of("fixed-key")  # --api-key keys stay
    with pytest.raises(ServerUnauthenticated):
        keys.identify("Bearer old-key")
    for bad in ("[keys.c]\nkey = 'x'\nmax_sessions = -1\n", "[keys.d]\nkey_sha256 = 'zz'\n", "[keys\n"):
        path.write_text(bad)
        with pytest.raises(InvalidArgumentError):
            keys.reload()
        assert keys.identify("Bearer new-key") == identity_of("new-key")


def test_a_reload_to_no_keys_at_all_is_refused(tmp_path):
    path = tmp_path / "keys"
    path.write_text("only-key\n")
    keys = ApiKeys(keys_file=str(path))
    path.write_text("# emptied\n")
    with pytest.raises(InvalidArgumentError, match="turn authentication off"):
        keys.reload()
    assert keys.enabled and keys.identify("Bearer only-key") == identity_of("only-key")


@pytest.mark.parametrize(("flags", "fault"), [
    (("--auth-failure-threshold", "-1"), "auth_failure_threshold must be 0 (off) or more"),
    (("--api-keys-file", "{bad}"), "max_sessions must be a positive integer"),
])
def test_bad_settings_stop_kiln_serve_with_status_2(tmp_path, capsys, flags, fault):
    bad = tmp_path / "keys.toml"
    bad.write_text("[keys.a]\nkey = 'x'\nmax_sessions = 0\n")
    assert main(["serve", "--no-persist", *(flag.format(bad=bad) for flag in flags)]) == 2  # before any model loads
    assert fault in capsys.readouterr().err


# ---- the failed-authentication throttle ----------------------------------------------------------

def test_repeated_failures_from_one_address_wait_longer_and_longer():
    clock = Clock()
    failures = AuthFailures(ThrottleRule(threshold=3, window_s=60, base_delay_s=1, max_delay_s=8, max_addresses=2), clock)
    keys = ApiKeys(["right"], failures=failures)
    for _ in range(3):
        with pytest.raises(ServerUnauthenticated):
            keys.identify("Bearer wrong", "10.0.0.1")
    with pytest.raises(AuthThrottledError) as throttled:  # the right key too: a guess learns nothing now
        keys.identify("Bearer right", "10.0.0.1")
    assert throttled.value.retry_after_s == pytest.approx(1.0)
    assert keys.identify("Bearer right", "10.0.0.2") == identity_of("right")  # other addresses are not slowed
    clock.now += 0.5
    with pytest.raises(AuthThrottledError):  # a refused attempt does not lengthen the wait
        keys.identify("Bearer right", "10.0.0.1")
    clock.now += 0.5
    assert keys.identify("Bearer right", "10.0.0.1") == identity_of("right")
    waits = []
    for _ in range(5):  # each further wrong key doubles the wait, up to the cap
        with pytest.raises(ServerUnauthenticated):
            keys.identify("Bearer wrong", "10.0.0.1")
        with pytest.raises(AuthThrottledError) as throttled:
            keys.identify("Bearer right", "10.0.0.1")
        waits.append(throttled.value.retry_after_s)
        clock.now += throttled.value.retry_after_s
    assert waits == [2, 4, 8, 8, 8]
    assert failures.failures_total == 8 and failures.throttled_total == 7
    clock.now += 61  # failures age out of the window
    assert keys.identify("Bearer right", "10.0.0.1") == identity_of("right")


def test_the_throttle_remembers_a_bounded_number_of_addresses():
    failures = AuthFailures(ThrottleRule(threshold=1, max_addresses=100), Clock())
    for index in range(1000):
        failures.record(f"10.{index // 256}.{index % 256}.1")
    assert len(failures._failures) == 100 and failures.failures_total == 1000
    with pytest.raises(AuthThrottledError):
        failures.check("10.3.231.1")  # the most recent ones are remembered
    failures.check("10.0.0.1")  # the oldest forgotten


def test_grpc_peers_are_named_as_http_names_them():
    assert grpc_peer_address("ipv4:127.0.0.1:50211") == "127.0.0.1"
    assert grpc_peer_address("ipv6:[::1]:50211") == "::1"
    assert grpc_peer_address("ipv6:%5B::1%5D:50211") == "::1"
    assert grpc_peer_address("unix:/tmp/kiln.sock") == "unix:/tmp/kiln.sock"


# ---- tokens per minute ---------------------------------------------------------------------------

def test_tokens_per_minute_slide_and_retry_after_is_when_the_window_frees():
    clock = Clock()
    quotas = Quotas(lambda _: Limits(tokens_per_minute=100), lambda _: OwnerUsage(0, 0), clock)
    quotas.charge("k", 30)
    clock.now += 20
    quotas.charge("k", 80)  # 110 in the window: over
    with pytest.raises(QuotaExceededError, match="tokens_per_minute = 100") as refused:
        quotas._check_generations("k", Limits(tokens_per_minute=100), 1)
    assert refused.value.retry_after_s == pytest.approx(41)  # the 30 of t=1000 leave at 1061
    clock.now += 41
    quotas._check_generations("k", Limits(tokens_per_minute=100), 1)  # 80 left: admitted


# ---- fairness under pool pressure ----------------------------------------------------------------

def test_a_flooding_key_loses_its_own_idle_kv_first(tiny_llm):
    """Two keys on a pool of 60 pages (240 tokens): a session of the quiet key, then the flooding key opens
    session after session (11 pages each). The flooder holds more than its share (30 pages) whenever the
    pool is full, so its own idle K/V is dropped, though the quiet session is the least recently used:
    plain LRU would drop that one first. The quiet key's turns keep reusing their prefix."""
    llm = tiny_llm("llama", page_size=4, kv_pages=60, speculative=None)
    store, turn = llm.sessions, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    quiet = store.create(list(range(3, 43)), owner="quiet")
    assert store.generate(quiet, turn, "quiet").result().usage.prefilled_tokens == 40
    for round_ in range(3):
        for index in range(8):
            flood = store.create([7 + round_ * 8 + index] * 40, owner="flood")
            store.generate(flood, turn, "flood").result()
            info = store.info(quiet, "quiet")
            assert info.computed_tokens == info.history_tokens - 1, f"the quiet key's K/V went in round {round_}"
        store.append(quiet, [5], "quiet")
        assert store.generate(quiet, turn, "quiet").result().usage.prefilled_tokens == 2  # last generated + appended
    assert llm.engine.stats.kv_dropped_tokens["idle"] >= 10 * 43  # the flooder's own K/V made the room
    assert [info.computed_tokens for info in store.list("flood")].count(0) >= 10


# ---- against a real `kiln serve` -----------------------------------------------------------------

KEYS = {"sessions": "k-sessions", "gens": "k-gens", "tpm": "k-tpm", "kv": "k-kv", "plain": "k-plain",
        "removable": "k-removable"}
KEYS_TOML = f"""
[keys.sessions]
key_sha256 = "{sha(KEYS['sessions'])}"
max_sessions = 2

[keys.gens]
key_sha256 = "{sha(KEYS['gens'])}"
max_concurrent_generations = 1

[keys.tpm]
key_sha256 = "{sha(KEYS['tpm'])}"
tokens_per_minute = 40

[keys.kv]
key_sha256 = "{sha(KEYS['kv'])}"
max_resident_kv_bytes = "1KiB"

[keys.plain]
key = "{KEYS['plain']}"
"""
REMOVABLE = f"""
[keys.removable]
key_sha256 = "{sha(KEYS['removable'])}"
"""
THRESHOLD = 4


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("quota-keys") / "keys.toml"
    path.write_text(KEYS_TOML + REMOVABLE)
    return path


@pytest.fixture(scope="module")
def server(servers_root, keys_file):
    handle = start_server(str(tiny_model_dir(servers_root)), servers_root / "cache",
                          extra=("--api-keys-file", str(keys_file), "--auth-failure-threshold", str(THRESHOLD)),
                          vocab_size=TINY_CONFIGS["llama"].vocab_size)
    yield handle
    handle.stop()


def http(server: ServerHandle, name: str) -> httpx.Client:
    return httpx.Client(base_url=server.http_url, timeout=TIMEOUT, headers={"authorization": f"Bearer {KEYS[name]}"})


def refused_429(response: httpx.Response, limit: str) -> int:
    """The Retry-After of a 429 whose message names the limit and its value."""
    assert response.status_code == 429, response.text
    assert re.search(rf"{limit} = \d+", response.json()["error"]["message"]), response.text
    return int(response.headers["retry-after"])


def grpc_refusal(server: ServerHandle, name: str, method: str, request) -> grpc.RpcError:  # noqa: ANN001
    """A raw call (to read the trailing metadata the SDK does not show) that must fail."""
    with grpc.insecure_channel(server.grpc_address) as channel:
        call = channel.unary_stream if method == "Generate" else channel.unary_unary
        stub = call(f"/kiln.v1.Runtime/{method}", request_serializer=type(request).SerializeToString)
        with pytest.raises(grpc.RpcError) as failed:
            reply = stub(request, metadata=(("authorization", f"Bearer {KEYS[name]}"),), timeout=TIMEOUT)
            if method == "Generate":
                next(reply)
        return failed.value


def retry_after_of(error: grpc.RpcError) -> int:
    return int(dict(error.trailing_metadata())["retry-after"])


def test_max_sessions_on_both_transports(server):
    with http(server, "sessions") as client:
        first = client.post("/v1/sessions", json={"token_ids": [5, 6]})
        assert first.status_code == 201, first.text
        assert client.post(f"/v1/sessions/{first.json()['session_id']}/fork", json={}).status_code == 201
        assert refused_429(client.post("/v1/sessions", json={"token_ids": [5]}), "max_sessions") >= 1
        refused_429(client.post(f"/v1/sessions/{first.json()['session_id']}/fork", json={}), "max_sessions")
        error = grpc_refusal(server, "sessions", "CreateSession", pb.CreateSessionRequest(token_ids=[5]))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions = 2" in error.details()
        assert retry_after_of(error) >= 1
        assert client.delete(f"/v1/sessions/{first.json()['session_id']}").status_code in (200, 204)
        assert client.post("/v1/sessions", json={"token_ids": [5]}).status_code == 201  # room again
    with http(server, "plain") as other:  # another key's sessions are not counted
        assert other.post("/v1/sessions", json={"token_ids": [5]}).status_code == 201


def test_max_concurrent_generations_on_both_transports(server):
    with Client(server.grpc_address, api_key=KEYS["gens"]) as client, http(server, "gens") as rest:
        busy, idle = client.create_session([5, 6, 7]), client.create_session([8, 9])
        running = busy.generate(900, ignore_eos=True)
        next(iter(running))  # in flight now
        with pytest.raises(ResourceExhaustedError, match="max_concurrent_generations = 1"):
            idle.generate(2, ignore_eos=True).result()
        refused_429(rest.post(f"/v1/sessions/{idle.id}/generate", json={"max_tokens": 2}), "max_concurrent_generations")
        refused_429(rest.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), "max_concurrent_generations")
        assert busy.info().generating, "the first generation ended before the refusals: make it longer"
        running.cancel()
        assert idle.generate(2, ignore_eos=True).result().finish_reason == "length"  # the slot came back


def test_tokens_per_minute_on_both_transports(server):
    with http(server, "tpm") as rest, Client(server.grpc_address, api_key=KEYS["tpm"]) as client:
        session = rest.post("/v1/sessions", json={"token_ids": [5, 6, 7]}).json()["session_id"]
        first = rest.post(f"/v1/sessions/{session}/generate", json={"max_tokens": 45, "ignore_eos": True})
        assert first.status_code == 200, first.text  # admitted under budget, charged 3 + 45: over it now
        wait = refused_429(rest.post(f"/v1/sessions/{session}/generate", json={"max_tokens": 1}), "tokens_per_minute")
        assert 1 <= wait <= 61
        refused_429(rest.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}), "tokens_per_minute")
        with pytest.raises(ResourceExhaustedError, match="tokens_per_minute = 40"):
            client.get_session(session).generate(1).result()
        error = grpc_refusal(server, "tpm", "Generate", pb.GenerateRequest(session_id=session, max_tokens=1))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and 1 <= retry_after_of(error) <= 61


def test_max_resident_kv_bytes_on_both_transports(server):
    with http(server, "kv") as rest, Client(server.grpc_address, api_key=KEYS["kv"]) as client:
        session = client.create_session([5, 6, 7, 8])
        assert session.generate(2, ignore_eos=True).result().finish_reason == "length"  # from 0 bytes: admitted
        assert session.info().resident_kv_bytes > 1024
        with pytest.raises(ResourceExhaustedError, match="max_resident_kv_bytes = 1024"):
            session.generate(2).result()
        refused_429(rest.post(f"/v1/sessions/{session.id}/generate", json={"max_tokens": 1}), "max_resident_kv_bytes")
        session.close()
        fresh = client.create_session([5, 6])
        assert fresh.generate(1).result().finish_reason == "length"  # closing freed the bytes


def wait_for_log(server: ServerHandle, pattern: str, seen: int) -> str:
    """The first log line after the first `seen` ones that matches (the server prints one per reload)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        found = [line for line in server.log[seen:] if re.search(pattern, line)]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no log line {pattern!r}:\n" + "".join(server.log[-20:]))


def test_sighup_reloads_the_keys_file(server, keys_file):
    with http(server, "removable") as removable:
        assert removable.get("/v1/sessions").status_code == 200
        kept = http(server, "plain").post("/v1/sessions", json={"token_ids": [9]}).json()["session_id"]
        keys_file.write_text(KEYS_TOML + "[keys.newcomer]\nkey = 'k-newcomer'\n")
        seen = len(server.log)
        server.process.send_signal(signal.SIGHUP)
        assert "(6 keys)" in wait_for_log(server, "API keys reloaded", seen)
        assert removable.get("/v1/sessions").status_code == 401
        newcomer = httpx.get(server.http_url + "/v1/sessions", headers={"authorization": "Bearer k-newcomer"})
        assert newcomer.status_code == 200
        with http(server, "plain") as plain:  # the same identity: its sessions are still its own
            assert plain.get(f"/v1/sessions/{kept}").status_code == 200

        keys_file.write_text("[keys.broken]\nkey = 'x'\nmax_sessions = 'many'\n")
        seen = len(server.log)
        server.process.send_signal(signal.SIGHUP)
        assert "max_sessions" in wait_for_log(server, "API keys not reloaded", seen)  # the old keys still work:
        assert httpx.get(server.http_url + "/v1/sessions", headers={"authorization": "Bearer k-newcomer"}).status_code == 200
        assert server.process.poll() is None
    keys_file.write_text(KEYS_TOML + REMOVABLE)


def test_repeated_failed_authentication_is_throttled_on_both_transports(server):
    """Last in the module: it leaves this address throttled."""
    before = metric(server, "kiln_auth_failures_total")
    with httpx.Client(base_url=server.http_url, timeout=TIMEOUT) as anonymous:
        two_spaces = {"authorization": "Bearer  k-plain"}  # the right key, one space too many: a failure
        failed = 0
        while (reply := anonymous.get("/v1/sessions", headers=two_spaces)).headers.get("retry-after") is None:
            assert reply.status_code == 401 and "malformed" in reply.json()["error"]["message"]
            failed += 1
            assert failed <= THRESHOLD, "never throttled"
        assert reply.status_code == 401 and "too many failed" in reply.json()["error"]["message"]
        assert metric(server, "kiln_auth_failures_total") == before + failed
        right = {"authorization": f"Bearer {KEYS['plain']}"}
        refused = anonymous.get("/v1/sessions", headers=right)  # the right key is refused too, unread
        assert refused.status_code == 401 and int(refused.headers["retry-after"]) >= 1
        with Client(server.grpc_address, api_key=KEYS["plain"]) as client, pytest.raises(UnauthenticatedError, match="too many"):
            client.health()
        assert metric(server, "kiln_auth_throttled_total") >= 2
        time.sleep(int(refused.headers["retry-after"]))  # what the server asked for
        assert anonymous.get("/v1/sessions", headers=right).status_code == 200


def metric(server: ServerHandle, name: str) -> float:
    text = httpx.get(server.http_url + "/metrics", timeout=TIMEOUT).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0
