"""The Responses API on durable sessions, through the real `openai` package (and the OpenAI Agents SDK)
against a real `kiln serve` on SmolLM2-135M-Instruct with a snapshot store: a conversation chained by
previous_response_id prefills only its new input, before and after a kill -9 and restart; two follow-ups
of one response fork; streamed events parse with openai's own types and add up to the response; function
tools call and continue; stored responses are per key, readable, deletable; store=false keeps nothing;
what Kiln cannot honour is refused."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import agents
import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseFunctionToolCall, ResponseStreamEvent

from tests.server.conftest import ServerHandle, start_server

MODEL = "smollm2-135m-instruct"
KEYS = ("key-a", "key-b")
INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


@dataclass
class Served:
    """The module's server, which one test kills with SIGKILL and starts again on the same store."""

    root: Path
    store: Path
    server: ServerHandle

    def kill_and_restart(self) -> None:
        self.server.process.send_signal(signal.SIGKILL)
        self.server.process.wait()
        self.server = serve(self.root, self.store)

    def client(self, key: str = KEYS[0]) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.http_url + "/v1", api_key=key, max_retries=0)


def serve(root: Path, store: Path) -> ServerHandle:
    """--durable-turns: a reply is sent once its session's snapshot holds it, so a kill -9 right after it loses
    nothing (without, the saver's backlog may; the turn would then recompute the reply, correctly)."""
    return start_server(MODEL, root / "cache", KEYS,
                        ("--snapshot-dir", str(store), "--speculative", "none", "--durable-turns"))


@pytest.fixture(scope="module")
def served(servers_root, tmp_path_factory) -> Iterator[Served]:
    store = tmp_path_factory.mktemp("responses") / "store"
    held = Served(servers_root, store, serve(servers_root, store))
    yield held
    held.server.stop()


def ask(oai: openai.OpenAI, text: str | list, previous: str | None = None, **options: object):  # noqa: ANN201
    """One turn, the raw response (headers and the parsed Response)."""
    options = {"instructions": INSTRUCTIONS, "max_output_tokens": 24, "temperature": 0, **options}
    if previous is not None:
        options["previous_response_id"] = previous
    return oai.responses.with_raw_response.create(model=MODEL, input=text, **options)


def valid(response: Response) -> Response:
    """The response as openai's own types validate it (the client builds its objects unchecked)."""
    return Response.model_validate(response.to_dict())


def history(response: Response) -> int:
    """The session's history after a response: its whole prompt and its output."""
    return response.usage.input_tokens + response.usage.output_tokens


def test_a_chained_conversation_prefills_only_new_input_before_and_after_kill_9(served):
    first = ask(served.client(), "What is the capital of France?")
    session, one = first.headers["Kiln-Session-Id"], valid(first.parse())
    assert first.headers["Kiln-Session-Recomputed"] == "new session"
    assert "Paris" in one.output_text and one.status == "completed"
    second = ask(served.client(), "And of Italy?", one.id)
    two = valid(second.parse())
    assert (second.headers["Kiln-Session-Id"], second.headers["Kiln-Session-Recomputed"]) == (session, "none")
    assert "Rome" in two.output_text
    # every earlier token, none again, but the last one generated (sampled, never yet fed)
    assert two.usage.input_tokens_details.cached_tokens == history(one) - 1

    served.kill_and_restart()
    third = ask(served.client(), "And of Spain?", two.id)
    three = valid(third.parse())
    assert (third.headers["Kiln-Session-Id"], third.headers["Kiln-Session-Recomputed"]) == (session, "none")
    assert three.usage.input_tokens_details.cached_tokens == history(two) - 1  # from the snapshot, not recomputed
    assert three.previous_response_id == two.id and "Madrid" in three.output_text
    stateless = ask(served.client(), "And of Spain?", two.id, store=False).parse()  # the same conversation, no session
    assert stateless.output_text == three.output_text
    assert served.client().responses.retrieve(one.id).output_text == one.output_text  # records survived the kill too


def test_two_follow_ups_of_one_response_fork(served):
    first = ask(served.client(), "What is the capital of France?")
    one = first.parse()
    with ThreadPoolExecutor(2) as pool:
        italy, germany = pool.map(lambda question: ask(served.client(), question, one.id),
                                  ["And of Italy?", "And of Germany?"])
    sessions = {italy.headers["Kiln-Session-Id"], germany.headers["Kiln-Session-Id"]}
    assert len(sessions) == 2 and first.headers["Kiln-Session-Id"] in sessions  # one in place, one forked
    assert "Rome" in italy.parse().output_text and "Berlin" in germany.parse().output_text
    for branch in (italy, germany):
        assert branch.headers["Kiln-Session-Recomputed"] == "none"
        assert branch.parse().usage.input_tokens_details.cached_tokens >= history(one) - 1
    for branch in (italy, germany):  # each branch goes on in its own session
        again = ask(served.client(), "And of Spain?", branch.parse().id)
        assert again.headers["Kiln-Session-Id"] == branch.headers["Kiln-Session-Id"]
        assert again.parse().usage.input_tokens_details.cached_tokens == history(branch.parse()) - 1


