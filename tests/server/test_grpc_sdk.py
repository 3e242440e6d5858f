"""The gRPC transport and the Python SDK against a real `kiln serve` (tiny llama, byte tokenizer): session
flows (sync and asyncio), streaming and cancellation, isolation between API keys, typed errors."""

from __future__ import annotations

import asyncio
import inspect
import random
import re
import threading
import time
import urllib.request
from types import SimpleNamespace

import grpc
import pytest

from kiln.client import (
    AsyncClient,
    CancelledError,
    Client,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    KilnError,
    NotFoundError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from kiln.server.auth import ApiKeys
from kiln.server.grpc import build_grpc_server, token_batches
from kiln.server.metrics import Metrics
from kiln.server.service import GenerateRequest, RuntimeService
from kiln.v1 import rpc
from kiln.v1 import runtime_pb2 as pb
from tests.conftest import byte_tokenizer
from tests.server.conftest import free_port, held_until_released

LONG = 400  # max_tokens of a generation that is still running when a test interrupts it
BUSY = 960  # max_tokens of one that outlasts a waiter's deadline (the tiny model's context is 1024)


_draw = random.Random(0)


def history(length: int = 40) -> list[int]:
    """A history no earlier test used, so the server's prefix cache holds none of it (40 tokens: two
    full 16-token pages)."""
    return [_draw.randrange(3, 256) for _ in range(length)]


@pytest.fixture
def client(tiny_server):
    with Client(tiny_server.grpc_address, tokenizer="server") as client:
        yield client


@pytest.fixture
def inprocess(tiny_llm):
    """A gRPC server in this process (its own event loop thread) over a service the test can reach into."""
    llm = tiny_llm("llama")
    service, metrics = RuntimeService(llm, "tiny"), Metrics(llm)
    address = f"127.0.0.1:{free_port()}"
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(work):  # noqa: ANN001, ANN202 - calls work() on the server's loop, awaiting what it returns
        async def run():  # noqa: ANN202
            result = work()
            return await result if inspect.isawaitable(result) else result

        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=30)

    server = on_loop(lambda: build_grpc_server(service, ApiKeys(), metrics, address))
    on_loop(server.start)
    yield SimpleNamespace(address=address, service=service, metrics=metrics, on_loop=on_loop)
    on_loop(lambda: server.stop(None))
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


def metric(server, route: str, status: str) -> float:
    """kiln_requests_total{route, status} from the server's /metrics (0 when never observed)."""
    return metric_in(urllib.request.urlopen(f"{server.http_url}/metrics", timeout=10).read().decode(), route, status)


