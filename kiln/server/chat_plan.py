"""What the OpenAI APIs that generate share (/v1/completions, /v1/chat/completions, /v1/responses): a request
made into a Plan (the prompt's token ids and the text they were encoded from, the constraint the reply must
match, how the reply reads back), its sampling options filled as OpenAI's are, and a reply's text turned
into pieces as it becomes final: content, a reasoning model's thinking, tool-call starts and argument deltas.

A conversation (`ChatRequest`: kiln/chat.py's messages, function tools, tool_choice, an output format) is
written in the server's chat format with the callable tools rendered (kiln/chat.py), and its tools and
format become one grammar in the model's own call syntax (kiln/tools.py, kiln/tool_syntax.py). Each API
reads its own fields into a ChatRequest and names them in its errors; everything after is shared.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from kiln.chat import TEMPLATE, ChatFormat, Message, chat_format, knows_tools, prompt_for_chat
from kiln.engine.constraints import ANY_OBJECT, Constraint, as_generated
from kiln.engine.sampler import MAX_STOP_STRINGS
from kiln.errors import InvalidArgumentError
from kiln.models.generation_config import GenerationDefaults
from kiln.reasoning import ReasoningSplitter, opened_in, thinks, with_thought
from kiln.server.chat_sessions import Prompt
from kiln.server.service import GenerateRequest, naming
from kiln.tokenizer import Tokenizer
from kiln.tool_syntax import KILN, ToolSyntax, markup_decoder, syntax_for
from kiln.tools import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    Tool,
    ToolCallParser,
    ToolChoice,
    check_names,
    grammar,
    json_rule,
)

OPENAI_DEFAULTS = GenerationDefaults(temperature=1.0, top_p=1.0)  # what OpenAI assumes where a request is silent


@dataclass(frozen=True)
class Plan:
    """What one OpenAI request generates: the prompts' token ids, the constraint the text must match, and
    how its text reads back (tool calls, echo)."""

    prompts: list[list[int]]
    sources: list[Prompt]  # what each prompt was encoded from: a session continues from it
    constraint: Constraint | None = None
    calls: bool = False  # the reply may be tool calls
    echoes: list[str] | None = None  # completions with echo: each prompt's text
    form: ChatFormat = TEMPLATE  # chat: the format's stop strings, default reply limit and lead end every reply
    reasoning: bool = False  # chat with a reasoning model: its thinking is reasoning_content
    thinking_opened: bool = False  # the prompt opened the thinking: the reply starts inside it


class FunctionSpec(Protocol):
    """A function tool as a request declares it (each API nests it its own way)."""

    name: str
    description: str | None
    parameters: dict | None


@dataclass(frozen=True)
class ChatRequest:
    """A conversation to reply to, as kiln/chat.py takes it, with what constrains the reply. `tools` come
    from `function_tools`; `tool_choice` is "none" | "auto" | "required" | "function" (`tool_function` names
    it; None: "auto" with tools, else "none"); `parallel_tool_calls` None: the model's default; `format` is the output
    format's constraint, not yet compiled. `messages_param` and `format_param` name the request's fields of the
    conversation and of the output format."""

    messages: list[Message]
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str | None = None
    tool_function: str | None = None
    parallel_tool_calls: bool | None = None
    format: Constraint | None = None
    stop: tuple[str, ...] = ()
    template_kwargs: Mapping[str, object] | None = None
    messages_param: str = "messages"
    format_param: str = "response_format"


def function_tools(specs: Sequence[FunctionSpec], schema_param: str) -> list[Tool]:
    """The request's function tools, each one's parameters schema checked (refused naming
    `schema_param.format(index=i)`) and made as Kiln generates it; repeated names are refused."""
    tools = [Tool(spec.name, spec.description or "", None if spec.parameters is None
                  else as_generated(spec.parameters, schema_param.format(index=index)))
             for index, spec in enumerate(specs)]
    check_names(tools)
    for index, tool in enumerate(tools):
        checked(Constraint.json_schema(tool.schema, schema_param.format(index=index)))
    return tools


def checked(constraint: Constraint | None) -> Constraint | None:
    """The constraint, once it is known to compile (an error names its request field)."""
    if constraint is not None:
        constraint.check()
    return constraint


class ChatPlanner:
    """The served model's ways with chat: its chat format (`--chat-format`), tool-call syntax, whether it
    thinks first, and whether it calls several tools in one reply when a request does not say."""

    def __init__(self, tokenizer: Tokenizer, chat_format_name: str, shipped: GenerationDefaults) -> None:
        self.tokenizer = tokenizer
        self.form = chat_format(tokenizer, chat_format_name)  # kiln/chat.py
        self.syntax = syntax_for(tokenizer)  # kiln/tool_syntax.py
        self.reasoning = not self.form.transcript and thinks(tokenizer.chat_template)
        # parallel_tool_calls unset: several calls a reply only for a model trained to call tools; one that was
        # not (told its tools in Kiln's text) repeats its call until max_tokens, so its reply ends after one
        self.parallel_calls = not self.form.transcript and knows_tools(tokenizer)
        self.shipped = shipped  # the model's generation_config.json

    def plan(self, request: ChatRequest) -> Plan:
        """tool_choice and the format checked (each error names its field), then the constraint the reply
        must match and the prompt with the callable tools rendered."""
        tools = request.tools
        choice = self._tool_choice(request)
        plain = checked(request.format)
        rules = grammar(tools, choice, _schema_of(plain), self.syntax, self.tokenizer) if tools else None
        room = MAX_STOP_STRINGS - len(self.form.stop)
        if len(request.stop) > room:
            raise InvalidArgumentError(f"at most {room} stop strings: the {self.form.name} chat format adds its "
                                       f"own {len(self.form.stop)}", "stop")
        with naming(request.messages_param):  # text the tokenizer refuses (a lone surrogate) came from the messages
            text, add_bos = prompt_for_chat(request.messages, self.tokenizer, tools if rules is not None else (),
                                            self.form, request.template_kwargs)
            prompt = self.tokenizer.encode(text, add_bos)
        opened = self.reasoning and opened_in(text)
        if self.reasoning and (rules is not None or plain is not None):  # it thinks first, then answers as constrained
            rules = with_thought(rules or f"start: {json_rule(_schema_of(plain))}", opened)
        constraint = plain if rules is None else Constraint.grammar(rules, "tools" if tools else request.format_param)
        return Plan([prompt], [(text, add_bos)], constraint, calls=bool(tools) and choice.calls_allowed,
                    form=self.form, reasoning=self.reasoning, thinking_opened=opened)

    def sampling(self, request: GenerateRequest, plan: Plan, stop: Sequence[str] = ()) -> GenerateRequest:
        """What the request leaves out, the model's generation_config.json may set (as vLLM does), else
        OpenAI's defaults; the chat format's stop rule and default reply limit end every reply."""
        filled = OPENAI_DEFAULTS.fill(self.shipped.fill(request))
        return replace(filled, stop=(*stop, *plan.form.stop),
                       max_tokens=plan.form.max_tokens if filled.max_tokens is None else filled.max_tokens)

    def choice_text(self, plan: Plan, chat: bool = True, echo: str = "") -> ChoiceText:
        """A fresh reader of one choice's text."""
        lead = " " if plan.form.transcript else ""
        reasoning = ReasoningSplitter(plan.thinking_opened) if plan.reasoning else None
        parser = ToolCallParser(self.syntax) if plan.calls else None
        return ChoiceText(chat, parser, echo, lead, reasoning, self.syntax)

    def decoder(self, plan: Plan) -> Callable[[Sequence[int]], str]:
        """Token ids to the reply's text, keeping the call syntax's control tokens when it may call tools."""
        return markup_decoder(self.tokenizer, self.syntax) if plan.calls else self.tokenizer.decode

    def _tool_choice(self, request: ChatRequest) -> ToolChoice:
        """tool_choice and parallel_tool_calls as a ToolChoice; naming a function not in the tools, or
        choosing tools when there are none, is refused."""
        parallel = self.parallel_calls if request.parallel_tool_calls is None else request.parallel_tool_calls
        choice, tools = request.tool_choice, request.tools
        if choice is None:
            return ToolChoice("auto" if tools else "none", parallel=parallel)
        if not tools and choice != "none":
            raise InvalidArgumentError("tool_choice needs tools", "tool_choice")
        if choice != "function":
            return ToolChoice(choice, parallel=parallel)
        if request.tool_function not in {tool.name for tool in tools}:
            raise InvalidArgumentError(f"tool_choice names the function {request.tool_function!r}, which is not in "
                                       "tools", "tool_choice")
        return ToolChoice("function", request.tool_function, parallel)