def test_streamed_events_parse_and_add_up_to_the_response(served):
    events = [EVENTS.validate_python(event.to_dict())
              for event in served.client().responses.create(model=MODEL, input="What is the capital of France?",
                                                            instructions=INSTRUCTIONS, max_output_tokens=24,
                                                            temperature=0, stream=True)]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    final = events[-1].response
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == final.output_text == events[-4].text and "Paris" in text
    assert served.client().responses.retrieve(final.id).to_dict() == final.to_dict()
    with served.client().responses.stream(model=MODEL, input="And of Italy?", previous_response_id=final.id,
                                          max_output_tokens=24, temperature=0) as stream:
        assert "Rome" in stream.get_final_response().output_text


def test_a_required_tool_call_is_a_function_call_and_its_output_continues(served):
    oai = served.client()
    streamed = [EVENTS.validate_python(event.to_dict()) for event in oai.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
        max_output_tokens=40, temperature=0, stream=True)]
    calling = streamed[-1].response
    [call] = calling.output
    assert isinstance(call, ResponseFunctionToolCall) and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta") == call.arguments
    assert [e.type for e in streamed if "function_call_arguments" in e.type][-1] == "response.function_call_arguments.done"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature_c": 18})}
    answer = valid(oai.responses.create(model=MODEL, input=[result], previous_response_id=calling.id, tools=[WEATHER],
                                        max_output_tokens=30, temperature=0))
    assert "18" in answer.output_text
    assert answer.usage.input_tokens_details.cached_tokens == history(calling) - 1
    # the same conversation sent whole, as an agent without previous_response_id does: a new session over the
    # same prompt (its tokens computed as one prefill, not generated one by one: equal text is only promised
    # in the deterministic mode)
    whole = oai.responses.create(model=MODEL, input=[{"role": "user", "content": "What is the weather in Paris?"},
                                                     call.to_dict(), result], tools=[WEATHER], max_output_tokens=30,
                                 temperature=0)
    assert whole.usage.input_tokens == answer.usage.input_tokens and "18" in whole.output_text


def test_json_schema_text_format(served):
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
            "additionalProperties": False}
    reply = served.client().responses.create(
        model=MODEL, input="Name the capital of France.", max_output_tokens=30, temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": city, "strict": True}})
    assert json.loads(reply.output_text) == {"city": "Paris"}


def test_stored_responses_belong_to_their_key_and_can_be_deleted(served):
    mine, theirs = served.client(KEYS[0]), served.client(KEYS[1])
    made = valid(mine.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0))
    assert made.status == "incomplete" and made.incomplete_details.reason == "max_output_tokens"
    assert valid(mine.responses.retrieve(made.id)).to_dict() == made.to_dict()
    dashboard = httpx.get(f"{served.server.http_url}/dashboard/state.json", timeout=30,
                          headers={"Authorization": f"Bearer {KEYS[0]}"}).json()
    assert dashboard["responses"]["stored"] >= 1
    assert any(row["responses"] for row in dashboard["sessions"])  # a stored response is a point in its session
    [item] = mine.responses.input_items.list(made.id).data
    assert item.type == "message" and item.content[0].text == "Hi"
    for call in (lambda: theirs.responses.retrieve(made.id), lambda: theirs.responses.delete(made.id),
                 lambda: theirs.responses.create(model=MODEL, input="Go on", previous_response_id=made.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    deleted = httpx.delete(f"{served.server.http_url}/v1/responses/{made.id}", timeout=30,
                           headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert deleted.json() == {"id": made.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError) as refused:
        mine.responses.create(model=MODEL, input="Go on", previous_response_id=made.id)
    assert refused.value.body["param"] == "previous_response_id"


def test_store_false_keeps_nothing(served):
    raw = ask(served.client(), "What is the capital of France?", store=False)
    unstored = raw.parse()
    assert "Kiln-Session-Id" not in raw.headers and not unstored.store and "Paris" in unstored.output_text
    with pytest.raises(openai.NotFoundError):
        served.client().responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        ask(served.client(), "And of Italy?", unstored.id)


@pytest.mark.parametrize(("options", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"tool_choice": {"type": "function", "name": "nowhere"}, "tools": [WEATHER]}, "tool_choice"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_field(served, options, param):
    with pytest.raises(openai.BadRequestError) as refused:
        served.client().responses.create(model=MODEL, **{"input": "Hi", "max_output_tokens": 4, **options})
    assert refused.value.body["param"] == param


def test_fields_kiln_does_not_take_are_listed(served):
    raw = served.client().responses.with_raw_response.create(model=MODEL, input="Hi", max_output_tokens=4,
                                                             include=[], truncation="disabled", user="someone")
    assert raw.headers["Kiln-Ignored-Fields"] == "include, truncation, user"


def test_the_agents_sdk_runs_a_tool_calling_agent(served):
    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return json.dumps({"temperature_c": 18, "sky": "sunny"})

    client = openai.AsyncOpenAI(base_url=served.server.http_url + "/v1", api_key=KEYS[0], max_retries=0)
    agent = agents.Agent(name="weather", instructions="Answer the user's question about the weather.",
                         tools=[get_weather], model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=40))
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4,
                                           auto_previous_response_id=True))
    assert cities == ["Paris"]
    assert "sunny" in result.final_output or "18" in result.final_output  # it read the tool's result
    later = result.raw_responses[-1]
    assert later.usage.input_tokens_details.cached_tokens > 0  # the follow-up continued the first call's session
