"""`kiln chat --tools FILE.json`: an interactive chat whose model may call functions, as /v1/chat/completions
with `tool_choice: "auto"` lets it. The file is OpenAI's `tools` list. A reply is either text or calls in the
model's own syntax (kiln/tool_syntax.py), held to that by the same grammar the API uses (kiln/tools.py);
each call is shown as it streams, as `[call NAME] ARGUMENTS`, and the lines typed next are the calls'
results, one per call, in order, after which the model answers from them. A reply makes one call at
most: a small model allowed several repeats its first until max_tokens. `--tool-choice` (auto, required
or a function's name) holds for the replies to the user's lines; a reply to results is free to answer in
text (auto), else a model forced to call would call again forever.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import InvalidArgumentError
from kiln.tokenizer import Tokenizer
from kiln.tool_syntax import ToolSyntax, markup_decoder, syntax_for
from kiln.tools import CallStart, ContentDelta, ReplyDelta, Tool, ToolCallParser, ToolChoice, grammar

Message = dict[str, object]
CHOICES = ("auto", "required")


@dataclass
class ChatTools:
    """The functions of a chat, the syntax its model calls them in, and the grammars of a reply to the
    user (`chosen`) and of one to results (`answer`)."""

    tools: list[Tool]
    syntax: ToolSyntax
    chosen: str
    answer: str
    decode: Callable[[Sequence[int]], str]  # a reply's text, the syntax's control tokens kept

    @classmethod
    def from_file(cls, path: str, tokenizer: Tokenizer, choice: str = "auto") -> ChatTools:
        """InvalidArgumentError naming the file for one that is not a list of function tools, and naming
        `--tool-choice` for a choice that is not auto, required or one of their names."""
        try:
            specs = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise InvalidArgumentError(f"--tools {path}: {error}") from error
        if not isinstance(specs, list) or not specs:
            raise InvalidArgumentError(f"--tools {path} must hold a JSON list of tools, as OpenAI's `tools`")
        tools = [_tool(path, index, spec) for index, spec in enumerate(specs)]
        if choice not in (*CHOICES, *(tool.name for tool in tools)):
            raise InvalidArgumentError(f"--tool-choice must be {' or '.join(CHOICES)} or a function of --tools {path}, "
                                       f"got {choice!r}")
        syntax = syntax_for(tokenizer)
        chosen = ToolChoice(choice, parallel=False) if choice in CHOICES else ToolChoice("function", choice, False)
        return cls(tools, syntax, grammar(tools, chosen, None, syntax, tokenizer),
                   grammar(tools, ToolChoice("auto", parallel=False), None, syntax, tokenizer),
                   markup_decoder(tokenizer, syntax))

    def grammar(self, last: Message) -> str:
        """What the reply after message `last` must match: the chosen rule after a user's line, auto after
        a result."""
        return self.answer if last["role"] == "tool" else self.chosen

    @staticmethod
    def message(line: str, turns: list[Message]) -> Message:
        """What a typed line is after `turns`: the result of the oldest call waiting for one, else the
        user's turn."""
        waiting = waiting_calls(turns)
        if waiting:
            return {"role": "tool", "tool_call_id": waiting[0], "content": line}
        return {"role": "user", "content": line}

    def reply(self) -> ToolReply:
        return ToolReply(self, ToolCallParser(self.syntax))


@dataclass
class ToolReply:
    """One reply read as it streams: `push` returns what to print of each piece."""

    tools: ChatTools
    parser: ToolCallParser
    content: str = ""
    calls: list[list[str]] = field(default_factory=list)  # [name, arguments as JSON text] per call

    def push(self, text: str) -> str:
        return self._shown(self.parser.push(text))

    def finish(self, complete: bool) -> str:
        return self._shown(self.parser.finish(complete))

    def _shown(self, deltas: list[ReplyDelta]) -> str:
        shown = ""
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                self.content += delta.text
                shown += delta.text
            elif isinstance(delta, CallStart):
                apart = "\n" if self.content or self.calls else ""
                self.calls.append([delta.name, ""])
                shown += f"{apart}[call {delta.name}] "
            else:
                self.calls[delta.index][1] += delta.text
                shown += delta.text
        return shown

    def message(self) -> Message:
        """The reply as the conversation keeps it. Its complete calls (arguments a JSON object) get ids and
        wait for their results (waiting_calls); a call cut short (max_tokens) is dropped."""
        calls = []
        for name, arguments in self.calls:
            try:
                parsed = json.loads(arguments)
            except ValueError:
                continue
            if isinstance(parsed, dict):
                calls.append({"id": self.tools.syntax.call_id(), "type": "function",
                              "function": {"name": name, "arguments": parsed}})
        return {"role": "assistant", "content": self.content, **({"tool_calls": calls} if calls else {})}


def waiting_calls(turns: list[Message]) -> list[str]:
    """Ids of the last reply's calls that no result in `turns` answers yet, oldest first."""
    replies = [index for index, turn in enumerate(turns) if turn["role"] == "assistant"]
    if not replies:
        return []
    answered = {turn.get("tool_call_id") for turn in turns[replies[-1] + 1 :]}
    return [call["id"] for call in turns[replies[-1]].get("tool_calls", ()) if call["id"] not in answered]


def _tool(path: str, index: int, spec: object) -> Tool:
    function = spec.get("function") if isinstance(spec, dict) and spec.get("type", "function") == "function" else None
    if not isinstance(function, dict):
        raise InvalidArgumentError(f'--tools {path}: item {index} is not {{"type": "function", "function": '
                                   "{name, description, parameters}}")
    return Tool(function.get("name"), function.get("description") or "", function.get("parameters"))
