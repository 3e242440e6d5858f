"""Hypothesis strategies for structured-output fields: JSON schemas, regular expressions and Lark grammars
(llguidance's dialect), from ordinary to pathological: deep nesting, huge enums, recursive `$ref`s,
nested counted repetition, catastrophic-backtracking patterns, long rule chains, left recursion, rules
that can never finish a text. Each comes with PATHOLOGICAL, the hostile-input sweep's findings (issue
25 § 7) as explicit examples every run tries first.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

JsonValue = None | bool | int | float | str | list | dict


def nested_schema(depth: int) -> str:
    """An object schema `depth` objects deep, as JSON text (deeper than Python's json module nests)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "integer"}' + '}, "required": ["a"]}' * depth


def chained_grammar(rules: int) -> str:
    """`start: r0`, `r{i}: r{i+1} "x"`: a derivation as deep as the chain is long."""
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} "x"\n' for i in range(rules)) + f'r{rules}: "y"\n'


RECURSIVE_REQUIRED = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                                                         "required": ["c"]}}}
PATHOLOGICAL_SCHEMAS = (nested_schema(100), nested_schema(300), nested_schema(500), nested_schema(5000),
                        *map(json.dumps, (RECURSIVE_REQUIRED, {"enum": list(range(20_000))},
                                          {"type": "string", "pattern": "(a+)+$"},
                                          {"type": "array", "minItems": 100_000, "items": {"type": "integer"}})))
PATHOLOGICAL_REGEXES = ("a{1000}{1000}", "(a+)+$", "(a|aa)*b", "((a{0,100}){0,100}){0,100}", "(x*)*y{500}",
                        "[\\s\\S]{0,100000}", "(?:a|b|c|d|e|f)" * 200)
PATHOLOGICAL_GRAMMARS = (chained_grammar(2000), chained_grammar(5000), "start: a\na: a \"x\"\n",
                         "start: \"(\" * 1000\n", "start: " + "(" * 300 + '"x"' + ")" * 300 + "\n",
                         "start: a\na: a \"x\" | \"y\"\n",
                         "start: " + " | ".join(f'"w{i}"' for i in range(20_000)) + "\n")


def _json_values() -> st.SearchStrategy[JsonValue]:
    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                        max_leaves=6)


def json_schemas() -> st.SearchStrategy[str]:
    """Schemas as JSON text."""
    return st.one_of(st.sampled_from(PATHOLOGICAL_SCHEMAS), _schemas().map(json.dumps),
                     st.builds(nested_schema, st.integers(1, 2000)))


def _schemas() -> st.SearchStrategy[dict | bool]:
    leaf = st.one_of(
        st.sampled_from([{"type": kind} for kind in ("string", "integer", "number", "boolean", "null", "object", "array")]),
        st.builds(lambda values: {"enum": values}, st.lists(_json_values(), min_size=1, max_size=8)),
        st.builds(lambda size: {"enum": [f"v{i}" for i in range(size)]}, st.integers(1, 50_000)),
        st.builds(lambda low, high: {"type": "integer", "minimum": low, "maximum": high}, st.integers(), st.integers()),
        st.builds(lambda low, high: {"type": "string", "minLength": low, "maxLength": high},
                  st.integers(-5, 10**7), st.integers(-5, 10**7)),
        st.builds(lambda pattern: {"type": "string", "pattern": pattern}, regexes()),
        st.builds(lambda value: {"const": value}, _json_values()),
        st.booleans(),
    )

    def compound(inner: st.SearchStrategy) -> st.SearchStrategy:
        return st.one_of(
            st.builds(lambda props, required: {"type": "object", "properties": props,
                                               "required": [name for name in props if required]},
                      st.dictionaries(st.text(max_size=6), inner, max_size=4), st.booleans()),
            st.builds(lambda items, low: {"type": "array", "items": items, "minItems": low}, inner, st.integers(-1, 10**6)),
            st.builds(lambda options, key: {key: options}, st.lists(inner, min_size=1, max_size=4),
                      st.sampled_from(["anyOf", "oneOf", "allOf"])),
            st.builds(lambda body, key: {"$ref": f"#/$defs/{key}", "$defs": {key: body}}, inner, st.sampled_from(["n", "x"])),
            st.builds(lambda body: {"$ref": "#/$defs/n", "$defs": {"n": {"anyOf": [body, {"type": "array",
                                                                                          "items": {"$ref": "#/$defs/n"}}]}}}, inner),
        )

    return st.recursive(leaf, compound, max_leaves=8)


def regexes() -> st.SearchStrategy[str]:
    atom = st.one_of(st.sampled_from(["a", "b", ".", "\\d", "\\w", "[a-z]", "[^x]", "\\s", "x|y", "é", "💥", "\\u{10FFFF}",
                                      "(?=a)", "\\1", "[", "(", "*", "\\"]),
                     st.text(alphabet="abc", min_size=1, max_size=3))

    def combine(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        counted = st.builds(lambda part, low, high: f"(?:{part}){{{low},{high}}}", inner, st.integers(0, 2000),
                            st.integers(0, 2000))
        return st.one_of(st.builds(lambda a, b: a + b, inner, inner), st.builds(lambda a, b: f"(?:{a}|{b})", inner, inner),
                         st.builds(lambda part, op: f"(?:{part}){op}", inner, st.sampled_from(["*", "+", "?", "*?", "{3}"])),
                         counted)

    return st.one_of(st.sampled_from(PATHOLOGICAL_REGEXES), st.recursive(atom, combine, max_leaves=10))


def grammars() -> st.SearchStrategy[str]:
    terminal = st.one_of(st.builds(lambda text: json.dumps(text), st.text(max_size=5)),
                         st.builds(lambda pattern: f"/{pattern}/", regexes().filter(lambda p: "/" not in p)))
    rule_body = st.lists(st.one_of(terminal, st.sampled_from(["start", "a", "b", "c", "a*", "b+", "(a | b)", "%json {}"])),
                         min_size=1, max_size=5).map(" ".join)
    rules = st.lists(rule_body, min_size=1, max_size=4).map(lambda bodies: "\n".join(
        f"{name}: {body}" for name, body in zip(("start", "a", "b", "c"), bodies, strict=False)) + "\n")
    return st.one_of(st.sampled_from(PATHOLOGICAL_GRAMMARS), st.builds(chained_grammar, st.integers(1, 8000)), rules,
                     st.text(max_size=200))
