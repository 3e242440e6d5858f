"""What OpenAI clients assume (issue 34 § 4), through the official `openai` package against a real `kiln
serve` on a tiny random model: an omitted temperature samples (OpenAI's 1.0, or the model's
generation_config.json), a field Kiln does not take is ignored and listed in `Kiln-Ignored-Fields` while a
known field's bad value stays a 400, `/health` answers like `/healthz`, every parameter the package's
`create` takes is accepted (or refused on purpose, kiln/server/http_models.py says why), and every
response parses into the package's own types with no field they lack but Kiln's documented extensions."""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from pydantic import BaseModel

from kiln.llm import LLM
from kiln.server.app import ServeOptions, ServingStack
from tests.server.conftest import tiny_model_dir

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
CLIENT_ONLY = {"extra_headers", "extra_query", "extra_body", "timeout"}  # the package's, never sent
IGNORED = "kiln-ignored-fields"
PROBE = "kiln_test_future_field"  # an unknown field no other test sends: its warning is counted

# every parameter of chat.completions.create: a valid value, and the fields it needs beside it
CHAT_VALUES: dict[str, object] = {
    "audio": {"voice": "alloy", "format": "wav"}, "frequency_penalty": 0.5, "logit_bias": {"5": 1},
    "logprobs": True, "max_completion_tokens": 3, "max_tokens": 3, "metadata": {"k": "v"}, "modalities": ["text"],
    "moderation": {"model": "omni-moderation-latest"}, "n": 2, "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "Paris"}, "presence_penalty": 0.5, "prompt_cache_key": "k",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}, "prompt_cache_retention": "24h",
    "reasoning_effort": "low", "response_format": {"type": "json_object"}, "safety_identifier": "someone",
    "seed": 3, "service_tier": "auto", "stop": ["\n\n"], "store": False, "stream": True,
    "stream_options": {"include_usage": True}, "temperature": 0.7, "tool_choice": "auto", "tools": [WEATHER],
    "top_logprobs": 2, "top_p": 0.9, "user": "someone", "verbosity": "low",
    "web_search_options": {"search_context_size": "low"},
}
CHAT_NEEDS = {"stream_options": {"stream": True}, "top_logprobs": {"logprobs": True}, "tool_choice": {"tools": [WEATHER]}}
# accepted and ignored: they describe the caller or a service around the generation, or are hints Kiln does not take
CHAT_IGNORED = {"audio", "metadata", "moderation", "prediction", "prompt_cache_key", "prompt_cache_options",
                "prompt_cache_retention", "reasoning_effort", "safety_identifier", "service_tier", "store", "user",
                "verbosity", "web_search_options"}
# refused, naming the field: ignoring them would hand back something other than what the client reads
CHAT_REFUSED: dict[str, object] = {
    "functions": [WEATHER["function"]], "function_call": "auto", "modalities": ["text", "audio"]}
COMPLETION_VALUES: dict[str, object] = {
    "best_of": 1, "echo": True, "frequency_penalty": 0.5, "logit_bias": {"5": 1}, "logprobs": 2, "max_tokens": 3,
    "n": 2, "presence_penalty": 0.5, "seed": 3, "stop": ["\n\n"], "stream": True,
    "stream_options": {"include_usage": True}, "suffix": "", "temperature": 0.7, "top_p": 0.9, "user": "someone"}
COMPLETION_NEEDS = {"stream_options": {"stream": True}}
COMPLETION_IGNORED = {"user"}
COMPLETION_REFUSED: dict[str, object] = {"best_of": 3, "suffix": " and that was all."}
COMPLETION_ALONE = {"echo"}  # with logprobs: refused (Kiln does not compute the prompt's log-probabilities)
# what Kiln returns beyond the package's types (documented Kiln extensions)
MODEL_FACTS = {"max_model_len", "architecture", "parameters", "weight_type", "context_length", "chat_template",
               "size_bytes"}


