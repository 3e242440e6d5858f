"""The OpenAI surface agent frameworks use, through the official `openai` client against a real `kiln
serve` on a tiny random model: structured output and tool calls enforced by the grammar (whole and
streamed, checked against the client's own types), n, top logprobs, echo, logit_bias, model ids and
the error envelope's details."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall
from prometheus_client.parser import text_string_to_metric_families

from kiln.server.auth import ApiKeys
from kiln.server.http import build_http_app
from kiln.server.metrics import Metrics
from kiln.server.service import RuntimeService

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {},
                                                                        "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def oai(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.http_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.http_url, timeout=60) as client:
        yield client


def test_json_schema_response_format_parses_and_validates(oai):
    reply = oai.chat.completions.create(
        model="kiln", messages=ASK, max_tokens=120, temperature=1.0, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    text = oai.chat.completions.create(model="kiln", messages=ASK, max_tokens=4, response_format={"type": "text"})
    assert text.choices[0].message.content is not None


def test_a_required_tool_call_comes_back_as_tool_calls_whole_and_streamed(oai):
    options = {"model": "kiln", "messages": ASK, "max_tokens": 120, "tools": [WEATHER, PING],
               "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}  # the same call twice
    whole = oai.chat.completions.create(**options)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    else:
        assert call.function.name == "ping" and arguments == {}

    chunks = list(oai.chat.completions.create(**options, stream=True))
    assert all(isinstance(chunk, ChatCompletionChunk) for chunk in chunks)
    deltas = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or ()]
    assert all(isinstance(delta, ChoiceDeltaToolCall) and delta.index == 0 for delta in deltas)
    assert deltas[0].id and deltas[0].function.name == call.function.name and deltas[0].type == "function"
    assert all(delta.id is None and delta.function.name is None for delta in deltas[1:])
    assert "".join(delta.function.arguments for delta in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    state = ChatCompletionStreamState()  # the client's own accumulator agrees with the whole reply
    for chunk in chunks:
        state.handle_chunk(chunk)
    assert state.get_final_completion().choices[0].message.tool_calls[0].function.arguments == call.function.arguments


NO_EOS = {"2": -100}  # the tiny models' EOS (tests/tiny_models.py): after a call only another call may follow


def test_one_required_call_ends_the_generation_and_the_reply_is_tool_calls(oai):
    """A new user's single required call (parallel_tool_calls unset, max_tokens 60) on a model told its
    tools in Kiln's text: the grammar ends after the call, so no second call is generated (the model
    would go on repeating ping's 58-byte call) and the reply is `tool_calls`, not `length`."""
    reply = oai.chat.completions.create(model="kiln", messages=ASK, max_tokens=60, tools=[PING], tool_choice="required",
                                        logit_bias=NO_EOS, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and reply.usage.completion_tokens <= 59  # the call, then EOS
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("ping", "{}")]


def test_a_repeat_cut_by_max_tokens_is_still_a_whole_reply_of_calls(oai):
    """With parallel calls, a repeat still being written when max_tokens ends the generation was never
    shown: the reply is the complete call before it (`tool_calls`)."""
    reply = oai.chat.completions.create(model="kiln", messages=ASK, max_tokens=100, tools=[PING], tool_choice="required",
                                        logit_bias=NO_EOS, parallel_tool_calls=True, temperature=0)
    assert reply.choices[0].finish_reason == "tool_calls" and reply.usage.completion_tokens == 100
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["ping"]


def test_a_repeated_call_ends_the_reply_whole_and_streamed(oai):
    """ping takes no arguments, so a second call can only repeat the first: the reply ends after one
    call (finish_reason tool_calls) instead of repeating it until max_tokens."""
    options = {"model": "kiln", "messages": ASK, "max_tokens": 200, "tools": [PING], "tool_choice": "required",
               "logit_bias": NO_EOS, "parallel_tool_calls": True, "temperature": 0}
    whole = oai.chat.completions.create(**options)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("ping", "{}")]
    assert whole.usage.completion_tokens < 200
    chunks = list(oai.chat.completions.create(**options, stream=True))
    deltas = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or ()]
    assert {delta.index for delta in deltas} == {0} and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks)


