"""The HTTP edge against a real `kiln serve`: the Host check (DNS rebinding), the Origin check and CORS,
slow and idle clients (slowloris, a stalled body, 2,000 idle connections, the connection cap), and
access logs on both transports; the same layers in process where no socket is needed."""

from __future__ import annotations

import json
import logging
import resource
import select
import selectors
import socket
import time
from collections.abc import Callable, Iterator

import grpc
import httpx
import pytest
from fastapi.testclient import TestClient

from kiln.cli import main as kiln_main
from kiln.server import http_connections
from kiln.server.access_log import AccessFormatter, AccessLog, text_line
from kiln.server.auth import ApiKeys
from kiln.server.http import build_http_app
from kiln.server.http_connections import HttpLimits, ensure_fd_limit
from kiln.server.http_guard import HttpGuard
from kiln.server.metrics import Metrics
from kiln.server.service import RuntimeService
from kiln.v1 import runtime_pb2 as pb
from tests.server.conftest import ServerHandle, start_server, tiny_model_dir

KEY = "edge-key-K3Y-MARKER"
AUTH = {"Authorization": f"Bearer {KEY}"}
ALLOWED = "kiln.internal"
APP_ORIGIN = "https://app.example"
TIMEOUT_S = 2.0  # the server's header and body timeouts
IDLE_S = 6.0  # the server's idle timeout: long enough to open the flood before the first ones close
MAX_CONNECTIONS = 2048
FLOOD = 2000
MARGIN_S = 5.0  # scheduling slack on a busy 2-core machine
FLAGS = ("--allowed-host", ALLOWED, "--cors-origin", APP_ORIGIN, "--http-header-timeout-s", str(TIMEOUT_S),
         "--http-body-timeout-s", str(TIMEOUT_S), "--http-idle-timeout-s", str(IDLE_S),
         "--max-connections", str(MAX_CONNECTIONS), "--log-format", "json")


@pytest.fixture(scope="module")
def server(servers_root) -> Iterator[ServerHandle]:
    handle = start_server(str(tiny_model_dir(servers_root)), servers_root / "cache", (KEY,), FLAGS)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http_url, timeout=60.0, headers=AUTH) as client:
        yield client


def http_port(server: ServerHandle) -> int:
    return int(server.http_url.rsplit(":", 1)[1])


