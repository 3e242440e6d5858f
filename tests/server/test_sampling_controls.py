"""repetition_penalty, presence_penalty, frequency_penalty and min_p over every transport of a real
`kiln serve` (tiny llama, byte tokenizer): gRPC through both Python SDKs, REST sessions, the OpenAI API
(penalties as OpenAI names them, repetition_penalty and min_p as vLLM's extra fields). Each reaches the
engine (the same greedy tokens everywhere, not the unpenalised ones), and an out-of-range value is
INVALID_ARGUMENT / 400 naming its field; the OpenAPI document states the ranges."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from kiln.client import AsyncClient, Client, InvalidArgumentError

PROMPT = [34, 155, 11, 178, 80, 161, 46, 240]
CONTROLS = {"repetition_penalty": 1.8, "presence_penalty": 1.5, "frequency_penalty": 0.7, "min_p": 0.2}
REPLY = {"max_tokens": 12, "ignore_eos": True}
OUT_OF_RANGE = [
    ("repetition_penalty", 0.0), ("repetition_penalty", 101.0), ("presence_penalty", 2.5),
    ("frequency_penalty", -2.01), ("min_p", 1.5),
]


@pytest.fixture(scope="module")
def client(tiny_server) -> Iterator[Client]:
    with Client(tiny_server.grpc_address) as client:
        yield client


@pytest.fixture(scope="module")
def http(tiny_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_server.http_url, timeout=60.0) as http:
        yield http


@pytest.fixture(scope="module")
def oai(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.http_url + "/v1", api_key="unused", max_retries=0)


def grpc_reply(client: Client, **options: float) -> list[int]:
    with client.create_session(PROMPT) as session:
        return session.generate(**REPLY, **options).result().token_ids


def test_every_transport_applies_the_controls(tiny_server, client, http, oai) -> None:
    penalised = grpc_reply(client, **CONTROLS)
    assert penalised != grpc_reply(client)

    async def aio_reply() -> list[int]:
        async with AsyncClient(tiny_server.grpc_address) as aio:
            session = await aio.create_session(PROMPT)
            return (await (await session.generate(**REPLY, **CONTROLS)).result()).token_ids

    assert asyncio.run(aio_reply()) == penalised
    session = http.post("/v1/sessions", json={"token_ids": PROMPT}).json()["session_id"]
    rest = http.post(f"/v1/sessions/{session}/generate", json={**REPLY, **CONTROLS})
    assert rest.status_code == 200, rest.text
    assert rest.json()["token_ids"] == penalised
    completion = oai.completions.create(  # greedy, as the other transports are by default
        model="kiln", prompt=PROMPT, max_tokens=REPLY["max_tokens"], temperature=0,
        presence_penalty=CONTROLS["presence_penalty"], frequency_penalty=CONTROLS["frequency_penalty"],
        extra_body={"ignore_eos": True, "repetition_penalty": CONTROLS["repetition_penalty"], "min_p": CONTROLS["min_p"]})
    assert completion.choices[0].text == http.post("/v1/detokenize", json={"token_ids": penalised}).json()["text"]
    chat = oai.chat.completions.create(model="kiln", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       presence_penalty=-2, frequency_penalty=2, extra_body={"min_p": 1.0})
    assert chat.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE)
def test_out_of_range_is_refused_naming_the_field_everywhere(tiny_server, client, http, field: str, value: float) -> None:
    with client.create_session([1, 2, 3]) as session, pytest.raises(InvalidArgumentError, match=field):
        session.generate(4, **{field: value})
    session = http.post("/v1/sessions", json={"token_ids": [1, 2, 3]}).json()["session_id"]
    for path, body in ((f"/v1/sessions/{session}/generate", {}), ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        reply = http.post(path, json={**body, "max_tokens": 2, field: value})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["code"] == "INVALID_ARGUMENT" and reply.json()["error"]["param"] == field


def test_async_sdk_refuses_out_of_range_naming_the_field(tiny_server) -> None:
    async def refused() -> None:
        async with AsyncClient(tiny_server.grpc_address) as aio:
            session = await aio.create_session([1, 2, 3])
            with pytest.raises(InvalidArgumentError, match="min_p"):
                await session.generate(4, min_p=-0.5)

    asyncio.run(refused())


def test_openai_temperature_is_openais_range_and_kilns_own_api_keeps_its_own(http) -> None:
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        refused = http.post(path, json={**body, "max_tokens": 2, "temperature": 5})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "temperature", refused.text
        assert http.post(path, json={**body, "max_tokens": 2, "temperature": 2}).status_code == 200
    session = http.post("/v1/sessions", json={"token_ids": [1, 2, 3]}).json()["session_id"]
    assert http.post(f"/v1/sessions/{session}/generate", json={"max_tokens": 2, "temperature": 5}).status_code == 200


def test_openapi_document_states_the_ranges(http) -> None:
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    for body in ("CompletionBody", "ChatBody", "SessionGenerateBody"):
        fields = schemas[body]["properties"]
        assert fields["repetition_penalty"]["exclusiveMinimum"] == 0 and fields["repetition_penalty"]["maximum"] == 100
        assert fields["min_p"]["minimum"] == 0 and fields["min_p"]["maximum"] == 1
        for name in ("presence_penalty", "frequency_penalty"):
            assert (fields[name]["minimum"], fields[name]["maximum"]) == (-2, 2)
    assert schemas["CompletionBody"]["properties"]["temperature"]["maximum"] == 2
    assert schemas["SessionGenerateBody"]["properties"]["temperature"]["maximum"] == 100
