"""Slow clients and deadlines against a real `kiln serve`: a stream whose client never reads (gRPC with a
tiny HTTP/2 window, SSE on a socket with a tiny receive buffer) is paused, then cancelled after
--stall-timeout-s, its pages released and its session usable, while a bystander's turns go on; SDK
deadlines (per call and a client default, sync and asyncio) raise DeadlineExceededError and cancel the
generation on the server; a client that disconnects cancels its HTTP generation; over
--max-concurrent-rpcs, gRPC answers RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from kiln.cli import main
from kiln.client import (
    AsyncClient,
    Client,
    DeadlineExceededError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from kiln.server.generation import STATUS_KEY, SseResponse
from kiln.server.service import GenerateRequest, RuntimeService
from kiln.v1 import rpc
from kiln.v1 import runtime_pb2 as pb
from tests.server.conftest import ServerHandle, start_server, tiny_model_dir
from tests.tiny_models import TINY_CONFIGS

STALL_TIMEOUT_S = 2.0
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
LONG = 900  # far more tokens than a tiny window and the backlog bound hold, well inside the context (1024)
# A client channel whose HTTP/2 window stays at 1 KiB (no BDP probing): the server's writes wait on flow
# control after a few dozen token messages the client does not read.
TINY_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
BOUND_S = 30.0
_prompts = itertools.count(20)  # liveness bound: what must happen does so well within it


def start(servers_root, *flags: str) -> Iterator[ServerHandle]:
    server = start_server(str(tiny_model_dir(servers_root)), servers_root / "cache", extra=flags,
                          vocab_size=TINY_CONFIGS["llama"].vocab_size)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(servers_root) -> Iterator[ServerHandle]:
    yield from start(servers_root, "--stall-timeout-s", str(STALL_TIMEOUT_S))


@pytest.fixture(scope="module")
def limited(servers_root) -> Iterator[ServerHandle]:
    yield from start(servers_root, "--max-concurrent-rpcs", "3")


def metrics(server: ServerHandle) -> str:
    return urllib.request.urlopen(f"{server.http_url}/metrics", timeout=10).read().decode()


def sample(server: ServerHandle, name: str, labels: str = "") -> float:
    found = re.search(rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$", metrics(server), re.M)
    return float(found.group(1)) if found else 0.0


def eventually(condition: Callable[[], bool], what: str, timeout_s: float = BOUND_S) -> None:
    """The server's state, which no event of ours announces: polled until it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


def raw_generate(channel: grpc.Channel, session_id: str, max_tokens: int = LONG) -> grpc.Call:
    """A Generate call nobody reads (raw stub: the SDK would read the acceptance)."""
    request = pb.GenerateRequest(session_id=session_id, max_tokens=max_tokens, ignore_eos=True)
    return rpc.stub(channel).Generate(request)


def received(call: grpc.Call) -> tuple[list[int], grpc.StatusCode]:
    """Everything the server had sent before the call ended, and its status."""
    tokens: list[int] = []
    try:
        for event in call:
            tokens += event.tokens.token_ids
    except grpc.RpcError as error:
        return tokens, error.code()
    return tokens, grpc.StatusCode.OK


def prompt() -> list[int]:
    """A prompt of its own: distinct greedy histories share no pages, so the pool's used pages are the
    sum of the sessions' resident pages."""
    return [next(_prompts), *PROMPT]


def pages_beyond_sessions(client: Client) -> int:
    """Pool pages in use that no session holds: those of generations still running (none, when idle)."""
    return client.health().kv_pages_used - sum(s.resident_pages for s in client.list_sessions())


def bystander_turn(client: Client) -> None:
    session = client.create_session(prompt())
    started = time.monotonic()
    assert len(session.generate(max_tokens=32, ignore_eos=True).result().token_ids) == 32
    assert time.monotonic() - started < BOUND_S


def session_tokens(server: ServerHandle, session_id: str) -> list[int]:
    """A session's history, from the REST mirror (the gRPC API reports its length only)."""
    with urllib.request.urlopen(f"{server.http_url}/v1/sessions/{session_id}/tokens", timeout=10) as reply:
        return json.load(reply)["token_ids"]