def raw_exchange(server: ServerHandle, request: bytes) -> bytes:
    """What the server answers a hand-written request, read until it closes the connection."""
    with socket.create_connection(("127.0.0.1", http_port(server)), timeout=30) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def access_lines(server: ServerHandle, match: Callable[[dict], bool], timeout: float = 10.0) -> list[dict]:
    """The JSON access log lines matching `match`, waiting for the logging thread to write them."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [json.loads(line) for line in list(server.log) if line.startswith('{"time"')]
        found = [line for line in lines if match(line)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


# ---- Host and Origin ------------------------------------------------------------------------------


def test_a_foreign_host_is_misdirected_before_auth_and_never_echoed(server, http):
    port = http_port(server)
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil.example:80"):
        for headers in (AUTH, {}):  # with or without a key: 421 either way, so nothing leaks about auth
            response = httpx.get(f"{server.http_url}/v1/models", headers={**headers, "Host": host})
            assert response.status_code == 421, (host, response.text)
            assert response.json()["error"]["code"] == "INVALID_ARGUMENT"
            assert "evil" not in response.text and all("evil" not in value for value in response.headers.values())
    for host in ("localhost", f"localhost:{port}", "127.0.0.1", f"127.0.0.1:{port}", "[::1]", f"[::1]:{port}",
                 ALLOWED, f"{ALLOWED}:{port}", "LOCALHOST"):
        assert http.get("/v1/models", headers={"Host": host}).status_code == 200, host
    assert httpx.get(f"{server.http_url}/v1/models", headers={"Host": "localhost"}).status_code == 401
    assert http.get("/metrics", headers={"Host": "evil.example"}).status_code == 421  # not exempt
    assert http.get("/healthz", headers={"Host": "10.1.2.3"}).status_code == 200  # load balancers probe by IP


def test_requests_without_exactly_one_host_are_refused(server):
    no_host = raw_exchange(server, b"GET /v1/models HTTP/1.0\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n")
    assert no_host.startswith(b"HTTP/1.1 421 ")
    two_hosts = raw_exchange(server, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\n"
                                     b"Connection: close\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n")
    assert two_hosts.startswith(b"HTTP/1.1 400 ") and b"evil" not in two_hosts  # h11 refuses it first


def test_no_redirect_echoes_a_host(http):
    response = http.get("/v1/sessions/", headers={"Host": ALLOWED})
    assert response.status_code == 404 and "location" not in response.headers


def test_a_web_page_not_named_cannot_even_send_a_simple_request(http):
    """A cross-site form-like POST runs without a preflight in the browser: refused on its Origin."""
    before = len(http.get("/v1/sessions").json()["data"])
    refused = http.post("/v1/sessions", headers={"Origin": "https://evil.example", "Content-Type": "text/plain"})
    assert refused.status_code == 403 and "evil" not in refused.text
    assert "access-control-allow-origin" not in refused.headers
    assert len(http.get("/v1/sessions").json()["data"]) == before
    own = f"http://127.0.0.1:{http.base_url.port}"
    assert http.get("/v1/models", headers={"Origin": own}).status_code == 200  # the server's own origin


def test_cors_answers_only_the_named_origin(http):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    named = http.options("/v1/completions", headers={"Origin": APP_ORIGIN, **preflight})
    assert named.status_code == 200 and named.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "access-control-allow-credentials" not in named.headers
    simple = http.get("/v1/models", headers={"Origin": APP_ORIGIN})
    assert simple.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "x-request-id" in simple.headers["access-control-expose-headers"]
    for response in (http.options("/v1/completions", headers={"Origin": "https://other.example", **preflight}),
                     http.get("/v1/models", headers={"Origin": "https://other.example"})):
        assert response.status_code == 403
        assert not any(name.startswith("access-control-") for name in response.headers)


def test_by_default_no_response_carries_cors_headers(tiny_llm):
    """Without --cors-origin: no Access-Control-* header on anything, a preflight included."""
    service = RuntimeService(tiny_llm("llama"), "tiny")
    app = build_http_app(service, ApiKeys(), Metrics(service.llm), guard=HttpGuard.for_bind("127.0.0.1"))
    http = TestClient(app, base_url="http://localhost")
    responses = [
        http.get("/v1/models"),
        http.get("/v1/models", headers={"Origin": "https://evil.example"}),
        http.options("/v1/completions", headers={"Origin": "https://evil.example",
                                                 "Access-Control-Request-Method": "POST"}),
        http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}),
    ]
    assert [response.status_code for response in responses] == [200, 403, 403, 200]
    for response in responses:
        assert not any(name.startswith("access-control-") for name in response.headers)


def test_the_host_names_a_server_answers():
    assert HttpGuard.for_bind("192.168.1.5").allows_host([(b"host", b"192.168.1.5:8000")])
    assert HttpGuard.for_bind("::1").allows_host([(b"host", b"[::1]:8000")])
    assert HttpGuard.for_bind("fe80::1").allows_host([(b"host", b"[fe80::1]")])
    assert HttpGuard.for_bind("myhost.lan").allows_host([(b"host", b"MyHost.lan")])
    wildcard = HttpGuard.for_bind("0.0.0.0", ["kiln.lan"])
    assert wildcard.allows_host([(b"host", b"kiln.lan:1")]) and wildcard.allows_host([(b"host", b"localhost")])
    assert not wildcard.allows_host([(b"host", b"0.0.0.0")]) and not wildcard.allows_host([(b"host", b"10.0.0.7")])
    anything = HttpGuard.for_bind("0.0.0.0", ["*"])
    assert anything.allows_host([(b"host", b"evil.example")]) and anything.allows_host([])
    for malformed in (b"[::1", b"localhost:port", b"local host", b"", b"evil.example@localhost"):
        assert not HttpGuard.for_bind("127.0.0.1").allows_host([(b"host", malformed)])
    two = [(b"host", b"localhost"), (b"host", b"localhost")]  # h11 refuses these before the guard sees them
    assert not HttpGuard.for_bind("127.0.0.1").allows_host(two)


# ---- slow and idle clients ------------------------------------------------------------------------


def test_slowloris_headers_are_cut_at_the_header_timeout(server):
    """Headers a byte a second: the connection is closed once the header timeout passes from the first
    byte, long before the request would have been complete."""
    request = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Padding: " + b"a" * 60 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", http_port(server))) as sock:
        started = time.monotonic()
        for index in range(len(request)):
            try:
                sock.sendall(request[index : index + 1])
                readable, _, _ = select.select([sock], [], [], 1.0)  # the attack's pace: a byte a second
                if readable and sock.recv(4096) == b"":
                    break
            except OSError:  # reset by the server: closed as well
                break
        closed_after = time.monotonic() - started
    assert index < len(request) - 1, "the whole request went through"
    assert closed_after < TIMEOUT_S + MARGIN_S


def test_a_stalled_body_is_answered_408_and_closed(server):
    with socket.create_connection(("127.0.0.1", http_port(server)), timeout=TIMEOUT_S + MARGIN_S) as sock:
        sock.sendall(b"POST /v1/tokenize HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"text\"")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and json.loads(body)["error"]["code"] == "DEADLINE_EXCEEDED"
    line = access_lines(server, lambda line: line["route"] == "http/v1/tokenize" and line["status"] == 408)
    assert line and line[0]["code"] == "DEADLINE_EXCEEDED"


def raise_own_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"this test needs {needed} file descriptors; RLIMIT_NOFILE's hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def readable_within(socks: list[socket.socket], timeout: float) -> set[socket.socket]:
    """The sockets that have something to read (data or the server's close) within `timeout`."""
    ready: set[socket.socket] = set()
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:  # epoll: descriptors past select()'s 1024
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        while len(ready) < len(socks) and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                ready.add(key.fileobj)  # type: ignore[arg-type]
                selector.unregister(key.fileobj)
    return ready


def test_two_thousand_idle_connections_do_not_starve_a_bystander(server, http):
    """2,000 idle connections: the server stays up and a bystander's completion goes through; the
    connections past --max-connections are answered 503 at once; the idle ones close after the idle
    timeout."""
    raise_own_fd_limit(MAX_CONNECTIONS + 400)
    port = http_port(server)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(FLOOD)]
    try:
        reply = http.post("/v1/completions", json={"prompt": "a bystander", "max_tokens": 8, "temperature": 0},
                          timeout=30.0)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8
        extra = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS + 50 - FLOOD)]
        refused = readable_within(extra, MARGIN_S)
        assert len(refused) >= 50
        for sock in refused:
            assert sock.recv(65536).startswith(b"HTTP/1.1 503 ")
        opened = time.monotonic()
        closed = readable_within(idle, IDLE_S + MARGIN_S)
        assert len(closed) == FLOOD and all(sock.recv(1) == b"" for sock in closed)
        assert time.monotonic() - opened < IDLE_S + MARGIN_S
        assert http.get("/healthz").json()["status"] == "serving"
    finally:
        for sock in idle + locals().get("extra", []):
            sock.close()


