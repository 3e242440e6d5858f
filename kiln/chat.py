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

Tools, assistant tool calls and tool results go to a template that handles tools (it uses `tools`)
as transformers passes them. Any other rendering gets them as text (kiln/tools.py): the tool
definitions as a system message, calls as `<tool_call>` blocks in the assistant's turn, results as
`<tool_response>` blocks in a user turn.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln.errors import InvalidArgumentError
from kiln.tokenizer import Tokenizer
from kiln.tools import Tool, call_text, tool_response_text, tools_prompt

GEMMA_START, GEMMA_END = "<start_of_turn>", "<end_of_turn>"
ROLE_NAMES = {"assistant": "model", "model": "model", "user": "user", "system": "user"}
OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_MESSAGE_FIELDS = {"assistant": frozenset({"role", "content", "name", "tool_calls", "refusal"}),
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
                    form: ChatFormat | None = None) -> list[int]:
    """Token ids of a whole conversation (messages as from_openai_messages makes them), ending with the
    opening of the model's reply. `tools`: the functions the model may call. `form`: the chat format
    (None: `auto` for this tokenizer)."""
    messages = list(messages)
    form = form or chat_format(tokenizer)
    if form.transcript:
        return tokenizer.encode(_transcript(as_text_messages(messages, tools)), add_special_tokens=True)
    template = tokenizer.chat_template
    if template and ("tools" in template or not (tools or any(_has_tool_parts(m) for m in messages))):
        # the template writes BOS itself, exactly as transformers' apply_chat_template does
        return tokenizer.encode(render_template(template, messages, tokenizer, tools), add_special_tokens=False)
    messages = as_text_messages(messages, tools)
    if template:
        return tokenizer.encode(render_template(template, messages, tokenizer), add_special_tokens=False)
    text = "".join(_turn_text(m["role"], m["content"], tokenizer) for m in messages) + _reply_prefix(tokenizer)
    return tokenizer.encode(text, add_special_tokens=True)


def as_text_messages(messages: Sequence[Message], tools: Sequence[Tool] = ()) -> list[dict[str, str]]:
    """The conversation with tools, calls and results written out as text (kiln/tools.py's format),
    for renderings that know nothing of tools."""
    plain = []
    for message in messages:
        content = str(message["content"] or "")
        if message["role"] == "tool":
            plain.append({"role": "user", "content": tool_response_text(content)})
            continue
        calls = [call_text(call["function"]["name"], json.dumps(call["function"]["arguments"], ensure_ascii=False))
                 for call in message.get("tool_calls") or ()]  # type: ignore[attr-defined]
        plain.append({"role": str(message["role"]), "content": "\n".join([content, *calls] if content else calls)})
    if tools:
        plain.insert(0, {"role": "system", "content": tools_prompt(tools)})
    return plain


def _has_tool_parts(message: Message) -> bool:
    return message["role"] == "tool" or bool(message.get("tool_calls"))


def render_template(template: str, messages: list[Message], tokenizer: Tokenizer, tools: Sequence[Tool] = ()) -> str:
    """A jinja chat template rendered for generation (with `tools` as OpenAI function definitions when
    there are any). Template errors (including the template's own raise_exception, e.g. for a role
    order it refuses) are INVALID_ARGUMENT."""
    try:
        return _compiled(template).render(
            messages=messages,
            tools=[{"type": "function", "function": tool.definition()} for tool in tools] or None,
            add_generation_prompt=True,
            bos_token=_token_text(tokenizer, tokenizer.bos_token_id),
            eos_token=_token_text(tokenizer, tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None),
        )
    except jinja2.TemplateError as error:
        raise InvalidArgumentError(f"the model's chat template refused the conversation: {error}") from None


def from_openai_messages(messages: Iterable[object]) -> list[Message]:
    """OpenAI chat messages as {role, content} dicts. Content may be a string or a list of text parts
    (joined); `developer` is a system message; `name` is dropped. Assistant messages keep their
    `tool_calls` (arguments parsed into objects, as chat templates expect them) and tool messages their
    `tool_call_id`. Anything else (images, audio) is refused, never silently dropped."""
    return [_plain_message(index, message) for index, message in enumerate(messages)]


def _plain_message(index: int, message: object) -> Message:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise InvalidArgumentError(f"{where} must be an object with role and content", where)
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
                                                extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return environment.from_string(template)
    except jinja2.TemplateError as error:
        raise InvalidArgumentError(f"the model's chat template does not compile: {error}") from None


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None, separators: object = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)