def test_a_grpc_stream_never_read_is_paused_then_cancelled_and_its_session_goes_on(server):
    stalls = sample(server, "kiln_generation_stall_cancels_total")
    with Client(server.grpc_address) as client, grpc.insecure_channel(server.grpc_address, options=TINY_WINDOW) as stalled:
        session = client.create_session(start := prompt())
        call = raw_generate(stalled, session.id)
        eventually(lambda: sample(server, "kiln_generations_paused") == 1, "the unread generation was paused")
        bystander_turn(client)  # runs while the stalled generation is paused
        eventually(lambda: sample(server, "kiln_generation_stall_cancels_total") == stalls + 1, "it was cancelled")
        assert sample(server, "kiln_generations_paused") == 0
        eventually(lambda: not session.info().generating, "the session is free")
        tokens, status = received(call)
        assert status == grpc.StatusCode.CANCELLED  # the call ended: the client gets what it had, then the status
        generated = session_tokens(server, session.id)[len(start):]
        assert 0 < len(generated) < LONG and tokens == generated[:len(tokens)]  # committed tokens joined the history
        assert pages_beyond_sessions(client) == 0
        turn = session.generate(max_tokens=5, ignore_eos=True).result()
        assert session_tokens(server, session.id) == start + generated + turn.token_ids


def test_an_sse_stream_never_read_over_a_real_socket_is_paused_then_cancelled(server):
    """Over TCP, not a simulated write: the server's per-connection send buffer is capped, so an unread
    stream (here ~1.3 MB: twenty top logprobs a token) fills it and waits, rather than being parked whole
    in loopback's autotuned buffers and generated to its end."""
    stalls = sample(server, "kiln_generation_stall_cancels_total")
    with Client(server.grpc_address) as client:
        sock = sse_request(server, {"max_tokens": LONG, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                                    "logprobs": True, "top_logprobs": 20}, path="/v1/chat/completions")
        try:
            eventually(lambda: sample(server, "kiln_generations_paused") == 1, "the unread generation was paused")
            bystander_turn(client)
            eventually(lambda: sample(server, "kiln_generation_stall_cancels_total") == stalls + 1, "it was cancelled")
            eventually(lambda: pages_beyond_sessions(client) == 0, "its pages went back")
        finally:
            sock.close()


def test_an_sse_response_whose_writes_wait_for_good_is_paused_then_cancelled_and_dropped(tiny_llm):
    """The HTTP side in process: an ASGI `send` that stops returning after the first events is a client
    whose TCP window stays shut (a real socket cannot show it here: loopback lets the kernel buffer
    megabytes, more than the tiny model's context can produce)."""
    llm = tiny_llm("llama")

    async def run() -> None:
        service = RuntimeService(llm, "tiny", stall_timeout_s=0.5)
        session = service.create_session(None, PROMPT)
        stream = await service.generate(None, session.session_id, GenerateRequest(max_tokens=LONG, ignore_eos=True))
        response = SseResponse(({"token": token} async for token in stream), [stream])
        sent: list[dict] = []
        shut = asyncio.Event()  # never set: the client never reads again

        async def send(message: dict) -> None:
            sent.append(message)
            if len(sent) > 3:
                await shut.wait()

        async def receive() -> dict:
            await shut.wait()
            return {"type": "http.disconnect"}

        scope: dict = {"type": "http", "asgi": {"spec_version": "2.3"}}
        await asyncio.wait_for(response(scope, receive, send), BOUND_S)  # dropped unfinished: the server closes it
        result = await stream.result()
        assert result.finish_reason == "cancelled" and scope[STATUS_KEY] == "CANCELLED"
        assert llm.engine.stats.stall_cancels == 1 and llm.engine.stats.paused_now == 0
        info = service.info(None, session.session_id)
        assert not info.generating and service.history(None, session.session_id) == PROMPT + result.token_ids
        assert llm.engine.kv_usage().used == info.resident_pages
        follow = await service.generate(None, session.session_id, GenerateRequest(max_tokens=5, ignore_eos=True))
        assert len((await follow.result()).token_ids) == 5

    asyncio.run(run())


@pytest.fixture
def tiny_windows(monkeypatch) -> None:
    """SDK clients made in the test open channels with a tiny HTTP/2 window: a generation they do not
    read cannot finish before its deadline, whatever the machine's speed."""
    for api in (grpc, grpc.aio):
        real = api.insecure_channel
        monkeypatch.setattr(api, "insecure_channel", lambda address, real=real: real(address, options=TINY_WINDOW))


def cancelled_generations(server: ServerHandle) -> float:
    return sample(server, "kiln_generations_total", 'reason="cancelled"')