def test_limits_refuse_bad_values_and_raise_the_fd_limit(monkeypatch):
    for bad in ({"max_connections": 0}, {"idle_timeout_s": 0}, {"header_timeout_s": float("nan")},
                {"body_timeout_s": -1}, {"max_connections": True}):
        with pytest.raises(Exception, match="must be a positive") as error:
            HttpLimits(**bad)
        assert error.value.code == "INVALID_ARGUMENT"
    limits: list[tuple[int, int]] = [(256, 8192)]
    monkeypatch.setattr(http_connections.resource, "getrlimit", lambda _: limits[-1])
    monkeypatch.setattr(http_connections.resource, "setrlimit", lambda _, value: limits.append(value))
    assert ensure_fd_limit(HttpLimits(max_connections=1024)) is None and limits[-1] == (8192, 8192)
    limits.append((1024, 1024))
    assert "--max-connections 2048" in ensure_fd_limit(HttpLimits(max_connections=2048))


@pytest.mark.parametrize("flags", [
    ("--max-connections", "0"), ("--http-header-timeout-s", "-1"), ("--http-idle-timeout-s", "inf"),
    ("--allowed-host", "evil example"), ("--allowed-host", "kiln.lan:8000"), ("--cors-origin", "*"),
    ("--cors-origin", "https://app.example/"),
])
def test_bad_edge_flags_exit_2_before_the_model_loads(flags, capsys):
    assert kiln_main(["serve", "--no-persist", "--model", "/nonexistent", *flags]) == 2
    assert "INVALID_ARGUMENT" in capsys.readouterr().err


