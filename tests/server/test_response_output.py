"""A Responses API reply's output items and stream events, built from a chat reply's pieces: in OpenAI's
order, and each event and item valid under the `openai` package's own types."""

from __future__ import annotations

import pydantic
from openai.types.responses import ResponseOutputItem, ResponseStreamEvent

from kiln.server.response_output import ResponseOutput

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
ITEMS = pydantic.TypeAdapter(ResponseOutputItem)


def kinds(events: list[dict]) -> list[str]:
    """The events' types, each event checked against openai's types."""
    return [EVENTS.validate_python({**event, "sequence_number": number}).type for number, event in enumerate(events)]


def call(index: int, name: str | None = None, arguments: str = "") -> dict:
    if name is None:
        return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}
    return {"tool_calls": [{"index": index, "id": f"call_{index}", "type": "function",
                            "function": {"name": name, "arguments": ""}}]}


def test_thinking_then_text_are_a_reasoning_item_then_a_message():
    output = ResponseOutput()
    events = [event for piece in ({"reasoning_content": "Think"}, {"reasoning_content": "ing."}, {"content": ""},
                                  {"content": "Paris"}) for event in output.push(piece)] + output.finish(True)
    assert kinds(events) == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done"]
    reasoning, message = (ITEMS.validate_python(item) for item in output.items)
    assert reasoning.content[0].text == output.reasoning == "Thinking."
    assert message.content[0].text == "Paris" and message.status == "completed"
    assert [event["output_index"] for event in events if event["type"] == "response.output_item.done"] == [0, 1]


def test_calls_are_function_call_items_and_a_cut_one_is_incomplete():
    output = ResponseOutput()
    pieces = (call(0, "get_weather"), call(0, arguments='{"city": '), call(0, arguments='"Paris"}'),
              call(1, "get_time"), call(1, arguments='{"zone": "CE'))
    events = [event for piece in pieces for event in output.push(piece)] + output.finish(False)
    assert kinds(events) == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done"]
    first, second = (ITEMS.validate_python(item) for item in output.items)
    assert (first.call_id, first.name, first.arguments, first.status) == ("call_0", "get_weather", '{"city": "Paris"}',
                                                                          "completed")
    assert (second.name, second.arguments, second.status) == ("get_time", '{"zone": "CE', "incomplete")


def test_a_reply_with_nothing_in_it_is_an_empty_message():
    output = ResponseOutput()
    assert kinds(output.finish(True))[0] == "response.output_item.added"
    [message] = output.items
    assert ITEMS.validate_python(message).content[0].text == ""