@pytest.fixture
def silent() -> Iterator[str]:
    """An address whose TCP handshake completes but which never speaks HTTP/2: every call to it waits
    until its deadline, whatever the machine's speed."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"127.0.0.1:{listener.getsockname()[1]}"


def test_sync_sdk_deadlines_per_call_and_by_default_raise_deadline_exceeded(silent):
    with Client(silent, timeout_s=0.2) as client:
        with pytest.raises(DeadlineExceededError):
            client.health()  # the client's default
        with pytest.raises(DeadlineExceededError):
            client.create_session([1, 2], timeout_s=0.1)  # a call's own
    with Client(silent) as client, pytest.raises(DeadlineExceededError):
        client.get_session("abc", timeout_s=0.1)
    for bad in (0, -1, float("nan"), float("inf"), True, "1"):
        with pytest.raises(InvalidArgumentError, match="timeout_s"):
            Client(silent, timeout_s=bad)


def test_asyncio_sdk_deadlines_per_call_and_by_default_raise_deadline_exceeded(silent):
    async def run() -> None:
        async with AsyncClient(silent, timeout_s=0.2) as client:
            with pytest.raises(DeadlineExceededError):
                await client.list_sessions()
            with pytest.raises(DeadlineExceededError):
                await client.tokenize("hi", timeout_s=0.1)

    asyncio.run(run())


def test_a_generate_past_its_deadline_raises_and_its_generation_is_cancelled_on_the_server(server, tiny_windows):
    """The deadline covers the whole stream; the client's default (meant for quick calls) does not apply
    to a generate. The server cancels the generation; its committed tokens stay in the history."""
    cancelled = cancelled_generations(server)
    with Client(server.grpc_address, timeout_s=1e-6) as client:
        session = client.create_session(start := prompt(), timeout_s=BOUND_S)
        generation = session.generate(max_tokens=LONG, ignore_eos=True, timeout_s=0.5)  # unread: it cannot finish
        eventually(lambda: cancelled_generations(server) == cancelled + 1, "the server cancelled the generation")
        with pytest.raises(DeadlineExceededError):
            generation.result()
        assert not session.info(timeout_s=BOUND_S).generating
        history = session_tokens(server, session.id)
        assert history[:len(start)] == start and len(start) < len(history) < len(start) + LONG
        assert len(session.generate(max_tokens=4, ignore_eos=True).result().token_ids) == 4


def test_an_asyncio_generate_past_its_deadline_raises_and_its_generation_is_cancelled(server, tiny_windows):
    cancelled = cancelled_generations(server)

    async def run() -> None:
        async with AsyncClient(server.grpc_address) as client:
            session = await client.create_session(prompt())
            generation = await session.generate(max_tokens=LONG, ignore_eos=True, timeout_s=0.5)
            await asyncio.to_thread(eventually, lambda: cancelled_generations(server) == cancelled + 1,
                                    "the server cancelled the generation")
            with pytest.raises(DeadlineExceededError):
                await generation.result()
            assert not (await session.info()).generating
            assert len((await (await session.generate(max_tokens=4, ignore_eos=True)).result()).token_ids) == 4

    asyncio.run(run())


def test_an_http_client_that_disconnects_cancels_its_generation(server):
    """No deadline header in the OpenAI API: a client bounds a request by leaving, streamed or not."""
    with Client(server.grpc_address) as client:
        for count, body in enumerate(({"stream": True}, {}), start=int(cancelled_generations(server)) + 1):
            sock = sse_request(server, {"max_tokens": LONG, "prompt": prompt(), **body})
            sock.close()
            eventually(lambda count=count: cancelled_generations(server) == count, f"cancelled on disconnect ({body})")
            eventually(lambda: pages_beyond_sessions(client) == 0, "its pages went back")


# A server whose turns take SETTLE_S to end once their generation stopped, as a cancel took on a real model
# (the engine's next step): a call that comes right after a deadline finds the generate still in flight.
SETTLE_S = 0.5
SETTLING = f"""
import sys, time
from kiln.cli import main
from kiln.sessions import SessionStore

real = SessionStore._end_turn
def settling(self, *args):
    time.sleep({SETTLE_S})
    real(self, *args)

SessionStore._end_turn = settling
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def settling(servers_root) -> Iterator[ServerHandle]:
    server = start_server(str(tiny_model_dir(servers_root)), servers_root / "cache", launcher=("-c", SETTLING),
                          vocab_size=TINY_CONFIGS["llama"].vocab_size)
    yield server
    server.stop()


def http_generate(server: ServerHandle, session_id: str, timeout_s: float = BOUND_S, **body: object) -> httpx.Response:
    return httpx.post(f"{server.http_url}/v1/sessions/{session_id}/generate", json={"ignore_eos": True, **body},
                      timeout=timeout_s)