# ---- access logs ----------------------------------------------------------------------------------


def test_each_request_has_one_log_line_without_content_or_keys(server, http):
    marker = "PROMPT-MARKER-7f3a"
    response = http.post("/v1/completions", json={"prompt": marker, "max_tokens": 3, "temperature": 0},
                         headers={"x-request-id": "client-id-1"})
    assert response.status_code == 200 and response.headers["x-request-id"] == "client-id-1"
    [line] = access_lines(server, lambda line: line["request_id"] == "client-id-1")
    assert line["transport"] == "http" and line["route"] == "http/v1/completions" and line["method"] == "POST"
    assert line["status"] == 200 and line["code"] == "OK" and line["generations"] == 1
    assert line["completion_tokens"] == 3 and line["prompt_tokens"] > 0
    assert line["request_bytes"] == len(response.request.content) and line["response_bytes"] == len(response.content)
    assert line["duration_ms"] >= 0 and line["peer"].startswith("127.0.0.1:")
    assert len(line["caller"]) == 12 and line["caller"] in ApiKeys([KEY]).identify(f"Bearer {KEY}")
    generated = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"x-request-id": "bad id!"})
    assert len(generated.headers["x-request-id"]) == 16  # not a sane token: the server made one
    log = "".join(server.log)
    assert marker not in log and KEY not in log and "K3Y" not in log


def test_grpc_calls_are_logged_and_return_their_request_id(server):
    channel = grpc.insecure_channel(server.grpc_address)
    health = channel.unary_unary("/kiln.v1.Runtime/Health", request_serializer=pb.HealthRequest.SerializeToString,
                                 response_deserializer=pb.HealthResponse.FromString)
    info = channel.unary_unary("/kiln.v1.Runtime/GetSessionInfo",
                               request_serializer=pb.GetSessionInfoRequest.SerializeToString,
                               response_deserializer=pb.GetSessionInfoResponse.FromString)
    try:
        _, call = health.with_call(pb.HealthRequest(), metadata=[("x-request-id", "grpc-ok-1"), ("authorization", f"Bearer {KEY}")])
        assert ("x-request-id", "grpc-ok-1") in call.trailing_metadata()
        with pytest.raises(grpc.RpcError) as failed:
            info(pb.GetSessionInfoRequest(session_id="nope"), metadata=[("x-request-id", "grpc-missing-1"),
                                                                      ("authorization", f"Bearer {KEY}")])
        assert failed.value.code() == grpc.StatusCode.NOT_FOUND
        assert ("x-request-id", "grpc-missing-1") in failed.value.trailing_metadata()
    finally:
        channel.close()
    [ok] = access_lines(server, lambda line: line["request_id"] == "grpc-ok-1")
    assert ok["transport"] == "grpc" and ok["route"] == "grpc/Health" and ok["code"] == "OK"
    assert ok["response_bytes"] > 0 and len(ok["caller"]) == 12
    [missing] = access_lines(server, lambda line: line["request_id"] == "grpc-missing-1")
    assert missing["code"] == "NOT_FOUND" and missing["request_bytes"] == len(b"\n\x04nope")


def test_log_content_and_the_text_format(tiny_llm, caplog):
    """--log-content adds the request and response text; the text format quotes what could break a line."""
    service = RuntimeService(tiny_llm("llama"), "tiny")
    marker = "CONTENT-MARKER-91c"
    for content in (False, True):
        app = build_http_app(service, ApiKeys(), Metrics(service.llm), access=AccessLog("text", content))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kiln.access"):
            assert TestClient(app).post("/v1/completions", json={"prompt": marker, "max_tokens": 2}).status_code == 200
        [record] = [record for record in caplog.records if record.name == "kiln.access"]
        text = AccessFormatter("text").format(record)
        assert (marker in text) is content and ("request_content=" in text) is content
        parsed = json.loads(AccessFormatter("json").format(record))
        assert parsed["route"] == "http/v1/completions" and (marker in parsed.get("request_content", "")) is content
    assert text_line({"route": "http/x", "peer": "a b", "id": 'x"\nforged=1'}) == \
        'route=http/x peer="a b" id="x\\"\\nforged=1"'
