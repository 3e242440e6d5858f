"""How a model writes tool calls: one syntax per model family, chosen from its chat template or vocabulary.

A reply that calls tools is `opening`, then calls separated by `separator`, then `closing`; each call
is `call_open`, a JSON object {"name": ..., <arguments_key>: {...}} (or, where the family writes the name
outside the object, the name, `name_separator` and the arguments' object), `call_close`:

- hermes (Qwen 2.5 / Qwen 3, Hermes, SmolLM3, and Kiln's own format for models without one):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call;
- llama3 (Llama 3.1 / 3.2): the bare object with "parameters", calls separated by "; ", optionally
  after `<|python_tag|>` (read, never written);
- mistral (Mistral 7B v0.3, Nemo, Small 3.1): `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`;
- mistral-args (Mistral Small 3.2, Ministral 3, Magistral, Devstral: their `[ARGS]` control token):
  `[TOOL_CALLS]f[ARGS]{...}` per call, no separator;
- phi4 (Phi-4-mini): `<|tool_call|>{"name": "f", "arguments": {...}}<|/tool_call|>`, one per call.

`SYNTAXES` is the one table: the first syntax one of whose markers is in the chat template, or all of
whose control tokens are in the vocabulary, is the model's; a model with neither writes hermes (`KILN`).
"""

from __future__ import annotations

import functools
import re
import secrets
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kiln.tokenizer import Tokenizer

CALL_HEADER = '{"name": "'  # how a call object begins: a reply that gets here is a call
NAME_CHARS = "[A-Za-z0-9_-]"  # what a function name is made of
_OBJECT_HEADER = re.compile(rf'\{{"name": "({NAME_CHARS}+)", "(?:arguments|parameters)": ')
_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolSyntax:
    """One family's tool-call text (see the module docstring). `special`: the markup that is one
    control token in the family's vocabularies (the grammar must emit that token, not its spelling)."""

    name: str
    markers: tuple[str, ...]
    call_open: str = ""
    call_close: str = ""
    separator: str = ""
    opening: str = ""
    closing: str = ""
    arguments_key: str = "arguments"
    read_prefixes: tuple[str, ...] = ()  # what may precede `opening` in a reply without being written by Kiln
    special: tuple[str, ...] = ()
    call_id_length: int = 0  # > 0: the family's templates demand call ids of exactly this many letters and digits
    name_separator: str = ""  # set: the name is written before the arguments' object, this between them

    @property
    def call_header(self) -> str:
        """What every call begins with after `call_open`: a reply that gets this far is a call."""
        return "" if self.name_separator else CALL_HEADER

    @functools.cached_property
    def header(self) -> re.Pattern[str]:
        """Matches a call's text (after `call_open`) up to where its arguments' object begins; group 1 is
        the name."""
        if not self.name_separator:
            return _OBJECT_HEADER
        return re.compile(f"({NAME_CHARS}+){re.escape(self.name_separator)}")

    @property
    def lead(self) -> str:
        """What a reply that is calls begins with, up to the first call's object."""
        return self.opening + self.call_open

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the model writes it; `arguments` is JSON text of an object."""
        if self.name_separator:
            return f"{self.call_open}{name}{self.name_separator}{arguments}{self.call_close}"
        return f'{self.call_open}{CALL_HEADER}{name}", "{self.arguments_key}": {arguments}}}{self.call_close}'

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """Calls (name, arguments JSON text) as one reply writes them."""
        return self.opening + self.separator.join(self.call_text(*call) for call in calls) + self.closing

    def call_id(self) -> str:
        """A new id for a call the model made, in the form the family's templates accept back."""
        if self.call_id_length:
            return "".join(secrets.choice(_ID_ALPHABET) for _ in range(self.call_id_length))
        return "call_" + secrets.token_hex(12)


HERMES = ToolSyntax("hermes", ("<tool_call>",), call_open="<tool_call>\n", call_close="\n</tool_call>", separator="\n")
LLAMA3 = ToolSyntax("llama3", ("<|python_tag|>", '"parameters": '), separator="; ", arguments_key="parameters",
                    read_prefixes=("<|python_tag|>",), special=("<|python_tag|>",))
MISTRAL = ToolSyntax("mistral", ("[TOOL_CALLS]",), separator=", ", opening="[TOOL_CALLS][", closing="]",
                     special=("[TOOL_CALLS]",), call_id_length=9)
MISTRAL_ARGS = ToolSyntax("mistral-args", ("'[ARGS]'", '"[ARGS]"'), call_open="[TOOL_CALLS]", name_separator="[ARGS]",
                          special=("[TOOL_CALLS]", "[ARGS]"), call_id_length=9)
PHI4 = ToolSyntax("phi4", ("<|tool_call|>", "<|tool|>"), call_open="<|tool_call|>", call_close="<|/tool_call|>",
                  special=("<|tool_call|>", "<|/tool_call|>"))
# the more specific first: a Mistral template with [ARGS] also writes [TOOL_CALLS], a Llama one may mention <tool_call>
SYNTAXES = (MISTRAL_ARGS, MISTRAL, PHI4, LLAMA3, HERMES)
KILN = HERMES  # for models without a tool format of their own


def syntax_for(tokenizer: Tokenizer) -> ToolSyntax:
    """The tool-call syntax of the model whose tokenizer (and chat template) this is."""
    template = tokenizer.chat_template or ""
    for syntax in SYNTAXES:
        if any(marker in template for marker in syntax.markers):
            return syntax
    for syntax in SYNTAXES:
        if syntax.special and all(tokenizer.token_to_id(token) is not None for token in syntax.special):
            return syntax
    return KILN



def control_token_id(tokenizer: Tokenizer, text: str) -> int | None:
    """The id of the control (special) token spelled `text`, if the vocabulary has one: text the
    model writes as that one token, which decoding for display would drop."""
    token_id = tokenizer.token_to_id(text)
    added = tokenizer.backend.get_added_tokens_decoder().get(token_id) if token_id is not None else None
    return token_id if added is not None and added.special else None


def markup_decoder(tokenizer: Tokenizer, syntax: ToolSyntax) -> Callable[[Sequence[int]], str]:
    """A decode for replies that may call tools: like tokenizer.decode (control tokens dropped), but
    keeping the syntax's own control tokens, which the parser reads ([TOOL_CALLS], <|tool_call|>)."""
    kept = {control_token_id(tokenizer, token) for token in syntax.special} - {None}
    if not kept:
        return tokenizer.decode
    hidden = {token_id for token_id, added in tokenizer.backend.get_added_tokens_decoder().items()
              if added.special and token_id not in kept}

    def decode(token_ids: Sequence[int]) -> str:
        return tokenizer.decode([t for t in token_ids if t not in hidden], skip_special_tokens=False)

    return decode
