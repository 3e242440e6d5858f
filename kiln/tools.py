"""Tool calls as text, for models without a native tool format (the embedded base model has none).

A call is written the way Hermes-style templates (Qwen 2.5, Hermes) write it:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and several calls follow each other separated by one newline. The OpenAI `tool_choice` becomes a
grammar over replies (`grammar`), so what the model writes always parses:

- `none`: no grammar from the tools (the reply is plain text, or the response_format's);
- `required`: one call (or several, with parallel_tool_calls) and nothing else;
- a named function: exactly one call to it;
- `auto`: either one or more calls, or plain text that does not begin with `<tool_call>`, even after
  whitespace (with a json response_format, that JSON instead of free text). A reply is a call exactly when it begins
  with `<tool_call>`, so a reply never mixes text and calls.

Each call's `arguments` must match its function's JSON schema. `ToolCallParser` turns the generated text
back into OpenAI tool calls incrementally, so streaming and whole replies are built alike. This module
also renders tool definitions, assistant calls and tool results into prompt text (kiln/chat.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kiln.errors import InvalidArgumentError
from kiln.text import partial_suffix

CALL_OPEN, CALL_CLOSE, CALL_SEPARATOR = "<tool_call>\n", "\n</tool_call>", "\n"
_HEADER = re.compile(r'\{"name": "([A-Za-z0-9_-]+)", "arguments": ')
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ARGUMENTS_END = "}" + CALL_CLOSE  # closes the call object, then the call
# the JSON layout of the call, as kiln/engine/constraints.py generates every JSON (no free whitespace)
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tool:
    """One function the model may call; `parameters` is its JSON schema (None: no parameters)."""

    name: str
    description: str = ""
    parameters: Mapping | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise InvalidArgumentError(f"tool name must be 1-64 letters, digits, _ or -, got {self.name!r:.80}")

    @property
    def schema(self) -> Mapping:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}

    def definition(self) -> dict:
        """The OpenAI function definition, as chat templates and the rendered prompt show it."""
        return {"name": self.name, "description": self.description, "parameters": self.schema}


@dataclass(frozen=True)
class ToolChoice:
    """OpenAI's tool_choice: mode "none" | "auto" | "required", or "function" with `function` naming
    the one to call."""

    mode: str = "auto"
    function: str | None = None
    parallel: bool = True  # parallel_tool_calls: several calls in one reply

    @property
    def calls_allowed(self) -> bool:
        return self.mode != "none"


def check_names(tools: Sequence[Tool]) -> None:
    """Raises InvalidArgumentError (param `tools`) if two tools share a name: a call names its function,
    so a repeated name would make the call ambiguous and its arguments' schema unknowable."""
    first: dict[str, int] = {}
    for index, tool in enumerate(tools):
        if tool.name in first:
            raise InvalidArgumentError(f"tools[{index}].function.name {tool.name!r} repeats tools[{first[tool.name]}]'s; "
                                       "tool names must be unique", "tools")
        first[tool.name] = index


def grammar(tools: Sequence[Tool], choice: ToolChoice, plain_json: Mapping | None = None) -> str | None:
    """The Lark grammar (llguidance dialect) of the replies `choice` allows, or None when the tools
    constrain nothing (`none`). `plain_json`: the JSON schema a non-call reply must match under `auto`
    (from response_format), instead of free text. Tools with repeated names are refused (check_names)."""
    check_names(tools)
    if not choice.calls_allowed:
        return None
    callable_tools = [tool for tool in tools if choice.function in (None, tool.name)]
    call_schema = {"anyOf": [_call_schema(tool) for tool in callable_tools], "x-guidance": _LAYOUT}
    calls = "call" if choice.mode == "function" or not choice.parallel else f'call ("{_lark(CALL_SEPARATOR)}" call)*'
    rules = [f"calls: {calls}",
             f'call: "{_lark(CALL_OPEN)}" %json {json.dumps(call_schema)} "{_lark(CALL_CLOSE)}"']
    if choice.mode != "auto":
        return "\n".join(["start: calls", *rules])
    if plain_json is not None:
        plain = f"plain: %json {json.dumps({**plain_json, 'x-guidance': _LAYOUT})}"
    else:  # any text that does not begin like a call, even after whitespace (a transcript's reply opens with a space)
        plain = f'plain: TEXT\nTEXT: /(?s:.+)/ & ~/\\s*{re.escape(CALL_OPEN.strip())}(?s:.*)/'
    return "\n".join(["start: plain | calls", plain, *rules])


def _call_schema(tool: Tool) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": tool.schema},
            "required": ["name", "arguments"], "additionalProperties": False}


