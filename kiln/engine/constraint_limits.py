"""Limits on what a constraint may ask of llguidance, checked on its source text before anything compiles.

llguidance compiles grammars recursively (a chain of rules or `$ref`s overflows a thread's stack: the
process dies), expands counted repetitions into lexer states (`a{1000}{1000}` takes seconds and hundreds
of MB, then fails on the first token) and parses schemas with a 128-level nesting limit. Each limit here
is a measured, comfortable distance inside what works (bench/README.md § design figures), and a source
over one is refused with InvalidArgumentError naming the limit and the value, before it reaches
llguidance. What the source text cannot tell (a compile that takes too long, a grammar with no complete
text) is caught when it compiles (kiln/engine/compile_threads.py, kiln/engine/constraints.py).

What each limit counts:
- `max_source_chars`: characters of the schema (as JSON text), regex or Lark grammar;
- `max_rules`: Lark rule and terminal definitions plus `$ref`s (each can add a link to a chain the
  compiler walks recursively);
- `max_schema_depth`: nesting of a JSON schema's document (every object and array is a level);
- `max_repeat_product`: the largest product of nested counted repetitions (`{m,n}` counts n, `{m,}` m);
- `max_repeat_size`: a regex's atoms once every counted repetition is unrolled (alternatives summed).
Regexes are a regex constraint, each `/.../` literal of a Lark grammar and each `pattern` of a schema
(a Lark grammar's `%json` schemas included).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import NoReturn

from kiln.errors import InvalidArgumentError


@dataclass(frozen=True)
class ConstraintLimits:
    """The limits one process applies (LIMITS); what each counts is in the module docstring."""

    max_source_chars: int = 256 * 1024
    max_rules: int = 2_000
    max_schema_depth: int = 64
    max_repeat_product: int = 10_000
    max_repeat_size: int = 20_000


LIMITS = ConstraintLimits()

# A Lark definition starts a line: `name:`, `?name:`, `!name:`, `NAME.2:`, `name[attributes]:`.
_LARK_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?\d+)?(?:\[[^\]\n]*\])?[ \t]*:", re.MULTILINE)
_LARK_REF = re.compile(r'"\$ref"')
_LARK_JSON = re.compile(r"%json\s*")
_COUNT = re.compile(r"\{(\d*)(?:(,)(\d*))?\}")


def check_source(kind: str, source: str, param: str, limits: ConstraintLimits = LIMITS) -> None:
    """Raises InvalidArgumentError naming `param`, the limit and the value if `source` (a constraint of
    `kind`: json_schema as JSON text, json_object, regex or grammar) exceeds one of `limits`."""
    _at_most(param, "characters", len(source), limits.max_source_chars, "max_source_chars")
    if kind == "regex":
        check_regex(source, param, limits)
    elif kind == "grammar":
        rules = len(_LARK_DEFINITION.findall(source)) + len(_LARK_REF.findall(source))
        _at_most(param, "rules (definitions and $refs)", rules, limits.max_rules, "max_rules")
        for literal in lark_regexes(source):
            check_regex(literal, param, limits)
        for schema in lark_schemas(source, param, limits):  # their nesting is llguidance's to refuse (past 128)
            check_schema(schema, param, limits, check_depth=False)
    elif kind == "json_schema":
        check_schema(parse_schema(source, param, limits), param, limits)


def parse_schema(text: str, param: str, limits: ConstraintLimits = LIMITS) -> object:
    """A JSON schema's text parsed, after its size is checked; a nesting too deep for the parser is
    refused as over max_schema_depth."""
    _at_most(param, "characters", len(text), limits.max_source_chars, "max_source_chars")
    try:
        return json.loads(text)
    except RecursionError:
        _refuse(param, "nesting depth", limits.max_schema_depth + 1, limits.max_schema_depth, "max_schema_depth")
    except ValueError as error:
        raise InvalidArgumentError(f"{param} is not valid JSON: {error}", param or None) from None


def check_schema(schema: object, param: str, limits: ConstraintLimits = LIMITS, check_depth: bool = True) -> None:
    """The limits of a JSON schema given as a parsed document: nesting depth (walked without recursion,
    so any depth is measured safely; not for the schemas a grammar embeds, which Kiln's tool grammar
    nests a few levels deeper than the tools' own), `$ref`s and each `pattern`'s repetitions."""
    refs = 0
    for depth, key, value in _walk(schema):
        if check_depth:
            _at_most(param, "nesting depth", depth, limits.max_schema_depth, "max_schema_depth")
        if key == "$ref":
            refs += 1
        elif key == "pattern" and isinstance(value, str):
            check_regex(value, param, limits)
        elif key == "patternProperties" and isinstance(value, Mapping):
            for pattern in value:
                check_regex(str(pattern), param, limits)
    _at_most(param, "rules ($refs)", refs, limits.max_rules, "max_rules")


def _walk(document: object) -> Iterator[tuple[int, object, object]]:
    """(depth, key, value) of every member of a JSON document, depth-first, without recursion; the
    top-level container is at depth 1."""
    stack: list[tuple[int, object, object]] = [(0, None, document)]
    while stack:
        depth, key, value = stack.pop()
        if isinstance(value, Mapping | list):
            depth += 1
            members = value.items() if isinstance(value, Mapping) else enumerate(value)
            stack.extend((depth, member_key, member) for member_key, member in members)
        yield depth, key, value


def check_regex(pattern: str, param: str, limits: ConstraintLimits = LIMITS) -> None:
    """Refuses a regex whose counted repetitions are over max_repeat_product or max_repeat_size."""
    product, size = repetition(pattern)
    _at_most(param, "nested repetition count product", product, limits.max_repeat_product, "max_repeat_product")
    _at_most(param, "expanded regex size", size, limits.max_repeat_size, "max_repeat_size")


def repetition(pattern: str) -> tuple[int, int]:
    """(largest product of nested counted repetitions, size once they are unrolled) of a regex, from
    its text: groups, alternatives, classes and escapes are told apart; everything else is an atom of
    size 1. `*`, `+` and `?` count once (a loop, not a copy). Overcounts rather than under."""
    frames = [_Group()]
    last = (0, 1)  # the preceding item: (its size, its repetition product)
    i = 0
    while i < len(pattern):
        char, top = pattern[i], frames[-1]
        count = _COUNT.match(pattern, i) if char == "{" else None
        if char == "(":
            frames.append(_Group())
            last, i = (0, 1), i + 1
        elif char == ")" and len(frames) > 1:
            group = frames.pop()
            last = (group.size, group.product)
            frames[-1].add(*last)
            i += 1
        elif char == "|":
            top.alternative()
            last, i = (0, 1), i + 1
        elif count is not None:
            times = max(int(count.group(3) or count.group(1) or 0), 1)
            top.current += last[0] * (times - 1)
            last = (last[0] * times, last[1] * times)
            top.product = max(top.product, last[1])
            i = count.end()
        elif char in "*+?":
            i += 1
        else:
            last, i = (1, 1), _atom_end(pattern, i)
            top.add(*last)
    while len(frames) > 1:  # unbalanced: close what is open (the compiler reports the syntax error)
        group = frames.pop()
        frames[-1].add(group.size, group.product)
    return frames[0].product, frames[0].size


@dataclass
class _Group:
    """A regex group being measured: the size of its current alternative, of its largest finished one,
    and the largest repetition product inside it."""

    current: int = 0
    largest: int = 0
    product: int = 1

    def add(self, size: int, product: int) -> None:
        self.current += size
        self.product = max(self.product, product)

    def alternative(self) -> None:
        self.largest, self.current = max(self.largest, self.current), 0

    @property
    def size(self) -> int:
        return max(self.largest, self.current)


def _atom_end(pattern: str, i: int) -> int:
    """Index after the atom at `i`: an escape (with `\\p{..}`-style braces), a class `[...]` or one character."""
    if pattern[i] == "\\":
        if pattern[i + 1 : i + 2] in ("p", "P", "x", "u") and pattern[i + 2 : i + 3] == "{":
            close = pattern.find("}", i)
            return len(pattern) if close < 0 else close + 1
        return i + 2
    if pattern[i] == "[":
        j = i + 1
        if pattern[j : j + 1] == "^":
            j += 1
        if pattern[j : j + 1] == "]":
            j += 1
        while j < len(pattern) and pattern[j] != "]":
            j += 2 if pattern[j] == "\\" else 1
        return j + 1
    return i + 1


def lark_regexes(grammar: str) -> Iterator[str]:
    """The `/.../` regex literals of a Lark grammar, skipping strings and `//` comments."""
    i = 0
    while i < len(grammar):
        char = grammar[i]
        if char == '"':
            i = _skip_quoted(grammar, i, '"')
        elif grammar.startswith("//", i):
            end = grammar.find("\n", i)
            i = len(grammar) if end < 0 else end
        elif char == "/":
            end = _skip_quoted(grammar, i, "/")
            yield grammar[i + 1 : end - 1]
            i = end
        else:
            i += 1


def lark_schemas(grammar: str, param: str, limits: ConstraintLimits = LIMITS) -> Iterator[object]:
    """The JSON schemas a Lark grammar embeds with `%json {...}`, parsed (one too deep for the parser
    is refused as over max_schema_depth; one that does not parse is left to the compiler to report)."""
    decoder = json.JSONDecoder()
    for match in _LARK_JSON.finditer(grammar):
        try:
            yield decoder.raw_decode(grammar, match.end())[0]
        except RecursionError:
            _refuse(param, "nesting depth", limits.max_schema_depth + 1, limits.max_schema_depth, "max_schema_depth")
        except ValueError:
            continue


def _skip_quoted(text: str, start: int, quote: str) -> int:
    """Index after the literal that opens with `quote` at `start` (backslash escapes honoured; in a
    regex literal, a class may hold the quote)."""
    i = start + 1
    while i < len(text) and text[i] != quote:
        i = _atom_end(text, i) if quote == "/" else i + (2 if text[i] == "\\" else 1)
    return i + 1


def _at_most(param: str, what: str, value: int, limit: int, name: str) -> None:
    if value > limit:
        _refuse(param, what, value, limit, name)


def _refuse(param: str, what: str, value: int, limit: int, name: str) -> NoReturn:
    raise InvalidArgumentError(f"{param} is over the {name} limit: {what} {value:,} > {limit:,}", param or None)
