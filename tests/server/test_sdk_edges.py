"""The SDK at its edges, against a real `kiln serve`: NumPy token ids, arguments of the wrong type, bad API
keys and a closed client all give typed errors of kiln.errors, never grpc's or protobuf's own."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kiln.client import AsyncClient, Client, FailedPreconditionError, InvalidArgumentError


@pytest.fixture
def client(tiny_server):
    with Client(tiny_server.grpc_address, tokenizer="server") as client:
        yield client


def test_numpy_token_ids_are_accepted(client):
    session = client.create_session(np.array([1, 2, 3]))
    assert session.append(np.array([4, 5], dtype=np.int32)).history_tokens == 5
    assert session.append([np.int64(6)]).history_tokens == 6
    assert client.detokenize(np.array(client.tokenize("hé"))) == "hé"
    assert client.create_session(np.array([], dtype=np.int64)).info().history_tokens == 0
    assert len(session.generate(2, ignore_eos=True, stop_token_ids=np.array([0])).result().token_ids) == 2


@pytest.mark.parametrize(
    "ids",
    [[1.5], np.array([1.0]), [[1, 2]], np.array([[1, 2]]), [np.True_], np.array([True]), "abc", b"ab", 5,
     np.array(3), [None]],
)
def test_anything_but_integers_is_refused_as_token_ids(client, ids):
    session = client.create_session([1])
    for call in (lambda: client.create_session(ids), lambda: session.append(ids), lambda: client.detokenize(ids),
                 lambda: session.generate(2, stop_token_ids=ids)):
        with pytest.raises(InvalidArgumentError, match="token ids must be an iterable of integers"):
            call()


@pytest.mark.parametrize(
    ("options", "named"),
    [({"stop": 5}, "stop"), ({"stop": [1]}, "stop"), ({"stop": b"x"}, "stop"), ({"stop": ["a", None]}, "stop"),
     ({"max_tokens": "3"}, "max_tokens"), ({"max_tokens": 2.0}, "max_tokens"), ({"temperature": "hot"}, "temperature"),
     ({"top_p": "x"}, "top_p"), ({"top_k": 1.5}, "top_k"), ({"seed": "s"}, "seed"), ({"ignore_eos": "yes"}, "ignore_eos")],
)
def test_generate_arguments_of_the_wrong_type_are_invalid_and_named(client, options, named):
    session = client.create_session([1])
    with pytest.raises(InvalidArgumentError, match=named):
        session.generate(**options)
    with pytest.raises(InvalidArgumentError, match=named):
        next(session.generate_text(**options))
    assert not session.info().generating


def test_a_str_stop_is_one_stop_string(client):
    session = client.create_session([1])
    assert session.generate(3, stop="never", ignore_eos=True).result().usage.generated_tokens == 3


def test_other_methods_refuse_wrong_types_as_invalid_argument(client):
    session = client.create_session([1, 2, 3])
    bad_calls = [
        lambda: session.fork(at="1"),
        lambda: session.fork(at=1.5),
        lambda: client.create_session([1], ttl_s="60"),
        lambda: client.tokenize(5),
        lambda: client.tokenize("x", add_special_tokens="no"),
        lambda: client.detokenize([1], skip_special_tokens="no"),
        lambda: client.get_session(5),
        lambda: session.append_text(5),
    ]
    for call in bad_calls:
        with pytest.raises(InvalidArgumentError):
            call()


@pytest.mark.parametrize("api_key", ["ключ", "two words", "tab\tkey", "new\nline", "", " "])
def test_an_api_key_that_is_not_header_text_is_refused_up_front(tiny_server, api_key):
    with pytest.raises(InvalidArgumentError, match="api_key"):
        Client(tiny_server.grpc_address, api_key=api_key)

    async def construct() -> None:
        AsyncClient(tiny_server.grpc_address, api_key=api_key)

    with pytest.raises(InvalidArgumentError, match="api_key"):
        asyncio.run(construct())


def test_a_closed_client_refuses_every_call(tiny_server):
    client = Client(tiny_server.grpc_address, tokenizer="server")
    session = client.create_session([1, 2, 3])
    running = session.generate(400, ignore_eos=True)
    next(running)
    client.close()
    calls = [
        lambda: client.create_session([1]), lambda: client.get_session(session.id), client.list_sessions,
        lambda: client.tokenize("x"), lambda: client.detokenize([1]), client.health,
        lambda: session.append([1]), lambda: session.append_text("x"), lambda: session.generate(2),
        lambda: next(session.generate_text(2)), session.fork, session.info, session.close, lambda: list(running),
    ]
    for call in calls:
        with pytest.raises(FailedPreconditionError, match="the client is closed"):
            call()
    client.close()  # closing again is fine


def test_a_closed_async_client_refuses_every_call(tiny_server):
    async def flow() -> None:
        client = AsyncClient(tiny_server.grpc_address, tokenizer="server")
        session = await client.create_session([1, 2, 3])
        running = await session.generate(400, ignore_eos=True)
        await running.__anext__()
        await client.close()
        calls = [
            lambda: client.create_session([1]), lambda: client.get_session(session.id), client.list_sessions,
            lambda: client.tokenize("x"), lambda: client.detokenize([1]), client.health,
            lambda: session.append([1]), lambda: session.append_text("x"), lambda: session.generate(2),
            lambda: session.generate_text(2).__anext__(), session.fork, session.info, session.close,
            running.result,
        ]
        for call in calls:
            with pytest.raises(FailedPreconditionError, match="the client is closed"):
                await call()
        await client.close()

    asyncio.run(flow())
