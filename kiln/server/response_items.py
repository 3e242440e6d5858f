"""The items of OpenAI's Responses API, Kiln's side of them: a request's `input` checked and written in one
canonical form (the form `GET /v1/responses/{id}/input_items` returns and a stored response keeps), and a
conversation of items turned into kiln/chat.py's messages, which the chat format renders.

Items Kiln takes: messages (role user, system, developer or assistant; content a string or text parts:
`input_text`, `output_text`, `refusal`), `function_call` (an earlier call: call_id, name, arguments as JSON
text of an object), `function_call_output` (its result: text, or text parts) and `reasoning` (a reasoning
model's earlier thinking, `reasoning_text` parts, given back to the template with the assistant turn that
follows it). Null fields are fields left out; an item's id, status, annotations and logprobs describe it
and are dropped. Anything else is refused naming its place (`input[3].content[0]`), never dropped unseen:
images, files and audio (Kiln reads text), items of OpenAI's built-in tools, `item_reference`.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping, Sequence

from kiln.chat import OPENAI_ROLES, Message
from kiln.errors import InvalidArgumentError

ID_PREFIXES = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}
_FIELDS = {  # what each item may hold; anything else is refused
    "message": frozenset({"type", "id", "role", "content", "status", "phase"}),
    "function_call": frozenset({"type", "id", "call_id", "name", "arguments", "status"}),
    "function_call_output": frozenset({"type", "id", "call_id", "output", "status"}),
    "reasoning": frozenset({"type", "id", "summary", "content", "encrypted_content", "status"}),
}
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}  # part type -> its text field
Item = dict[str, object]


def item_id(kind: str) -> str:
    """A new id for an item of `kind`, in OpenAI's form (msg_..., fc_...)."""
    return ID_PREFIXES[kind] + secrets.token_hex(16)


def input_items(given: str | Sequence[object]) -> list[Item]:
    """A request's `input` as canonical items: a string is one user message; every item is checked."""
    if isinstance(given, str):
        return [_message("input", {"role": "user", "content": given})]
    return [_item(f"input[{index}]", item) for index, item in enumerate(given)]


def _item(where: str, item: object) -> Item:
    if not isinstance(item, Mapping):
        raise InvalidArgumentError(f"{where} must be an object (a message or an item with a type)", where)
    item = {key: value for key, value in item.items() if value is not None}
    kind = item.get("type", "message")
    if kind not in _FIELDS:
        raise InvalidArgumentError(f"{where}: items of type {kind!r} are not supported: Kiln takes messages, "
                                   "function_call, function_call_output and reasoning items", f"{where}.type")
    unsupported = sorted(set(item) - _FIELDS[kind])
    if unsupported:
        raise InvalidArgumentError(f"{where}: unsupported field(s) {', '.join(unsupported)} for a {kind} item",
                                   f"{where}.{unsupported[0]}")
    if kind == "message":
        return _message(where, item)
    if kind == "function_call":
        name, arguments = _string(where, item, "name"), _string(where, item, "arguments")
        if not isinstance(_arguments(arguments), dict):
            raise InvalidArgumentError(f"{where}.arguments must be a JSON object as text", f"{where}.arguments")
        return {"type": kind, "id": _id(item, kind), "call_id": _string(where, item, "call_id"), "name": name,
                "arguments": arguments, "status": "completed"}
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _text(f"{where}.output", output)
        return {"type": kind, "id": _id(item, kind), "call_id": _string(where, item, "call_id"), "output": text,
                "status": "completed"}
    content = item.get("content", [])
    thinking = _text(f"{where}.content", content, {"reasoning_text": "text"})
    return reasoning_item(thinking, _id(item, kind))


def _message(where: str, item: Mapping[str, object]) -> Item:
    role = item.get("role")
    if not isinstance(role, str) or role not in OPENAI_ROLES or role == "tool":
        raise InvalidArgumentError(f"{where}: role must be user, system, developer or assistant, got {role!r}",
                                   f"{where}.role")
    content = item.get("content")
    text = content if isinstance(content, str) else _text(f"{where}.content", content)
    return message_item(role, text, _id(item, "message"))


def message_item(role: str, text: str, item_id_: str | None = None, status: str = "completed") -> Item:
    """A message item of `role` holding `text` (an assistant's as output_text, with no annotations)."""
    part = ({"type": "output_text", "text": text, "annotations": []} if role == "assistant"
            else {"type": "input_text", "text": text})
    return {"type": "message", "id": item_id_ or item_id("message"), "role": role, "status": status, "content": [part]}


def reasoning_item(text: str, item_id_: str | None = None) -> Item:
    """A reasoning item holding a reasoning model's thinking as one reasoning_text part (no summary)."""
    return {"type": "reasoning", "id": item_id_ or item_id("reasoning"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _id(item: Mapping[str, object], kind: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and given else item_id(kind)


def _string(where: str, item: Mapping[str, object], name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{where}: {name} must be a string", f"{where}.{name}")
    return value


def _text(where: str, content: object, parts: Mapping[str, str] = _TEXT_PARTS) -> str:
    """The text of a list of parts, each of a type in `parts` (type -> its text field)."""
    if not isinstance(content, list):
        raise InvalidArgumentError(f"{where} must be a string or a list of text parts", where)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in parts:
            raise InvalidArgumentError(f"{where}[{index}]: a part of type {kind!r} is not supported; Kiln reads "
                                       f"text ({', '.join(parts)})", f"{where}[{index}]")
        if not isinstance(part.get(parts[kind]), str):
            raise InvalidArgumentError(f"{where}[{index}] needs a string {parts[kind]!r}", f"{where}[{index}]")
        texts.append(part[parts[kind]])
    return "".join(texts)


def _arguments(text: str) -> object:
    try:
        return json.loads(text or "{}")
    except ValueError:
        return None


def conversation(items: Sequence[Item], cut_call: Callable[[Item], InvalidArgumentError]) -> list[Message]:
    """Canonical items as kiln/chat.py's messages: function calls join the assistant turn they follow (or
    open one), a result is a tool message, reasoning goes with the next assistant turn. `cut_call(item)`:
    the error for a call whose arguments are not a JSON object (an earlier reply cut by its token limit)."""
    messages: list[Message] = []
    thinking = ""
    previous = ""  # the type of the item before: a call after an assistant's message or call is in its turn
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            thinking += _text("reasoning", item["content"], {"reasoning_text": "text"})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind == "function_call":
            arguments = _arguments(str(item["arguments"]))
            if not isinstance(arguments, dict):
                raise cut_call(item)
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}
            if previous in ("assistant", "function_call"):
                messages[-1].setdefault("tool_calls", []).append(call)  # type: ignore[union-attr]
            else:
                messages.append(_with_thought({"role": "assistant", "content": "", "tool_calls": [call]}, thinking))
                thinking = ""
        else:
            text = _text("content", item["content"])
            if item["role"] == "assistant":
                messages.append(_with_thought({"role": "assistant", "content": text}, thinking))
                thinking = ""
            else:
                messages.append({"role": OPENAI_ROLES[str(item["role"])], "content": text})
        previous = str(item["role"]) if kind == "message" else kind
    return messages


def _with_thought(message: Message, thinking: str) -> Message:
    return {**message, "reasoning_content": thinking} if thinking else message