@pytest.mark.parametrize("max_tokens", [3, 8, 20, 30, 36, 40])
def test_a_reply_cut_by_max_tokens_puts_no_call_markup_into_content(oai, max_tokens):
    """Cut before, inside or between calls (ping's call is 34 bytes, one token each): the calls written
    so far, and never markup as content, whole or streamed; `length` when the last call shown is cut,
    `tool_calls` when every call shown is whole."""
    options = {"model": "kiln", "messages": ASK, "max_tokens": max_tokens, "tools": [PING, WEATHER],
               "tool_choice": "required", "logit_bias": NO_EOS, "temperature": 1.0, "seed": max_tokens,
               "parallel_tool_calls": True}
    choice = oai.chat.completions.create(**options).choices[0]
    calls = choice.message.tool_calls or ()
    whole = all(_parses(call.function.arguments) for call in calls) and calls
    assert choice.finish_reason == ("tool_calls" if whole else "length") and not choice.message.content
    chunks = list(oai.chat.completions.create(**options, stream=True))
    assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    streamed = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or ()]
    assert [c.function.name for c in choice.message.tool_calls or ()] == [c.function.name for c in streamed if c.id]


def test_a_named_function_is_called_and_parallel_calls_follow_the_schema(oai):
    named = oai.chat.completions.create(model="kiln", messages=ASK, max_tokens=120, tools=[WEATHER, PING],
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    several = oai.chat.completions.create(model="kiln", messages=ASK, max_tokens=200, tools=[PING],
                                          tool_choice="required", temperature=1.0, seed=1, parallel_tool_calls=True)
    assert several.choices[0].finish_reason in ("tool_calls", "length")
    assert all(c.function.name == "ping" for c in several.choices[0].message.tool_calls)


def _parses(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


def token_id(http: httpx.Client, text: str) -> int:
    (token,) = http.post("/v1/tokenize", json={"text": text}).json()["token_ids"]
    return token


def test_auto_is_either_plain_text_or_well_formed_calls(oai, http):
    """The rule for `auto` on a model without a native tool format (kiln/tools.py): a reply that begins
    with <tool_call> is calls and must be well formed; any other reply is plain text."""
    kinds = set()
    for seed in range(6):
        reply = oai.chat.completions.create(model="kiln", messages=ASK, max_tokens=60, tools=[PING], seed=seed,
                                            temperature=1.0, logit_bias={str(token_id(http, "<")): 3.0})
        message = reply.choices[0].message
        if message.tool_calls:
            kinds.add("calls")
            assert message.content is None and all(c.function.name == "ping" for c in message.tool_calls)
        else:
            kinds.add("text")
            assert not message.content.startswith("<tool_call>")
    assert kinds  # which the random model picks is up to it; both shapes are checked above
    none = oai.chat.completions.create(model="kiln", messages=ASK, max_tokens=8, tools=[PING], tool_choice="none")
    assert none.choices[0].message.tool_calls is None


def test_tool_results_and_earlier_calls_render_through_the_chat(oai):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    reply = oai.chat.completions.create(model="kiln", messages=history, max_tokens=4, tools=[WEATHER])
    assert reply.usage.prompt_tokens > len("<tool_response>\n21 degrees\n</tool_response>")


def test_n_choices_share_the_prompt_and_count_it_once(oai):
    prompt = "A prompt long enough to span pages: " + "abcdefgh" * 8
    reply = oai.completions.create(model="kiln", prompt=prompt, max_tokens=5, n=3, temperature=1.0, seed=4,
                                   extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.prompt_tokens == len(prompt.encode()) and reply.usage.completion_tokens == 15
    assert len({c.text for c in reply.choices}) > 1
    chunks = list(oai.chat.completions.create(model="kiln", messages=ASK, max_tokens=3, n=2, stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_top_logprobs_on_chat_and_completions(oai):
    chat = oai.chat.completions.create(model="kiln", messages=ASK, max_tokens=3, logprobs=True, top_logprobs=4,
                                       temperature=0, extra_body={"ignore_eos": True})  # greedy: the likeliest
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 4 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    completion = oai.completions.create(model="kiln", prompt="hello", max_tokens=3, logprobs=2,
                                        extra_body={"ignore_eos": True})
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.top_logprobs) == 3 and all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    streamed = list(oai.chat.completions.create(model="kiln", messages=ASK, max_tokens=3, logprobs=True,
                                                top_logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 3 and all(len(e.top_logprobs) == 2 for e in entries)


def test_echo_and_logit_bias(oai, http):
    echoed = oai.completions.create(model="kiln", prompt="Echo me", max_tokens=3, echo=True, temperature=0)
    assert echoed.choices[0].text.startswith("Echo me")
    streamed = list(oai.completions.create(model="kiln", prompt="Echo me", max_tokens=3, echo=True, temperature=0,
                                           stream=True))
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text
    forced = oai.completions.create(model="kiln", prompt="x", max_tokens=4, logit_bias={str(token_id(http, "q")): 100},
                                    extra_body={"ignore_eos": True})
    assert forced.choices[0].text == "qqqq"


def test_model_ids_and_model_not_found(oai, http):
    model = oai.models.list().data[0].id
    assert " " not in model and oai.models.retrieve(model).id == model
    missing = http.get("/v1/models/gpt-4")
    assert missing.status_code == 404
    assert missing.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                          "param": "model", "code": "model_not_found"}
    with pytest.raises(openai.NotFoundError) as refused:
        oai.chat.completions.create(model="gpt-4", messages=ASK, max_tokens=2)
    assert refused.value.code == "model_not_found"


def test_harmless_fields_are_accepted_and_ignored(oai):
    reply = oai.chat.completions.with_raw_response.create(model="kiln", messages=ASK, max_tokens=2, store=False,
                                                          metadata={"k": "v"}, service_tier="auto", user="someone")
    assert reply.parse().choices[0].finish_reason in ("stop", "length")
    assert reply.headers["Kiln-Ignored-Fields"] == "metadata, service_tier, store, user"


@pytest.mark.parametrize(("body", "param", "complaint"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema", "Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}}},
     "response_format.json_schema.schema", "Unimplemented keys"),
    ({"response_format": {"type": "xml"}}, "response_format", "does not match"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools[1].function.parameters", "does not compile"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"stop": [str(i) for i in range(15)]}, "stop", "transcript chat format adds its own 2"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name", "pattern"),
    ({"n": 17}, "n", "16"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"functions": []}, "functions", "send tools and tool_choice"),
    ({"modalities": ["text", "audio"]}, "modalities", "text only"),
])
def test_requests_kiln_cannot_honour_are_400_naming_the_field(http, body, param, complaint):
    requests_before = generations(http)
    response = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and complaint in error["message"] and error["type"] == "invalid_request_error"
    assert generations(http) == requests_before  # nothing ran


def generations(http: httpx.Client) -> float:
    """Generations the server ended so far, whatever their outcome."""
    families = text_string_to_metric_families(http.get("/metrics").text)
    return sum(sample.value for family in families if family.name == "kiln_generations" for sample in family.samples
               if sample.name == "kiln_generations_total")


def test_echo_with_logprobs_is_refused(http):
    response = http.post("/v1/completions", json={"prompt": "x", "echo": True, "logprobs": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"


def test_served_model_name_aliases(tiny_llm):
    service = RuntimeService(tiny_llm("llama"), "tiny-llama", aliases=("my-agent-model",))
    http = TestClient(build_http_app(service, ApiKeys(), Metrics(service.llm)))
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny-llama", "my-agent-model"]
    assert http.get("/v1/models/my-agent-model").json()["id"] == "my-agent-model"
    reply = http.post("/v1/completions", json={"model": "my-agent-model", "prompt": "x", "max_tokens": 1}).json()
    assert reply["model"] == "my-agent-model"