def _schema_of(constraint: Constraint | None) -> dict | None:
    """The JSON schema a non-call reply must match (the output format), for the tool grammar."""
    if constraint is None:
        return None
    return ANY_OBJECT if constraint.kind == "json_object" else json.loads(constraint.source)


@dataclass
class ChoiceText:
    """One choice's text as the API shows it: `push` turns text that became final into pieces (a
    completion's {"text"}; in chat {"content"}, {"reasoning_content"} or {"tool_calls": [call]}: a call's
    start with its index, id and name, then its arguments' deltas), `finish` flushes what was held back.
    The same pieces build a streamed reply and a whole one."""

    chat: bool
    parser: ToolCallParser | None = None  # chat with callable tools
    prefix: str = ""  # echo: the prompt, before the first piece
    lead: str = ""  # what the chat format puts before every reply (a transcript's space): not content
    reasoning: ReasoningSplitter | None = None  # a reasoning model's chat: its thinking is reasoning_content
    syntax: ToolSyntax = KILN
    call_ids: list[str] = field(default_factory=list)

    def push(self, text: str) -> list[dict]:
        if self.prefix:
            text, self.prefix = self.prefix + text, ""
        if self.reasoning is None:
            return self._answer(text)
        thinking, text = self.reasoning.push(text)
        return ([{"reasoning_content": thinking}] if thinking else []) + self._answer(text)

    def _answer(self, text: str) -> list[dict]:
        if self.parser is None:
            return [self._text(text)] if text else []
        return [self._piece(delta) for delta in self.parser.push(text)]

    def finish(self, reason: str) -> list[dict]:
        """The pieces held back until the generation ended for `reason`."""
        pieces = self.push("")
        if self.reasoning is not None:
            thinking, text = self.reasoning.finish()
            pieces += ([{"reasoning_content": thinking}] if thinking else []) + self._answer(text)
        return pieces + ([self._piece(delta) for delta in self.parser.finish(reason == "stop")] if self.parser else [])

    def ended(self) -> bool:
        """The reply is over before the generation is: the model repeated a tool call."""
        return self.parser is not None and self.parser.repeated

    def finish_reason(self, reason: str) -> str:
        """A reply of whole calls ends with "tool_calls", even when max_tokens cut the generation while
        it was repeating one (held back, never shown) or had not yet started another."""
        complete = reason == "stop" or (reason == "length" and self.parser is not None and self.parser.calls_complete)
        return "tool_calls" if complete and self.call_ids else reason

    def _text(self, text: str) -> dict:
        if not self.chat:
            return {"text": text}
        text, self.lead = text.removeprefix(self.lead), ""
        return {"content": text}

    def _piece(self, delta: ContentDelta | CallStart | ArgumentsDelta) -> dict:
        if isinstance(delta, ContentDelta):
            return self._text(delta.text)
        if isinstance(delta, CallStart):
            self.call_ids.append(self.syntax.call_id())
            call = {"index": delta.index, "id": self.call_ids[-1], "type": "function",
                    "function": {"name": delta.name, "arguments": ""}}
        else:
            call = {"index": delta.index, "function": {"arguments": delta.text}}
        return {"tool_calls": [call]}
