"""Tool calls: the OpenAI tool definitions and tool_choice, the grammar that makes a reply a well-formed
call in the model's own syntax (kiln/tool_syntax.py), and the parser that reads calls back.

The OpenAI `tool_choice` becomes a grammar over replies (`grammar`), so what the model writes always
parses:

- `none`: no grammar from the tools (the reply is plain text, or the response_format's);
- `required`: one call (or several, with parallel_tool_calls) and nothing else;
- a named function: exactly one call to it, after which the model must stop;
- `auto`: either one or more calls, or plain text that does not begin like a call (`<tool_call>`,
  `{"name"`, ...), even after whitespace (with a json response_format, that JSON instead of free text).
  A reply is calls exactly when it begins like one, so a reply never mixes text and calls.

Each call's `arguments` must match its function's JSON schema. `ToolCallParser` turns the generated text
back into OpenAI tool calls incrementally, so streaming and whole replies are built alike. For a chat
template that knows no tools, `tools_prompt` tells the model its tools as a system message.
"""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kiln.errors import InvalidArgumentError
from kiln.tokenizer import Tokenizer
from kiln.tool_syntax import CALL_HEADER, KILN, NAME_CHARS, ToolSyntax, control_token_id

_NAME = re.compile(f"{NAME_CHARS}{{1,64}}")
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


def grammar(tools: Sequence[Tool], choice: ToolChoice, plain_json: Mapping | None = None, syntax: ToolSyntax = KILN,
            tokenizer: Tokenizer | None = None) -> str | None:
    """The Lark grammar (llguidance dialect) of the replies `choice` allows, written in `syntax`, or None
    when the tools constrain nothing (`none`). `plain_json`: the JSON schema a non-call reply must match
    under `auto` (from response_format), instead of free text. `tokenizer`: the vocabulary, whose control
    tokens the syntax's markup must be (Mistral's [TOOL_CALLS]). With one call allowed (a named
    function, parallel_tool_calls false) the grammar ends after it, so the model must stop there. Tools
    with repeated names are refused (check_names)."""
    check_names(tools)
    if not choice.calls_allowed:
        return None
    callable_tools = [tool for tool in tools if choice.function in (None, tool.name)]
    markup = functools.partial(_markup, syntax=syntax, tokenizer=tokenizer)
    more = "" if choice.mode == "function" or not choice.parallel else f"({markup(syntax.separator)} call)*"
    rules = [f"calls: {markup(syntax.opening)} call {more} {markup(syntax.closing)}",
             f"call: {markup(syntax.call_open)} call_body {markup(syntax.call_close)}", *_call_body(callable_tools, syntax, markup)]
    if choice.mode != "auto":
        return "\n".join(["start: calls", *rules])
    if plain_json is not None:
        plain = f"plain: {json_rule(plain_json)}"
    else:  # any text that does not begin like a call, even after whitespace (a transcript's reply opens with a space)
        opens = syntax.lead.strip() or CALL_HEADER.rstrip(' "')
        plain = f'plain: TEXT\nTEXT: /(?s:.+)/ & ~/\\s*{re.escape(opens)}(?s:.*)/'
    return "\n".join(["start: plain | calls", plain, *rules])


def json_rule(schema: Mapping) -> str:
    """A Lark rule body matching JSON of `schema`, laid out as every JSON Kiln generates."""
    return f"%json {json.dumps({**schema, 'x-guidance': _LAYOUT})}"


def _call_body(tools: Sequence[Tool], syntax: ToolSyntax, markup: Callable[[str], str]) -> list[str]:
    """The rules of one call between its markup: one JSON object naming the function, or (a syntax that
    writes the name outside) the name, its separator and the arguments, one alternative per function."""
    if not syntax.name_separator:
        key = syntax.arguments_key
        schemas = [{"type": "object", "properties": {"name": {"const": tool.name}, key: tool.schema},
                    "required": ["name", key], "additionalProperties": False} for tool in tools]
        return [f"call_body: {json_rule({'anyOf': schemas})}"]
    alternatives = [f"call_{index}" for index in range(len(tools))]
    return [f"call_body: {' | '.join(alternatives)}",
            *(f"{rule}: {markup(tool.name + syntax.name_separator)} {json_rule(tool.schema)}"
              for rule, tool in zip(alternatives, tools, strict=True))]


def _markup(text: str, syntax: ToolSyntax, tokenizer: Tokenizer | None) -> str:
    """`text` as Lark: its control tokens as themselves (`<[id]>`), the rest as string literals."""
    pieces = [text]
    for token in syntax.special:
        pieces = [part for piece in pieces for part in _split_keeping(piece, token)]
    return " ".join(_lark_piece(piece, tokenizer) for piece in pieces if piece)


def _split_keeping(text: str, token: str) -> list[str]:
    parts = text.split(token)
    return [piece for index, part in enumerate(parts) for piece in ([token, part] if index else [part])]


