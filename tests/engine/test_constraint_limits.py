"""Hostile constraints (issue 25 § 7): every measured limit refused at compile time naming the limit and
the value, just under each limit compiling; compiles on big-stack threads under a time bound; grammars
that cannot produce a complete text refused at compile, and one whose failure lies past the compile
probe failing its own request with INVALID_ARGUMENT, never as an invariant violation; the smaller
findings (a lone surrogate in stop, top_k 10^24, duplicate tool names)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from kiln.engine.compile_threads import CompileThreads
from kiln.engine.constraint_limits import LIMITS, check_regex, lark_regexes, repetition
from kiln.engine.constraints import Constraint, ConstraintCompiler, as_generated
from kiln.engine.sampler import INT32_MAX, SamplingParams
from kiln.errors import InvalidArgumentError, ResourceExhaustedError
from kiln.tools import Tool, ToolChoice, check_names, grammar
from tests.conftest import byte_tokenizer

RECURSIVE_REF = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                                                       "required": ["c"]}}}


def chain(rules: int) -> str:
    """The issue's grammar: `start: r0`, `r{i}: r{i+1} "x"`, ending in a terminal; `rules` definitions."""
    links = rules - 2
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} "x"\n' for i in range(links)) + f'r{links}: "y"\n'


def nested(depth: int) -> dict:
    """A schema whose JSON document nests `depth` levels (each array schema is one level)."""
    schema: dict = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def ref_chain(refs: int) -> dict:
    """A schema whose `$ref`s (`refs` of them) chain through as many definitions to an integer."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(refs - 1)}
    defs[f"d{refs - 1}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


@pytest.fixture(scope="module")
def compiler() -> ConstraintCompiler:
    return ConstraintCompiler(byte_tokenizer(), 256)


def refused(limit: str, value: int, make, *args) -> InvalidArgumentError:  # noqa: ANN001 - any constructor
    with pytest.raises(InvalidArgumentError, match=f"{limit} limit: .* {value:,} > ") as caught:
        make(*args)
    return caught.value


# ---- the findings, in process ---------------------------------------------------------------


def test_the_5000_rule_chain_is_refused_before_llguidance_sees_it(compiler):
    error = refused("max_rules", 5000, Constraint.grammar, chain(5000))
    assert error.param == "grammar"


def test_a_schema_nested_400_deep_is_refused_not_a_recursion_error(compiler):
    deep: dict = {"type": "integer"}
    for _ in range(400):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    refused("max_schema_depth", LIMITS.max_schema_depth + 1, Constraint.json_schema, deep)
    text = "[" * 100_000 + "]" * 100_000  # too deep for Python's own JSON parser
    refused("max_schema_depth", LIMITS.max_schema_depth + 1, Constraint.json_schema, text)
    refused("max_schema_depth", LIMITS.max_schema_depth + 1, as_generated, deep)


def test_a_recursive_required_ref_is_refused_at_compile(compiler):
    with pytest.raises(InvalidArgumentError, match="cannot produce a complete text") as caught:
        compiler.compile(Constraint.json_schema(RECURSIVE_REF))
    assert caught.value.param == "json_schema"
    with pytest.raises(InvalidArgumentError, match="cannot produce a complete text"):
        compiler.compile(Constraint.grammar('start: a\na: "x" a'))


def test_a_regex_of_a_million_repetitions_is_refused_before_compiling():
    refused("max_repeat_product", 1_000_000, Constraint.regex, "a{1000}{1000}")
    refused("max_repeat_product", 1_000_000, Constraint.grammar, 'start: "q" /a{1000}{1000}/')
    refused("max_repeat_product", 1_000_000, Constraint.json_schema,
            {"type": "string", "pattern": "^a{1000}{1000}$"})
    refused("max_repeat_product", 1_000_000, Constraint.grammar,
            'start: "q" %json {"type": "string", "pattern": "^a{1000}{1000}$"}')


# ---- each limit's boundary ----------------------------------------------------------------------------


def test_rules_boundary(compiler):
    compiler.compile(Constraint.grammar(chain(LIMITS.max_rules)))  # compiles on a compile thread's stack
    refused("max_rules", LIMITS.max_rules + 1, Constraint.grammar, chain(LIMITS.max_rules + 1))
    compiler.compile(Constraint.json_schema(ref_chain(LIMITS.max_rules)))
    refused("max_rules", LIMITS.max_rules + 1, Constraint.json_schema, ref_chain(LIMITS.max_rules + 1))


def test_schema_depth_boundary(compiler):
    compiler.compile(Constraint.json_schema(nested(LIMITS.max_schema_depth)))
    refused("max_schema_depth", LIMITS.max_schema_depth + 1, Constraint.json_schema, nested(LIMITS.max_schema_depth + 1))


def test_regex_repetition_boundaries(compiler):
    root = int(LIMITS.max_repeat_product ** 0.5)
    compiler.compile(Constraint.regex(f"a{{{root}}}{{{root}}}"))
    refused("max_repeat_product", root * (root + 1), Constraint.regex, f"a{{{root}}}{{{root + 1}}}")
    copies = LIMITS.max_repeat_size // LIMITS.max_repeat_product
    at_size = f"a{{{LIMITS.max_repeat_product}}}" * copies
    compiler.compile(Constraint.regex(at_size))
    refused("max_repeat_size", LIMITS.max_repeat_size + 1, Constraint.regex, at_size + "b")


def test_source_size_boundary():
    padding = '"' + "x" * (LIMITS.max_source_chars - len('start: ""')) + '"'
    Constraint.grammar(f"start: {padding}")
    refused("max_source_chars", LIMITS.max_source_chars + 1, Constraint.grammar, f"start: {padding} ")


def test_repetition_measures_groups_alternatives_classes_and_escapes():
    assert repetition("a{1000}{1000}") == (1_000_000, 1_000_000)
    assert repetition("(a{10}b{5}){3}") == (30, 45)
    assert repetition("x|y{7}|z") == (7, 7)
    assert repetition(r"[{]{5}\p{L}{4}\{9}") == (5, 12)  # a class, a Unicode class, an escaped brace (3 atoms)
    assert repetition("x{2,9}y{3,}") == (9, 12)
    assert repetition("((a") == (1, 1)  # unbalanced: measured, the compiler reports the syntax error
    assert list(lark_regexes('start: "a/b\\"" /x{3}/i // c/d\nT: /[/]+/')) == ["x{3}", "[/]+"]
    check_regex("[0-9]{5}-[A-Z]{2}", "regex")


# ---- compiles on their own threads -----------------------------------------------------------------


def test_a_rule_chain_that_overflows_an_ordinary_stack_compiles_on_a_compile_thread():
    """5,000 chained rules overflow an 8 MiB stack inside llguidance (the process dies, so this runs in
    a child process): on a compile thread they compile."""
    script = f"""
