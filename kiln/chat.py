"""Chat formatting: messages into token ids the way the model reads them best, so that a session's
history only ever grows by appending and a stateless chat request repeats the previous request's tokens
as its prefix.

The engine itself only sees token ids; this module sits beside it in the core because the OpenAI chat
endpoint and `kiln chat` both need it, and the core never imports the SDK (which may import this).

A chat format (`--chat-format`) says how a conversation is written:
- `template`: the model's own chat template. An instruct model ships one (`tokenizer.chat_template` in
  GGUF metadata, tokenizer_config.json or chat_template.jinja in an HF directory); it is rendered in a
  jinja2 sandbox, as transformers does. Without one, the vocabulary's turn tokens are used when it has
  Gemma's, else bare "Role: text" lines.
- `transcript`: for a base model, which continues text rather than answering turns: a short preamble
  (a system message's text when there is one), two example turns, then the conversation as
  "User: ...\nAssistant: ..." lines. The model answers once and then starts the next "User:" turn
  itself, which is where the reply stops (`ChatFormat.stop`).
- `auto` (the default): `template` when the model has a chat template, else `transcript`. The embedded
  Gemma 3 270M is a base model: it has none.

Tools, assistant tool calls and tool results reach a template the way it takes them (TemplateTools):
`tools=` and messages with `tool_calls` and role `tool` as transformers passes them (Qwen, Llama 3,
Mistral), SmolLM3's `xml_tools`, or Phi-4-mini's JSON in the system message. What a template does not
render itself is written as text: the tool definitions join the system message (kiln/tools.py), an
assistant's calls its text in the model's call syntax (kiln/tool_syntax.py), and a result goes to the
template's "tool" turn when it writes any role by name (SmolLM2), else into a user turn as a
`<tool_response>` block. `options` (chat_template_kwargs, e.g. Qwen 3's enable_thinking) are extra
template variables.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import jinja2
import jinja2.meta
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln.errors import InvalidArgumentError
from kiln.tokenizer import Tokenizer
from kiln.tool_syntax import KILN, ToolSyntax, syntax_for
from kiln.tools import Tool, tools_prompt

GEMMA_START, GEMMA_END = "<start_of_turn>", "<end_of_turn>"
ROLE_NAMES = {"assistant": "model", "model": "model", "user": "user", "system": "user"}
OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# The fields of OpenAI's message types, and the `annotations` of its replies, which clients send back with
# them. Refused when set, so no part of a conversation is dropped unseen: any other field, and an assistant's
# `audio` (an earlier spoken reply) or `function_call` (OpenAI's deprecated form of tool_calls).
_MESSAGE_FIELDS = {"assistant": frozenset({"role", "content", "name", "tool_calls", "refusal", "annotations",
                                           "reasoning_content"}),
                   "tool": frozenset({"role", "content", "tool_call_id", "name"})}
_TEXT_MESSAGE_FIELDS = frozenset({"role", "content", "name"})
Message = dict[str, object]  # {"role", "content"}, plus "tool_calls" (assistant) or "tool_call_id" (tool)


CHAT_FORMATS = ("auto", "template", "transcript")
TRANSCRIPT_PREAMBLE = "A conversation between a user and a helpful assistant, who answers in one or two short sentences."
TRANSCRIPT_EXAMPLES = ({"role": "user", "content": "What is the capital of Italy?"},
                       {"role": "assistant", "content": "The capital of Italy is Rome."},
                       {"role": "user", "content": "How many legs does a spider have?"},
                       {"role": "assistant", "content": "A spider has eight legs."})
TRANSCRIPT_ROLES = {"user": "User", "assistant": "Assistant", "system": "System"}
TRANSCRIPT_REPLY = "Assistant:"  # the reply follows after a space, which the reply's text does not keep
TRANSCRIPT_STOP = ("\n\nUser:", "\nUser:")  # the model opening the next user turn: its reply is over
TRANSCRIPT_MAX_TOKENS = 128  # a base model's answer that runs longer is rambling, not answering


@dataclass(frozen=True)
class ChatFormat:
    """How a conversation becomes a prompt (see the module docstring), and what ends a reply in it:
    `stop` strings and a default reply limit (`max_tokens`; None: the caller's usual default)."""

    name: str
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None

    @property
    def transcript(self) -> bool:
        return self.name == "transcript"


TEMPLATE = ChatFormat("template")
TRANSCRIPT = ChatFormat("transcript", TRANSCRIPT_STOP, TRANSCRIPT_MAX_TOKENS)


def chat_format(tokenizer: Tokenizer, requested: str = "auto") -> ChatFormat:
    """The format `requested` names; `auto` is `template` for a model with a chat template (an instruct
    model), `transcript` for one without (a base model)."""
    if requested not in CHAT_FORMATS:
        raise InvalidArgumentError(f"chat_format must be one of {', '.join(CHAT_FORMATS)}, got {requested!r}",
                                   "chat_format")
    if requested == "auto":
        return TEMPLATE if tokenizer.chat_template else TRANSCRIPT
    return TEMPLATE if requested == "template" else TRANSCRIPT


def _uses_gemma_turns(tokenizer: Tokenizer) -> bool:
    return tokenizer.token_to_id(GEMMA_START) is not None and tokenizer.token_to_id(GEMMA_END) is not None


def _turn_text(role: str, content: str, tokenizer: Tokenizer) -> str:
    """One complete turn in the model's turn tokens (or a bare "Role: text" line), ready to append."""
    if _uses_gemma_turns(tokenizer):
        return f"{GEMMA_START}{ROLE_NAMES.get(role, role)}\n{content}{GEMMA_END}\n"
    return f"{role.capitalize()}: {content}\n"


def _reply_prefix(tokenizer: Tokenizer) -> str:
    """What opens the model's turn; generation continues from here."""
    return f"{GEMMA_START}model\n" if _uses_gemma_turns(tokenizer) else "Assistant:"


def _transcript_turn(role: str, content: str) -> str:
    """A turn of a transcript; a blank line ends each exchange, as the model ends its reply."""
    return f"{TRANSCRIPT_ROLES.get(role, role.capitalize())}: {content}\n" + ("\n" if role == "assistant" else "")


def _transcript(messages: Sequence[dict[str, str]]) -> str:
    """A whole conversation as a transcript, ending where the model's reply begins. The leading system
    messages replace the preamble; a later one is a "System:" line."""
    leading = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    system = "\n\n".join(m["content"] for m in messages[:leading]) or TRANSCRIPT_PREAMBLE
    turns = [*TRANSCRIPT_EXAMPLES, *messages[leading:]]
    return f"{system}\n\n" + "".join(_transcript_turn(m["role"], m["content"]) for m in turns) + TRANSCRIPT_REPLY


def tokens_for_chat(messages: Iterable[Message], tokenizer: Tokenizer, tools: Sequence[Tool] = (),
                    form: ChatFormat | None = None, options: Mapping[str, object] | None = None) -> list[int]:
    """Token ids of a whole conversation (messages as from_openai_messages makes them), ending with the
    opening of the model's reply. `tools`: the functions the model may call. `form`: the chat format
    (None: `auto` for this tokenizer). `options`: extra variables for the chat template
    (chat_template_kwargs, such as Qwen 3's enable_thinking)."""
    return tokenizer.encode(*prompt_for_chat(messages, tokenizer, tools, form, options))


def prompt_for_chat(messages: Iterable[Message], tokenizer: Tokenizer, tools: Sequence[Tool] = (),
                    form: ChatFormat | None = None, options: Mapping[str, object] | None = None) -> tuple[str, bool]:
    """The conversation as text (tokens_for_chat's arguments), and whether encoding it adds BOS (a
    chat template writes BOS itself, exactly as transformers' apply_chat_template does)."""
    messages = list(messages)
    form = form or chat_format(tokenizer)
    if form.transcript:
        return _transcript(as_text_messages(messages, tools)), True
    if tokenizer.chat_template:
        return render_template(tokenizer.chat_template, messages, tokenizer, tools, options), False
    text = "".join(_turn_text(m["role"], m["content"], tokenizer) for m in as_text_messages(messages, tools))
    return text + _reply_prefix(tokenizer), True


def as_text_messages(messages: Sequence[Message], tools: Sequence[Tool] = (), syntax: ToolSyntax = KILN,
                     keep_calls: bool = False, keep_results: bool = False) -> list[Message]:
    """The conversation with tools, calls and results written out as text in `syntax`, for renderings
    that know nothing of them: the tool definitions join the system message, an assistant's calls its
    text, and a tool result becomes a user turn. `keep_calls` / `keep_results`: the rendering reads
    those as they are."""
    plain: list[Message] = []
    for message in messages:
        content = str(message["content"] or "")
        if message["role"] == "tool" and not keep_results:
            plain.append({"role": "user", "content": tool_result_text(content)})
        elif message.get("tool_calls") and not keep_calls:
            calls = [(call["function"]["name"], json.dumps(call["function"]["arguments"], ensure_ascii=False))
                     for call in message["tool_calls"]]  # type: ignore[attr-defined]
            written = syntax.calls_text(calls)
            plain.append({**{k: v for k, v in message.items() if k != "tool_calls"},
                          "content": f"{content}\n{written}" if content else written})
        else:
            plain.append(message)
    return _with_system_text(plain, tools_prompt(tools, syntax)) if tools else plain


def tool_result_text(content: str) -> str:
    """A tool's result as a model whose template has no tool role reads it: a user turn."""
    return f"<tool_response>\n{content}\n</tool_response>"


def _with_system_text(messages: list[Message], text: str) -> list[Message]:
    """`text` added to the leading system message, or as one."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


@dataclass(frozen=True)
class TemplateTools:
    """How one chat template takes tools, read from its text: as transformers passes them (`tools`),
    as SmolLM3's `xml_tools`, in the system message's `tools` field (Phi-4-mini), or not at all (then
    as Kiln's text). Calls it does not render itself are written in the assistant's text in the model's
    syntax; results go to its "tool" role when it has one or writes any role by name, else into a user
    turn."""

    variables: frozenset[str]
    renders_calls: bool
    renders_results: bool
    system_field: bool

    @property
    def takes_tools(self) -> bool:
        return bool({"tools", "xml_tools"} & self.variables) or self.system_field

    @classmethod
    @functools.lru_cache(maxsize=8)
    def of(cls, template: str) -> TemplateTools:
        variables = frozenset(jinja2.meta.find_undeclared_variables(_compiled(template).environment.parse(template)))
        renders_calls = "tool_calls" in template
        renders_results = renders_calls or bool(_TOOL_ROLE.search(template) or _ANY_ROLE.search(template))
        return cls(variables, renders_calls, renders_results, bool(_SYSTEM_TOOLS.search(template)))


def knows_tools(tokenizer: Tokenizer) -> bool:
    """Whether the model's chat template takes tool definitions (its model was trained to call tools),
    rather than being told them in Kiln's text."""
    return bool(tokenizer.chat_template) and TemplateTools.of(tokenizer.chat_template).takes_tools


_TOOL_ROLE = re.compile(r"""==\s*['"]tool['"]""")  # the template handles role "tool" itself
# the template writes any role as its name (SmolLM2's "<|im_start|>" + role): a tool result reads best in its own
# "tool" turn there; shown as a user turn in <tool_response> markup, a small model copies the markup into its answer
_ANY_ROLE = re.compile(r"""\+\s*\w+\s*(\.role\b|\[\s*['"]role['"]\s*\])\s*\+""")
_SYSTEM_TOOLS = re.compile(r"""message\s*(\.tools\b|\[\s*['"]tools['"]\s*\])""")
PHI_TOOLS_SYSTEM = "You are a helpful assistant with some tools."  # Phi-4-mini's own system text for tools


def template_variables(messages: list[Message], tools: Sequence[Tool], form: TemplateTools,
                       syntax: ToolSyntax) -> dict[str, object]:
    """The messages and tools as `form` takes them (render_template's variables)."""
    definitions = [tool.definition() for tool in tools]
    messages = as_text_messages(messages, (), syntax, form.renders_calls, form.renders_results)
    if not tools:
        return {"messages": messages}
    if "tools" in form.variables:
        return {"messages": messages, "tools": [{"type": "function", "function": d} for d in definitions]}
    if "xml_tools" in form.variables:
        return {"messages": messages, "xml_tools": definitions}
    if form.system_field:
        if not messages or messages[0]["role"] != "system":
            messages = [{"role": "system", "content": PHI_TOOLS_SYSTEM}, *messages]
        return {"messages": [{**messages[0], "tools": json.dumps(definitions, ensure_ascii=False)}, *messages[1:]]}
    return {"messages": as_text_messages(messages, tools, syntax, True, True)}


def render_template(template: str, messages: list[Message], tokenizer: Tokenizer, tools: Sequence[Tool] = (),
                    options: Mapping[str, object] | None = None) -> str:
    """A jinja chat template rendered for generation, with the tools, calls and results given the way
    this template takes them (TemplateTools) and `options` as extra variables (chat_template_kwargs).
    Template errors (including the template's own raise_exception, e.g. for a role order it refuses)
    are INVALID_ARGUMENT."""
    variables = {**(options or {}), **template_variables(messages, tools, TemplateTools.of(template), syntax_for(tokenizer)),
                 "add_generation_prompt": True, "bos_token": _token_text(tokenizer, tokenizer.bos_token_id),
                 "eos_token": _token_text(tokenizer, tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None)}
    try:
        return _compiled(template).render(**variables)
    except jinja2.TemplateError as error:
        raise InvalidArgumentError(f"the model's chat template refused the conversation: {error}") from None


def from_openai_messages(messages: Iterable[object]) -> list[Message]:
    """OpenAI chat messages as {role, content} dicts. Content may be a string or a list of text parts
    (joined); `developer` is a system message; `name`, `refusal` and `annotations` are dropped, and a
    field set to null is one left out. Assistant messages keep their `tool_calls` (arguments parsed into
    objects, as chat templates expect them) and tool messages their `tool_call_id`. Anything else
    (images, audio) is refused, never silently dropped."""
    return [_plain_message(index, message) for index, message in enumerate(messages)]


def _plain_message(index: int, message: object) -> Message:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise InvalidArgumentError(f"{where} must be an object with role and content", where)
    message = {key: value for key, value in message.items() if value is not None}
    role = message.get("role")
    if not isinstance(role, str) or role not in OPENAI_ROLES:
        raise InvalidArgumentError(f"{where}: role must be one of {', '.join(OPENAI_ROLES)}, got {role!r}", f"{where}.role")
    unsupported = sorted(set(message) - _MESSAGE_FIELDS.get(role, _TEXT_MESSAGE_FIELDS))
    if unsupported:
        raise InvalidArgumentError(f"{where}: unsupported field(s) {', '.join(unsupported)} for a {role} message "
                                   "(Kiln chats in text)", f"{where}.{unsupported[0]}")
    calls = message.get("tool_calls")
    content = message.get("content")
    plain: Message = {"role": OPENAI_ROLES[role],
                      "content": "" if content is None and calls else _text_content(where, content)}
    if calls:
        plain["tool_calls"] = [_tool_call(f"{where}.tool_calls[{i}]", call) for i, call in enumerate(_list(where, calls))]
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise InvalidArgumentError(f"{where}: a tool message needs a string tool_call_id", f"{where}.tool_call_id")
        plain["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("reasoning_content"), str):  # a reasoning model's earlier thinking, for its template
        plain["reasoning_content"] = message["reasoning_content"]
    return plain


def _list(where: str, calls: object) -> list:
    if not isinstance(calls, list):
        raise InvalidArgumentError(f"{where}.tool_calls must be an array", f"{where}.tool_calls")
    return calls


def _tool_call(where: str, call: object) -> dict:
    """An assistant's earlier call, {"id", "type": "function", "function": {"name", "arguments": {...}}}."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidArgumentError(f"{where} must be {{type: function, function: {{name, arguments}}}}", where)
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except (TypeError, ValueError):
        arguments = None
    if not isinstance(arguments, dict):
        raise InvalidArgumentError(f"{where}.function.arguments must be a JSON object as text", f"{where}.function.arguments")
    return {"id": str(call.get("id", "")), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _text_content(where: str, content: object) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgumentError(f"{where}: content must be a string or a list of text parts", f"{where}.content")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text":
            raise InvalidArgumentError(f"{where}: content part of type {kind!r} is not supported; only text parts are",
                                       f"{where}.content")
        if not isinstance(part.get("text"), str):
            raise InvalidArgumentError(f"{where}: a text part needs a string `text`", f"{where}.content")
        texts.append(part["text"])
    return "".join(texts)


def _token_text(tokenizer: Tokenizer, token_id: int | None) -> str:
    return "" if token_id is None else tokenizer.id_to_token(token_id) or ""


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    """Compiled once per template, in the environment transformers uses for chat templates."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols", _Generation])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return environment.from_string(template)
    except jinja2.TemplateError as error:
        raise InvalidArgumentError(f"the model's chat template does not compile: {error}") from None


class _Generation(Extension):
    """transformers' `{% generation %}…{% endgeneration %}` (it marks the assistant's tokens for
    training; SmolLM3's template uses it): the block renders as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None, separators: object = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)