@pytest.fixture(scope="module")
def oai(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.http_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(tiny_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_server.http_url, timeout=60) as client:
        yield client


def completion_text(oai: openai.OpenAI, **options: object) -> str:
    reply = oai.completions.create(model="kiln", prompt="Once", max_tokens=12, extra_body={"ignore_eos": True},
                                   **options)
    return reply.choices[0].text


def test_an_omitted_temperature_samples_at_openais_default(oai):
    greedy = completion_text(oai, temperature=0)
    assert completion_text(oai, temperature=0, seed=1) == greedy
    sampled = {seed: completion_text(oai, seed=seed) for seed in range(4)}
    assert len(set(sampled.values())) > 1 and greedy not in sampled.values()
    assert sampled[1] == completion_text(oai, seed=1, temperature=1.0, top_p=1.0)  # exactly OpenAI's defaults
    chats = {oai.chat.completions.create(model="kiln", messages=ASK, max_tokens=12, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].message.content
             for seed in range(4)}
    assert len(chats) > 1


def test_generation_config_temperature_wins_over_openais_default(tmp_path):
    """A model whose generation_config.json asks for temperature 0 is greedy where a request is silent."""
    directory = tiny_model_dir(tmp_path)
    (directory / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_MODELS_DIR", str(directory.parent))
        llm = LLM(directory.name, cache_dir=str(tmp_path / "cache"), kv_budget_bytes=16 * 1024**2)
    with llm, TestClient(ServingStack.build(llm, ServeOptions(env={}, allowed_hosts=("testserver",))).http_app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        texts = {completion_text(client, seed=seed) for seed in range(3)}
        assert texts == {completion_text(client, temperature=0)}


def test_unknown_fields_are_ignored_listed_and_logged_once(oai, tiny_server):
    for _ in range(2):
        raw = oai.chat.completions.with_raw_response.create(
            model="kiln", messages=ASK, max_tokens=2, reasoning_effort="low", extra_body={PROBE: 1})
        assert raw.headers[IGNORED] == f"{PROBE}, reasoning_effort"
        assert raw.parse().choices[0].finish_reason in ("stop", "length")
    streamed = oai.chat.completions.with_raw_response.create(
        model="kiln", messages=ASK, max_tokens=2, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False}, extra_body={"verbosity": "low"})
    assert streamed.headers[IGNORED] == "stream_options.include_obfuscation, verbosity"
    assert [chunk.usage for chunk in streamed.parse()][-1].completion_tokens >= 1
    plain = oai.completions.with_raw_response.create(model="kiln", prompt="Once", max_tokens=2)
    assert IGNORED not in plain.headers
    last = f"{PROBE}_last"  # once its warning is read, any earlier one is too (stderr keeps its order)
    oai.completions.create(model="kiln", prompt="Once", max_tokens=1, extra_body={last: 1})
    deadline = time.monotonic() + 10
    while not any(repr(last) in line for line in tiny_server.log) and time.monotonic() < deadline:
        time.sleep(0.05)  # the server's stderr is read on a thread
    warned = [line for line in tiny_server.log if repr(PROBE) in line]
    assert len(warned) == 1 and "ignoring the request field" in warned[0]


@pytest.mark.parametrize(("fields", "param"), [
    ({"temperature": "hot"}, "temperature"), ({"n": 0}, "n"), ({"top_p": 2}, "top_p"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"bad name!": 1}, None), ({f"field_{i}": 1 for i in range(65)}, None),  # too odd or too many to list
])
def test_a_known_fields_bad_value_is_still_400(oai, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model="kiln", messages=ASK, max_tokens=2, extra_body=fields)
    assert refused.value.param == param and refused.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize("keyed", [False, True])
def test_health_answers_like_healthz_open_to_anyone(tiny_server, auth_server, keyed):
    server = auth_server if keyed else tiny_server
    healthz = httpx.get(server.http_url + "/healthz")
    for headers in ({}, {"Host": "10.1.2.3"}):  # no key; a load balancer probing by IP address
        health = httpx.get(server.http_url + "/health", headers=headers)
        assert health.status_code == healthz.status_code == 200
        assert health.json() == healthz.json() and health.headers["content-type"] == healthz.headers["content-type"]
    assert httpx.head(server.http_url + "/health").status_code == 200
    document = httpx.get(server.http_url + "/openapi.json",
                         headers={"Authorization": f"Bearer {server.api_keys[0]}"} if keyed else {}).json()
    assert {method: operation["security"] for method, operation in document["paths"]["/health"].items()} == {
        "get": [], "head": []}


def create_parameters(create: object) -> set[str]:
    return set(inspect.signature(create).parameters) - CLIENT_ONLY


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_every_parameter_the_package_sends_is_accepted_or_refused_on_purpose(oai, api):
    chat = api == "chat"
    create = oai.chat.completions.with_raw_response.create if chat else oai.completions.with_raw_response.create
    values, needs, ignored, refused, alone = (
        (CHAT_VALUES, CHAT_NEEDS, CHAT_IGNORED, CHAT_REFUSED, set()) if chat else
        (COMPLETION_VALUES, COMPLETION_NEEDS, COMPLETION_IGNORED, COMPLETION_REFUSED, COMPLETION_ALONE))
    base = {"model": "kiln", **({"messages": ASK} if chat else {"prompt": "Once"})}
    unknown = create_parameters(create) - set(base) - set(values) - set(refused)
    assert not unknown, f"parameters the openai package gained: decide what Kiln does with {unknown}"
    for name, value in values.items():
        raw = create(**{"max_tokens": 3, **base, **needs.get(name, {}), name: value})
        listed = set(filter(None, raw.headers.get(IGNORED, "").split(", ")))
        assert raw.status_code == 200 and listed == ({name} & ignored), name
        parsed = raw.parse()
        assert list(parsed) if isinstance(parsed, openai.Stream) else parsed.choices, name
    raw = create(**base, **{name: value for name, value in values.items()
                            if name not in {"stream", "stream_options", *alone}})
    assert raw.status_code == 200 and set(raw.headers[IGNORED].split(", ")) == ignored
    nulls = create(**base, **{name: None for name in values if name not in ("stream", "max_tokens")}, max_tokens=3)
    assert nulls.status_code == 200 and IGNORED not in nulls.headers  # null: the field is left out
    for name, value in refused.items():
        with pytest.raises(openai.BadRequestError) as error:
            create(**base, max_tokens=3, **{name: value})
        assert error.value.param == name, name


def extensions(value: object, path: str = "") -> set[str]:
    """The dotted paths of the fields a parsed response carries that its openai type does not define."""
    if isinstance(value, list):
        return set().union(*(extensions(item, path) for item in value))
    if not isinstance(value, BaseModel):
        return set()
    found = {path + name for name in value.model_extra or {}}
    for name in type(value).model_fields:
        found |= extensions(getattr(value, name), f"{path}{name}.")
    return found


def events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as reply:
        assert reply.status_code == 200
        data = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(item) for item in data[:-1]]