def _lark(text: str) -> str:
    """`text` inside a Lark string literal."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it; `arguments` is JSON text of an object."""
    return f'{CALL_OPEN}{{"name": "{name}", "arguments": {arguments}}}{CALL_CLOSE}'


def tools_prompt(tools: Sequence[Tool]) -> str:
    """The instructions that tell a model without a native tool format which tools it has and how to
    call them (a system message's text)."""
    lines = "\n".join(json.dumps(tool.definition(), ensure_ascii=False) for tool in tools)
    return (f"You can call these tools:\n{lines}\n\nTo call a tool, reply with only\n"
            f"{call_text('<tool name>', '<arguments as a JSON object>')}\n"
            "Tool results come back inside <tool_response></tool_response>.")


def tool_response_text(content: str) -> str:
    """A tool's result as a model without a native tool format reads it."""
    return f"<tool_response>\n{content}\n</tool_response>"


@dataclass
class CallStart:
    index: int
    name: str


@dataclass
class ArgumentsDelta:
    index: int
    text: str


@dataclass
class ContentDelta:
    text: str


ReplyDelta = CallStart | ArgumentsDelta | ContentDelta


@dataclass
class ToolCallParser:
    """Splits a reply's text, fed in pieces as it is generated, into plain content and tool calls:
    `push` returns what became certain. A reply is plain when it does not begin with `<tool_call>`; a
    call's arguments stream out as their text arrives (the closing `}` and `</tool_call>` held back
    until seen).

    A call identical to an earlier call of the same reply adds nothing, and a model that writes one
    would go on repeating it: the repeat is never handed out (a call is held back while it matches an
    earlier one so far) and `repeated` says the reply is over. Markup of a call never becomes content:
    a reply cut short (`finish(complete=False)`) drops a call whose name is not yet written, and a
    started call keeps the arguments written so far (not yet complete JSON)."""

    _buffer: str = ""
    _mode: str = "undecided"  # undecided | plain | between | call | over
    _calls: int = 0
    _names: list[str] = field(default_factory=list)
    _body: str = ""  # the current call's text after <tool_call>, up to its closing "}" (held back)
    _sent: int = -1  # how much of _body went out (-1: not even its CallStart)
    _bodies: list[str] = field(default_factory=list)  # the complete calls' bodies

    def push(self, text: str) -> list[ReplyDelta]:
        self._buffer += text
        return list(self._drain())

    @property
    def names(self) -> list[str]:
        """The functions called so far, by call index."""
        return list(self._names)

    @property
    def repeated(self) -> bool:
        """The model repeated an earlier call: the reply ended with the call before it."""
        return self._mode == "over"

    def _drain(self) -> Iterator[ReplyDelta]:
        while self._buffer:
            if self._mode == "plain":
                yield ContentDelta(self._take(len(self._buffer)))
            elif self._mode == "over":
                self._buffer = ""
            elif self._mode in ("undecided", "between"):
                expected = CALL_OPEN if self._mode == "undecided" else CALL_SEPARATOR + CALL_OPEN
                if self._buffer.startswith(expected):
                    self._take(len(expected))
                    self._mode = "call"
                elif not expected.startswith(self._buffer):
                    self._mode = "plain"
                else:
                    return
            else:
                end = self._buffer.find(_ARGUMENTS_END)
                complete = end >= 0
                self._body += self._take(end if complete else len(self._buffer) - partial_suffix(self._buffer, _ARGUMENTS_END))
                if complete and self._body in self._bodies:
                    self._mode = "over"
                    continue
                if complete or not any(body.startswith(self._body) for body in self._bodies):
                    yield from self._release()
                if not complete:
                    return
                self._take(len(_ARGUMENTS_END))
                self._bodies.append(self._body)
                self._body, self._sent, self._mode = "", -1, "between"
                self._calls += 1

    def _release(self) -> Iterator[ReplyDelta]:
        """The current call's start and the arguments not yet handed out, once its name is written."""
        if self._sent < 0:
            match = _HEADER.match(self._body)
            if match is None:
                return
            self._names.append(match.group(1))
            self._sent = match.end()
            yield CallStart(self._calls, match.group(1))
        if len(self._body) > self._sent:
            yield ArgumentsDelta(self._calls, self._body[self._sent :])
            self._sent = len(self._body)

    def _take(self, count: int) -> str:
        taken, self._buffer = self._buffer[:count], self._buffer[count:]
        return taken

    def finish(self, complete: bool = True) -> list[ReplyDelta]:
        """What is left when the text ends. A complete reply too short to tell is content; from a reply
        cut short (max_tokens) only content is left, never the markup of a call: an unfinished call
        keeps what it had (`push` handed out its arguments so far)."""
        rest, self._buffer = self._buffer, ""
        return [ContentDelta(rest)] if rest and self._mode == "undecided" and complete else []