import llguidance
from kiln.engine.compile_threads import CompileThreads
grammar = llguidance.LLMatcher.grammar_from_lark({chain(5000)!r})
error = CompileThreads().run(lambda: llguidance.LLMatcher.validate_grammar(grammar), "grammar")
assert error == "", error
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_compile_past_the_time_limit_is_refused_and_its_thread_bounded():
    threads = CompileThreads(timeout_s=0.2, max_threads=1)
    release = threading.Event()
    with pytest.raises(InvalidArgumentError, match="compile_timeout_s limit") as caught:
        threads.run(release.wait, "grammar", "grammar")
    assert caught.value.param == "grammar"
    with pytest.raises(ResourceExhaustedError, match="1 grammar compiles are running"):
        threads.run(lambda: 1, "grammar")  # the late compile still holds the only place
    release.set()  # the late compile returns (its result dropped) and frees its place
    deadline = time.monotonic() + 30
    while True:
        try:
            assert threads.run(lambda: 7, "grammar") == 7
            break
        except ResourceExhaustedError:
            assert time.monotonic() < deadline


def test_a_compile_error_is_raised_in_the_caller():
    def fail() -> None:
        raise InvalidArgumentError("bad", "regex")

    with pytest.raises(InvalidArgumentError, match="bad"):
        CompileThreads().run(fail, "regex")


# ---- a failure past the compile probe ---------------------------------------------------------------


def test_a_grammar_failing_mid_generation_fails_its_request_with_invalid_argument(tiny_llm):
    """The probe takes "a" (the lowest id) and finds a complete text; a generation pushed to "b" meets
    the unproductive chain: its request fails with INVALID_ARGUMENT naming the field, no invariant is
    counted, the session keeps its history and a bystander's generation is untouched."""
    llm = tiny_llm("llama")
    b = llm.tokenizer.encode("b", add_special_tokens=False)[0]
    lark = 'start: "a" | "b" r\nr: "x" r'
    bystander = llm.create_session([5, 6, 7])
    expected = llm.generate([5, 6, 7], max_tokens=8)[0].token_ids
    session = llm.create_session([1, 2, 3])
    before = session.info().history_tokens
    with pytest.raises(InvalidArgumentError, match="grammar exceeded the grammar engine's limits") as caught:
        session.generate(max_tokens=8, grammar=lark, logit_bias={b: 100}).result()
    assert caught.value.param == "grammar"
    assert not llm.sessions.invariant_violations
    assert session.info().history_tokens >= before and not session.info().generating
    assert bystander.generate(max_tokens=8).result().token_ids == expected


# ---- the smaller findings ------------------------------------------------------------------------------


def test_a_lone_surrogate_in_stop_is_refused_like_in_a_prompt():
    with pytest.raises(InvalidArgumentError, match="stop\\[1\\] is not valid Unicode: surrogates not allowed") as caught:
        SamplingParams(stop=("ok", "a\ud800"))
    assert caught.value.param == "stop"
    with pytest.raises(InvalidArgumentError, match="text is not valid Unicode: surrogates not allowed"):
        byte_tokenizer().encode("a\ud800")


def test_top_k_and_max_tokens_are_bounded_to_int32():
    SamplingParams(top_k=INT32_MAX, max_tokens=INT32_MAX)
    for field in ("top_k", "max_tokens"):
        with pytest.raises(InvalidArgumentError, match=f"{field} must be an integer in \\[.*2147483647\\], got 10") as caught:
            SamplingParams(**{field: 10**24})
        assert caught.value.param == field


def test_duplicate_tool_names_are_refused():
    tools = [Tool("get"), Tool("put"), Tool("get")]
    with pytest.raises(InvalidArgumentError, match="tools\\[2\\].function.name 'get' repeats tools\\[0\\]'s") as caught:
        check_names(tools)
    assert caught.value.param == "tools"
    with pytest.raises(InvalidArgumentError, match="repeats"):
        grammar(tools, ToolChoice("required"))
    assert grammar(tools[:2], ToolChoice("required")) is not None
    json.loads(json.dumps([tool.definition() for tool in tools[:2]]))