def ended(chunk: dict) -> dict:
    """A streamed completion chunk as the package's Completion type takes it: OpenAI too streams
    finish_reason null until a choice ends, which that type (shared with whole completions) lacks."""
    return {**chunk, "choices": [{**choice, "finish_reason": choice["finish_reason"] or "length"}
                                 for choice in chunk["choices"]]}


def test_every_response_parses_into_the_packages_types(http):
    tools = {"tools": [WEATHER], "tool_choice": "required", "logprobs": True, "top_logprobs": 2}
    for body in ({"n": 2, "logprobs": True, "top_logprobs": 2}, tools):
        raw = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 150, "temperature": 0, **body}).json()
        reply = ChatCompletion.model_validate(raw, strict=True)
        assert extensions(reply) == set() and reply.usage.prompt_tokens_details.cached_tokens >= 0
        ChatCompletionMessage.model_validate(raw["choices"][0]["message"])
        chunks = [ChatCompletionChunk.model_validate(event, strict=True) for event in
                  events(http, "/v1/chat/completions", {"messages": ASK, "max_tokens": 150, "temperature": 0, **body})]
        assert not set().union(*map(extensions, chunks)) and chunks[-1].usage.total_tokens > 0
    assert reply.choices[0].message.tool_calls and reply.choices[0].finish_reason == "tool_calls"
    body = {"prompt": ["Once", "Twice"], "max_tokens": 4, "n": 2, "logprobs": 2}
    completion = Completion.model_validate(http.post("/v1/completions", json=body).json(), strict=True)
    assert extensions(completion) == set() and len(completion.choices) == 4
    chunks = [Completion.model_validate(ended(event), strict=True) for event in events(http, "/v1/completions", body)]
    assert not set().union(*map(extensions, chunks)) and chunks[-1].usage.total_tokens > 0
    listed = http.get("/v1/models").json()
    models = [Model.model_validate(entry, strict=True) for entry in listed["data"]]
    assert listed["object"] == "list" and models and all(extensions(model) <= MODEL_FACTS for model in models)
    assert extensions(Model.model_validate(http.get(f"/v1/models/{models[0].id}").json())) <= MODEL_FACTS


def test_an_echoed_reply_message_is_accepted(oai):
    """Clients append the reply's message to the conversation, often dumped with every field the type has."""
    reply = oai.chat.completions.create(model="kiln", messages=ASK, max_tokens=3, temperature=0).choices[0].message
    dumped = reply.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(dumped)
    for message in (reply, dumped):
        again = oai.chat.completions.create(model="kiln", messages=[*ASK, message, *ASK], max_tokens=2)
        assert again.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model="kiln", max_tokens=2, messages=[
            *ASK, {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}])
    assert refused.value.param == "messages[1].function_call"