def metric_in(text: str, route: str, status: str) -> float:
    found = re.search(rf'^kiln_requests_total\{{route="{re.escape(route)}",status="{status}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_turns_prefill_only_new_tokens_and_fork_info_list_reattach(tiny_server, client):
    start = history()
    session = client.create_session(start)
    first = session.generate(6, ignore_eos=True)
    tokens = list(first)
    assert len(tokens) == 6 and first.finish_reason == "length"
    assert first.usage.prompt_tokens == 40 and first.usage.prefilled_tokens == 40 and first.usage.reused_tokens == 0

    info = session.append([7, 8, 9])
    assert info.history_tokens == 40 + 6 + 3 and not info.generating
    second = session.generate(5, ignore_eos=True).result()
    # only the 3 appended tokens and the last generated one (never computed yet) are prefilled
    assert second.usage.prefilled_tokens == 4 and second.usage.reused_tokens == 40 + 6 - 1
    assert session.info().last_prefill_tokens == 4 and session.info().history_tokens == 54

    # the whole history in a fresh session continues the same way (greedy)
    fresh = client.create_session(start + tokens + [7, 8, 9])
    assert fresh.generate(5, ignore_eos=True).result().token_ids == second.token_ids

    child = session.fork()
    assert child.id != session.id and child.info().history_tokens == 54
    shared = child.generate(2, ignore_eos=True).result().usage
    assert shared.reused_tokens >= 48 and shared.prefilled_tokens <= 6  # the fork reused the parent's pages
    assert session.fork(at=10).info().history_tokens == 10

    with Client(tiny_server.grpc_address) as restarted:
        again = restarted.get_session(session.id)
        assert again.info().history_tokens == 54
        listed = {info.session_id for info in restarted.list_sessions()}
        assert {session.id, child.id, fresh.id} <= listed


def test_async_client_has_the_same_flows(tiny_server):
    async def flow() -> None:
        async with AsyncClient(tiny_server.grpc_address, tokenizer="server") as client:
            session = await client.create_session(history())
            generation = await session.generate(4, ignore_eos=True, logprobs=True)
            tokens = [token async for token in generation]
            assert len(tokens) == 4 and len(generation.logprobs) == 4
            assert generation.usage.prefilled_tokens == 40
            await session.append([1, 2])
            assert (await (await session.generate(3, ignore_eos=True)).result()).usage.prefilled_tokens == 3
            child = await session.fork(at=20)
            assert (await child.info()).history_tokens == 20
            assert {session.id, child.id} <= {info.session_id for info in await client.list_sessions()}
            assert (await (await client.get_session(session.id)).info()).history_tokens == 40 + 4 + 2 + 3
            assert await client.detokenize(await client.tokenize("héllo")) == "héllo"
            assert (await client.health()).vocab_size == tiny_server.vocab_size

            running = await session.generate(BUSY, ignore_eos=True)
            await running.__anext__()
            with pytest.raises(DeadlineExceededError):  # waits its turn, here past its deadline
                await session.generate(2, timeout_s=0.1)
            assert (await session.info()).generating
            await running.cancel()
            assert running.finish_reason == "cancelled" and not (await session.info()).generating
            pieces = [piece async for piece in session.generate_text(3, ignore_eos=True)]
            assert pieces and all("\ufffd" not in piece[-1:] for piece in pieces[:-1])
            async with child:
                pass
            with pytest.raises(NotFoundError):
                await child.info()

    asyncio.run(flow())


def test_tokenize_detokenize_health(tiny_server, client):
    ids = client.tokenize("héllo ✓")
    assert len(ids) == len("héllo ✓".encode())  # the byte tokenizer: one id per UTF-8 byte
    assert client.detokenize(ids) == "héllo ✓"
    health = client.health()
    assert health.status == "serving" and health.vocab_size == tiny_server.vocab_size
    assert health.max_model_len > 0 and health.kv_pages_free > 0


def test_text_helpers_need_an_opted_in_tokenizer_and_agree_across_tokenizers(tiny_server):
    with Client(tiny_server.grpc_address) as ids_only:
        session = ids_only.create_session([5, 6])
        with pytest.raises(FailedPreconditionError, match="needs a tokenizer"):
            session.append_text("hi")
        with pytest.raises(FailedPreconditionError, match="needs a tokenizer"):
            next(session.generate_text(2))
    replies = []
    for tokenizer in ("server", byte_tokenizer()):
        with Client(tiny_server.grpc_address, tokenizer=tokenizer) as client:
            session = client.create_session()
            assert session.append_text("Grüße, ").history_tokens == len("Grüße, ".encode())
            pieces = list(session.generate_text(24, ignore_eos=True))
            generated = session.info().history_tokens - len("Grüße, ".encode())
            assert generated == 24
            replies.append("".join(pieces))
    assert replies[0] == replies[1]


def test_streamed_chunks_carry_every_token_and_its_logprob(client):
    session = client.create_session(history())
    generation = session.generate(12, ignore_eos=True, logprobs=True)
    chunks = list(generation.chunks())
    assert [t for chunk in chunks for t in chunk] == generation.token_ids and len(generation.token_ids) == 12
    assert len(generation.logprobs) == 12 and all(lp <= 0 for lp in generation.logprobs)
    assert generation.result().usage.generated_tokens == 12


def test_cancel_frees_the_session_for_the_next_generate(tiny_server, client):
    session = client.create_session(history())
    cancelled_before = metric(tiny_server, "grpc/Generate", "CANCELLED")
    generation = session.generate(LONG, ignore_eos=True)
    received = [next(generation), next(generation)]
    generation.cancel()
    assert generation.finish_reason == "cancelled" and generation.usage is None
    assert generation.token_ids[:2] == received and list(generation) == generation.token_ids[2:]
    with pytest.raises(CancelledError):
        generation.result()
    info = session.info()
    assert not info.generating and 42 <= info.history_tokens < 40 + LONG
    assert session.generate(3, ignore_eos=True).result().usage.generated_tokens == 3

    with session.generate(LONG, ignore_eos=True) as interrupted:  # leaving the block cancels
        next(interrupted)
    assert not session.info().generating
    assert metric(tiny_server, "grpc/Generate", "CANCELLED") >= cancelled_before + 2


def test_one_generate_at_a_time_per_session(client):
    session = client.create_session(history())
    running = session.generate(BUSY, ignore_eos=True)
    next(running)
    with pytest.raises(DeadlineExceededError):  # waits its turn, here past its deadline
        session.generate(2, timeout_s=0.1)
    assert session.info().generating
    with pytest.raises(FailedPreconditionError, match="in flight"):
        session.append([1])
    other = client.create_session(history())  # other sessions are unaffected
    assert other.generate(2, ignore_eos=True).result().usage.generated_tokens == 2
    running.cancel()


def test_sessions_are_invisible_to_other_keys(auth_server):
    with Client(auth_server.grpc_address, api_key="key-a") as a, Client(auth_server.grpc_address, api_key="key-b") as b:
        mine = a.create_session([1, 2, 3])
        theirs = b.create_session([4, 5])
        missing = "x" * 22
        with pytest.raises(NotFoundError) as foreign:
            b.get_session(mine.id)
        with pytest.raises(NotFoundError) as unknown:
            b.get_session(missing)
        assert str(foreign.value).replace(mine.id, missing) == str(unknown.value)
        handle = type(mine)(b, mine.id)  # key b holding key a's id
        for call in (handle.info, lambda: handle.append([1]), lambda: handle.generate(2), handle.fork, handle.close):
            with pytest.raises(NotFoundError):
                call()
        assert mine.id in {s.session_id for s in a.list_sessions()}
        assert {s.session_id for s in b.list_sessions()} == {theirs.id}
        assert mine.info().history_tokens == 3  # untouched by b's attempts


@pytest.mark.parametrize("api_key", [None, "wrong-key"])
def test_missing_or_unknown_key_is_unauthenticated(auth_server, api_key):
    with Client(auth_server.grpc_address, api_key=api_key) as client:
        with pytest.raises(UnauthenticatedError):
            client.health()
        with pytest.raises(UnauthenticatedError):
            client.create_session([1])


def test_closed_session_is_not_found(client):
    session = client.create_session([1, 2, 3])
    session.close()
    for call in (session.info, lambda: session.append([4]), lambda: session.generate(2), session.fork, session.close):
        with pytest.raises(NotFoundError, match="closed"):
            call()
    with pytest.raises(NotFoundError):
        client.get_session(session.id)
    with client.create_session([1]) as scoped:
        scoped.close()  # leaving the block after an explicit close is fine
    with pytest.raises(NotFoundError):
        scoped.info()


def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(tiny_server, client):
    vocab = tiny_server.vocab_size
    session = client.create_session([1, 2, 3])
    bad_calls = [
        lambda: client.create_session([vocab]),
        lambda: client.create_session([-1]),
        lambda: client.create_session([1], ttl_s=0),
        lambda: client.create_session([1], ttl_s=1e-300),  # would expire before the reply
        lambda: client.create_session([1], ttl_s=1e12),
        lambda: client.create_session([True]),
        lambda: session.append([1, vocab + 5]),
        lambda: session.append([]),
        lambda: client.detokenize([vocab]),
        lambda: session.generate(0),
        lambda: session.generate(-5),
        lambda: session.generate(10**6),
        lambda: session.generate(2**40),  # beyond int32: refused before any call
        lambda: session.generate(4, temperature=-1),
        lambda: session.generate(4, top_p=2.0),
        lambda: session.generate(4, top_k=-1),
        lambda: session.generate(4, stop_token_ids=[vocab]),
        lambda: session.generate(4, stop=["x" * 1000]),
        lambda: session.fork(at=-1),
        lambda: session.fork(at=4),
        lambda: client.get_session(""),
        lambda: client.get_session("x" * 1000),
    ]
    for call in bad_calls:
        with pytest.raises(InvalidArgumentError):
            call()
    assert session.info().history_tokens == 3  # nothing was half-applied
    assert session.generate(2, ignore_eos=True).result().usage.generated_tokens == 2
    assert metric(tiny_server, "grpc/CreateSession", "INVALID_ARGUMENT") >= 4


def test_an_oversized_message_is_resource_exhausted_and_loses_nothing(tiny_server, client):
    """gRPC refuses a message over the server's limit (4 MiB by default) before Kiln reads it."""
    session = client.create_session([1, 2, 3])
    with pytest.raises(ResourceExhaustedError, match="larger than max"):
        session.append([tiny_server.vocab_size - 1] * 2_500_000)  # 2-byte varints (ids >= 128): 5 MB
    assert session.info().history_tokens == 3


def test_token_batches_group_what_arrived_while_the_consumer_was_busy(tiny_llm):
    async def consume() -> None:
        service = RuntimeService(tiny_llm("llama"), "tiny")
        session = service.create_session(None, history())
        stream = await service.generate(None, session.session_id, GenerateRequest(max_tokens=16, ignore_eos=True, logprobs=True))
        batches = []
        async for ids, logprobs in token_batches(stream):
            assert len(ids) == len(logprobs) >= 1
            batches.append(ids)
            await asyncio.sleep(0.05)  # a slow client: tokens pile up meanwhile
        result = await stream.result()
        assert [t for ids in batches for t in ids] == result.token_ids and len(result.token_ids) == 16
        assert len(batches) < 16

    asyncio.run(consume())


def test_unexpected_errors_are_internal_and_logged_and_shutdown_is_unavailable(inprocess, monkeypatch, caplog):
    def broken(owner):  # noqa: ANN001, ANN202
        raise ZeroDivisionError("secret internals")

    monkeypatch.setattr(inprocess.service, "list_sessions", broken)
    with Client(inprocess.address) as client:
        with pytest.raises(KilnError) as error:
            client.list_sessions()
        assert error.value.code == "INTERNAL" and "secret internals" not in str(error.value)
        assert "gRPC ListSessions failed" in caplog.text and "secret internals" in caplog.text
        assert client.create_session([1]).info().history_tokens == 1  # everyone else is still served

        inprocess.service.stop_admitting()
        with pytest.raises(UnavailableError, match="shutting down"):
            client.create_session([1])
        assert client.health().status == "shutting_down"
    rendered = inprocess.metrics.render().decode()
    assert metric_in(rendered, "grpc/ListSessions", "INTERNAL") == 1
    assert metric_in(rendered, "grpc/CreateSession", "UNAVAILABLE") == 1


def test_a_second_server_cannot_take_a_bound_port(inprocess):
    with pytest.raises(RuntimeError, match="bind"):
        inprocess.on_loop(lambda: build_grpc_server(inprocess.service, ApiKeys(), inprocess.metrics, inprocess.address))


def test_unreachable_server_is_unavailable():
    with Client(f"127.0.0.1:{free_port()}") as client, pytest.raises(UnavailableError):
        client.health()


def test_a_long_unary_call_leaves_the_loop_serving_everyone_else(inprocess, monkeypatch):
    entered, release = held_until_released(monkeypatch, inprocess.service, "tokenize")
    text = "héllo wörld " * 250_000  # 3.5 MB, under the 4 MiB message limit
    with grpc.insecure_channel(inprocess.address) as channel:
        stub = rpc.stub(channel)
        tokenize = stub.Tokenize.future(pb.TokenizeRequest(text=text), timeout=60)
        try:
            assert entered.wait(timeout=30)
            health = stub.Health(pb.HealthRequest(), timeout=30)
            answered_meanwhile = not tokenize.done()
        finally:
            release.set()
        assert answered_meanwhile and health.status == pb.SERVING_STATUS_SERVING
        assert len(tokenize.result().token_ids) == len(text.encode())


def test_malformed_request_bytes_are_invalid_argument_after_authentication(auth_server):
    """Raw bytes that are no request of the method (invalid UTF-8 in a string, a truncated field,
    garbage) are the caller's error, counted like any other, and only once the caller is known."""
    key = (("authorization", "Bearer key-a"),)
    calls = [("Tokenize", b"\x0a\x02\xff\xfe", False), ("Health", b"\xff\xff\xff\xff", False),
             ("CreateSession", bytes(range(256)), False), ("Generate", b"\x0a\x10abc", True)]
    before = {method: metric(auth_server, f"grpc/{method}", "INVALID_ARGUMENT") for method, _, _ in calls}
    with grpc.insecure_channel(auth_server.grpc_address) as channel:
        for method, payload, streaming in calls:
            path = f"/kiln.v1.Runtime/{method}"
            call = channel.unary_stream(path) if streaming else channel.unary_unary(path)  # bytes in, bytes out
            for metadata, code in ((None, grpc.StatusCode.UNAUTHENTICATED), (key, grpc.StatusCode.INVALID_ARGUMENT)):
                with pytest.raises(grpc.RpcError) as error:
                    reply = call(payload, metadata=metadata, timeout=30)
                    if streaming:
                        next(reply)
                assert error.value.code() == code, (method, error.value.details())
            assert error.value.details() == "malformed request message"
    for method, _, _ in calls:
        assert metric(auth_server, f"grpc/{method}", "INVALID_ARGUMENT") == before[method] + 1


def test_a_passed_deadline_is_counted_as_deadline_exceeded_and_a_cancel_as_cancelled(inprocess, monkeypatch):
    entered, release = held_until_released(monkeypatch, inprocess.service, "list_sessions")
    route = "grpc/ListSessions"
    with grpc.insecure_channel(inprocess.address) as channel:
        list_sessions = rpc.stub(channel).ListSessions
        with pytest.raises(grpc.RpcError) as late:
            list_sessions(pb.ListSessionsRequest(), timeout=0.2)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and entered.is_set()
        assert metric_in(counted(inprocess.metrics, route, "DEADLINE_EXCEEDED"), route, "CANCELLED") == 0
        entered.clear()
        cancelled = list_sessions.future(pb.ListSessionsRequest(), timeout=60)
        assert entered.wait(timeout=30)
        cancelled.cancel()
        try:
            rendered = counted(inprocess.metrics, route, "CANCELLED")
        finally:
            release.set()
    assert metric_in(rendered, route, "DEADLINE_EXCEEDED") == 1 and metric_in(rendered, route, "CANCELLED") == 1


def counted(metrics: Metrics, route: str, status: str) -> str:
    """The rendered metrics once `route` has a `status` sample: a call that ends while its handler
    still runs is counted when the server notices, soon after the client gave up."""
    for _ in range(300):
        rendered = metrics.render().decode()
        if metric_in(rendered, route, status):
            return rendered
        time.sleep(0.01)
    raise AssertionError(f"{route} never counted {status}:\n{rendered}")


def test_a_session_gets_its_own_kv_policy_over_grpc(client):
    session = client.create_session(history(100), kv_policy="sink_window", kv_sink_tokens=16, kv_window_tokens=32)
    "".join(session.generate_text(max_tokens=2))
    info = session.info()
    assert (info.kv_policy, info.kv_sink_tokens, info.kv_window_tokens) == ("sink_window", 16, 32)
    assert info.resident_pages < 100 // 16
    assert (info.forgotten_tokens, info.invariant_violations) == (48, 0)  # pages 1-3 of 101 computed positions
    with pytest.raises(InvalidArgumentError, match="kv_policy"):
        client.create_session([5], kv_policy="lru")
    with pytest.raises(InvalidArgumentError, match="kv_sink_tokens"):
        client.create_session([5], kv_sink_tokens=-1)


def test_a_generate_cancelled_while_its_submission_waits_never_runs_on(inprocess, monkeypatch):
    """The call is cancelled while the submission (on a worker thread) still waits, e.g. for the
    store lock or its session's turn: it gives up without submitting, and the session is free."""
    service = inprocess.service
    session = service.create_session(None, history())
    submit, streams = service.sessions.generate, []
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()

    def waiting_submit(session_id, params, owner, stream, *args, **options):  # noqa: ANN001, ANN002, ANN003, ANN202
        streams.append(stream)
        entered.set()
        assert release.wait(30)
        try:
            return submit(session_id, params, owner, stream, *args, **options)
        finally:
            returned.set()

    monkeypatch.setattr(service.sessions, "generate", waiting_submit)
    with grpc.insecure_channel(inprocess.address) as channel:
        message = pb.GenerateRequest(session_id=session.session_id, max_tokens=LONG, ignore_eos=True)
        call = rpc.stub(channel).Generate(message, timeout=60)
        try:
            assert entered.wait(30)
            call.cancel()
            counted(inprocess.metrics, "grpc/Generate", "CANCELLED")  # the server saw the cancel
        finally:
            release.set()
        assert returned.wait(30)
    assert streams[0].cancel_requested and streams[0].request is None  # it never reached the engine
    info = service.info(None, session.session_id)
    assert not info.generating and info.history_tokens == 40
    assert sum(service.llm.engine.stats.requests_by_outcome.values()) == 0


def test_grpc_health_reports_a_dead_engine(inprocess, monkeypatch):
    llm = inprocess.service.llm
    session = inprocess.service.create_session(None, history())

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("a bug in the step and in its error handler")

    monkeypatch.setattr(llm.engine, "step", broken)  # a step fails, and so does failing its requests
    monkeypatch.setattr(llm.engine, "_fail", broken)
    with grpc.insecure_channel(inprocess.address) as channel:
        stub = rpc.stub(channel)
        with pytest.raises(grpc.RpcError) as failed:
            list(stub.Generate(pb.GenerateRequest(session_id=session.session_id, max_tokens=4), timeout=30))
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert stub.Health(pb.HealthRequest(), timeout=30).status == pb.SERVING_STATUS_ENGINE_FAILED
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(pb.GenerateRequest(session_id=session.session_id, max_tokens=4), timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
