"""A Responses API request's input items: checked and made canonical, each refusal naming its place, then
read as a chat conversation (calls join the assistant turn they follow, reasoning the next one)."""

from __future__ import annotations

import pytest

from kiln.errors import InvalidArgumentError
from kiln.server.response_items import conversation, input_items


def cut(item: dict) -> InvalidArgumentError:
    return InvalidArgumentError("cut", "previous_response_id")


def test_a_string_is_one_user_message_and_items_become_canonical():
    [message] = input_items("Hi")
    assert message["role"] == "user" and message["content"] == [{"type": "input_text", "text": "Hi"}]
    assert message["id"].startswith("msg_")
    items = input_items([{"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
                         {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed", "phase": None,
                          "content": [{"type": "output_text", "text": "Hello", "annotations": []}]},
                         {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "18"}]}])
    assert items[1] == {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": "Hello", "annotations": []}]}
    assert items[2]["output"] == "18" and items[2]["id"].startswith("fco_")


def test_calls_join_the_turn_they_follow_and_thinking_the_next_turn():
    items = input_items([
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Two calls."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18"},
        {"type": "function_call_output", "call_id": "c2", "output": "21"},
        {"role": "assistant", "content": "18 and 21."}])
    messages = conversation(items, cut)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert messages[1]["reasoning_content"] == "Two calls." and messages[1]["content"] == ""
    assert [c["function"]["arguments"] for c in messages[1]["tool_calls"]] == [{"city": "Paris"}, {"city": "Rome"}]
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "18"}
    assert "reasoning_content" not in messages[4]


@pytest.mark.parametrize(("item", "param"), [
    ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}, "input[0].content[0]"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input[0].content[0]"),
    ({"type": "web_search_call", "id": "ws_1"}, "input[0].type"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}, "input[0].arguments"),
    ({"type": "function_call_output", "call_id": "c", "output": "x", "extra": 1}, "input[0].extra"),
    ({"role": "tool", "content": "x"}, "input[0].role"),
])
def test_what_kiln_cannot_read_is_refused_naming_its_place(item, param):
    with pytest.raises(InvalidArgumentError) as refused:
        input_items([item])
    assert refused.value.param == param


def test_a_cut_call_of_an_earlier_response_is_the_callers_error():
    call = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": '{"a": ', "status": "incomplete"}
    with pytest.raises(InvalidArgumentError, match="cut"):
        conversation([call], cut)