def _lark_piece(text: str, tokenizer: Tokenizer | None) -> str:
    token_id = control_token_id(tokenizer, text) if tokenizer is not None else None
    if token_id is not None:
        return f"<[{token_id}]>"
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def tools_prompt(tools: Sequence[Tool], syntax: ToolSyntax = KILN) -> str:
    """The instructions that tell a model whose chat template knows no tools which tools it has and how
    to call them (a system message's text)."""
    lines = "\n".join(json.dumps(tool.definition(), ensure_ascii=False) for tool in tools)
    return (f"You can call these tools:\n{lines}\n\nTo call a tool, reply with only\n"
            f"{syntax.call_text('<tool name>', '<arguments as a JSON object>')}")


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
class _ObjectScan:
    """Where a JSON object written piece by piece closes, and where its value at depth 1 that began
    at `start` (a call's arguments) closes."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    value_end: int = -1

    def feed(self, char: str, position: int, start: int) -> bool:
        """Reads one character at `position` of the object; True when it closed the object."""
        if self.in_string:
            self.in_string = self.escaped or char != '"'
            self.escaped = not self.escaped and char == "\\"
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
        if self.depth == 1 and self.value_end < 0 and position >= start > 0 and not self.in_string:
            self.value_end = position + 1
        return self.depth == 0 and position > 0


@dataclass
class ToolCallParser:
    """Splits a reply's text, fed in pieces as it is generated, into plain content and tool calls
    written in `syntax`: `push` returns what became certain. A reply is plain when it does not begin
    like a call; a call's arguments stream out as their text arrives.

    A call identical to an earlier call of the same reply adds nothing, and a model that writes one
    would go on repeating it: the repeat is never handed out (a call is held back while it matches an
    earlier one so far), and `repeated` says the reply is over as soon as its object closes. Markup of a
    call never becomes content: a reply cut short (`finish(complete=False)`) drops a call whose name is
    not yet written, and a started call keeps the arguments written so far (not yet complete JSON)."""

    syntax: ToolSyntax = KILN
    _buffer: str = ""
    _mode: str = "undecided"  # undecided | plain | call | closing_call | between | over | closed
    _calls: int = 0
    _names: list[str] = field(default_factory=list)
    _body: str = ""  # the current call's object as written so far
    _scan: _ObjectScan = field(default_factory=_ObjectScan)
    _name: str = ""  # the current call's function, once written
    _arguments_at: int = 0  # where the current call's arguments begin in _body (0: its name is not yet written)
    _sent: int = -1  # how much of _body went out (-1: not even its CallStart)
    _bodies: list[str] = field(default_factory=list)  # the complete calls' objects

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

    @property
    def calls_complete(self) -> bool:
        """Every call handed out so far is complete, and nothing of a later one was: a reply that ends
        here (even cut by max_tokens) is a whole reply of calls."""
        if self._mode == "call":
            return self._sent < 0 and any(body.startswith(self._body) for body in self._bodies)
        return self._mode in ("closing_call", "between", "over", "closed")

    def _drain(self) -> Iterator[ReplyDelta]:
        while self._buffer:
            if self._mode == "plain":
                yield ContentDelta(self._take(len(self._buffer)))
            elif self._mode in ("over", "closed"):
                self._buffer = ""
            elif self._mode == "call":
                yield from self._read_call()
            elif not self._decide():
                return

    def _decide(self) -> bool:
        """Reads the markup before a call (or after the last): False while the text so far could go
        either way."""
        syntax = self.syntax
        if self._mode == "closing_call":
            choices = {syntax.call_close: "between"}
        elif self._mode == "undecided":
            choices = {prefix + syntax.lead + syntax.call_header: "call" for prefix in ("", *syntax.read_prefixes)}
        else:
            choices = {syntax.separator + syntax.call_open + syntax.call_header: "call", syntax.closing: "closed"}
        for expected, mode in choices.items():
            if expected and self._buffer.startswith(expected):
                self._take(len(expected) - len(syntax.call_header) if mode == "call" else len(expected))
                self._mode = mode
                return True
        if any(expected.startswith(self._buffer) for expected in choices):
            return False
        self._mode = "plain" if self._mode == "undecided" else "closed"
        return True

    def _read_call(self) -> Iterator[ReplyDelta]:
        complete = False
        named_outside = bool(self.syntax.name_separator)
        while self._buffer and not complete:
            char = self._take(1)
            self._body += char
            if not named_outside or self._arguments_at:  # an object is scanned whole; a name outside it is not
                origin = self._arguments_at if named_outside else 0
                complete = self._scan.feed(char, len(self._body) - 1 - origin, self._arguments_at - origin)
            if not self._arguments_at and (match := self.syntax.header.match(self._body)):
                self._name, self._arguments_at = match.group(1), match.end()
        if complete and self._body in self._bodies:
            self._mode = "over"
            return
        if complete or not any(body.startswith(self._body) for body in self._bodies):
            yield from self._release()
        if complete:
            self._bodies.append(self._body)
            self._body, self._sent, self._arguments_at = "", -1, 0
            self._mode = "closing_call" if self.syntax.call_close else "between"
            self._scan = _ObjectScan()
            self._calls += 1

    def _release(self) -> Iterator[ReplyDelta]:
        """The current call's start and the arguments not yet handed out, once its name is written."""
        if not self._arguments_at:
            return
        if self._sent < 0:
            self._sent = self._arguments_at
            self._names.append(self._name)
            yield CallStart(self._calls, self._name)
        end = self._scan.value_end if self._scan.value_end > 0 else len(self._body)
        if end > self._sent:
            yield ArgumentsDelta(self._calls, self._body[self._sent : end])
            self._sent = end

    def _take(self, count: int) -> str:
        taken, self._buffer = self._buffer[:count], self._buffer[count:]
        return taken

    def finish(self, complete: bool = True) -> list[ReplyDelta]:
        """What is left when the text ends. A complete reply too short to tell is content; from a reply
        cut short (max_tokens) only content is left, never the markup of a call: an unfinished call
        keeps what it had (`push` handed out its arguments so far)."""
        rest, self._buffer = self._buffer, ""
        return [ContentDelta(rest)] if rest and self._mode == "undecided" and complete else []