def test_a_generate_right_after_a_deadline_waits_for_the_cancel_and_succeeds(settling):
    """Issue 37: after DeadlineExceededError the session's next generate used to be refused (in flight)
    until the server settled the cancel; it now waits for it. Over gRPC (the SDK's timeout_s) and HTTP
    (a client that gives up)."""
    with Client(settling.grpc_address) as client:
        session = client.create_session(start := prompt())
        with pytest.raises(DeadlineExceededError):
            session.generate(max_tokens=LONG, ignore_eos=True, timeout_s=0.3).result()
        turn = session.generate(max_tokens=4, ignore_eos=True).result().token_ids  # at once
        history = session_tokens(settling, session.id)
        assert len(turn) == 4 and history[:len(start)] == start and history[-4:] == turn

        session = client.create_session(prompt())  # a session of its own: room in the context for LONG more
        with pytest.raises(httpx.ReadTimeout):
            http_generate(settling, session.id, timeout_s=0.3, max_tokens=LONG)
        reply = http_generate(settling, session.id, max_tokens=4)
        assert reply.status_code == 200, reply.text
        assert session_tokens(settling, session.id)[-4:] == reply.json()["token_ids"]


def test_two_concurrent_generates_on_one_session_both_complete_in_order(settling):
    with Client(settling.grpc_address) as client, ThreadPoolExecutor(1) as pool:
        session = client.create_session(start := prompt())
        first = session.generate(max_tokens=6, ignore_eos=True)  # accepted: in flight
        second = pool.submit(lambda: http_generate(settling, session.id, max_tokens=5))
        ran = first.result().token_ids
        reply = second.result(timeout=BOUND_S)
        assert reply.status_code == 200, reply.text
        assert session_tokens(settling, session.id) == start + ran + reply.json()["token_ids"]


def test_a_generate_waiting_past_its_deadline_gets_the_typed_error_and_the_session_goes_on(settling, tiny_windows):
    """Behind a live generate a later one waits its turn until its caller's deadline: DeadlineExceededError
    over gRPC; an HTTP client that gives up leaves the queue (its generate never runs)."""
    with Client(settling.grpc_address) as client:
        session = client.create_session(start := prompt())
        running = session.generate(max_tokens=LONG, ignore_eos=True)  # unread: paused, never finishes
        with pytest.raises(DeadlineExceededError):
            session.generate(max_tokens=2, timeout_s=0.3)
        with pytest.raises(httpx.ReadTimeout):
            http_generate(settling, session.id, timeout_s=0.3, max_tokens=2)
        running.cancel()
        ran = session_tokens(settling, session.id)[len(start):]
        turn = session.generate(max_tokens=3, ignore_eos=True).result().token_ids
        assert session_tokens(settling, session.id) == start + ran + turn  # neither waiter ran


def test_calls_over_max_concurrent_rpcs_are_resource_exhausted(limited):
    with Client(limited.grpc_address) as client, grpc.insecure_channel(limited.grpc_address, options=TINY_WINDOW) as held:
        sessions = [client.create_session(prompt()) for _ in range(3)]
        calls = [raw_generate(held, session.id) for session in sessions]  # 3 calls in flight, none read
        eventually(lambda: sample(limited, "kiln_generations_paused") == 3, "the three generations are paused")
        with pytest.raises(ResourceExhaustedError):
            client.health()
        calls[0].cancel()
        eventually(lambda: answers(client), "a slot is free again")
        for call in calls[1:]:
            call.cancel()


def answers(client: Client) -> bool:
    try:
        client.health()
    except ResourceExhaustedError:
        return False
    return True


def sse_request(server: ServerHandle, body: dict, path: str = "/v1/completions", receive_buffer: int = 4096) -> socket.socket:
    """A completion request on a raw socket with a small receive buffer, whose reply nobody reads."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect(("127.0.0.1", int(server.http_url.rsplit(":", 1)[1])))
    payload = json.dumps({"model": "kiln", "temperature": 0.0, "ignore_eos": True, **body}).encode()
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(payload), payload))
    return sock


@pytest.mark.parametrize(("flags", "fault"), [
    (("--stall-timeout-s", "0"), "stall_timeout_s must be a positive number of seconds"),
    (("--stall-timeout-s", "nan"), "stall_timeout_s must be a positive number of seconds"),
    (("--max-concurrent-rpcs", "-1"), "max_concurrent_rpcs must be 0 (no limit) or more"),
    (("--generate-wait-s", "0"), "generate_wait_s must be a positive number of seconds"),
])
def test_bad_limits_stop_kiln_serve_with_status_2(capsys, flags, fault):
    assert main(["serve", "--no-persist", *flags]) == 2  # before any model loads
    assert fault in capsys.readouterr().err
