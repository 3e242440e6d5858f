"""Grammar-constrained decoding on a tiny random model: whatever the model would say, the text matches
the constraint; the mask never removes every token and allows EOS exactly when the grammar accepts;
matchers roll back; constraints work with batching, sessions, stop strings and max_tokens."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import numpy as np
import pytest
import torch

from kiln.engine.constraints import Constraint, as_generated, compiler_for, constrain
from kiln.engine.sampler import SamplingParams
from kiln.engine.stream import GenerationStream
from kiln.errors import InvalidArgumentError

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 130}},
                 "required": ["name", "age"], "additionalProperties": False},
        "ok": {"type": "boolean"}}, "required": ["user", "ok"], "additionalProperties": False},
    "array": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
    "numbers": {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                                                  "n": {"type": "integer", "exclusiveMaximum": 1000}},
                "required": ["x", "n"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                  "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"}},
                "required": ["zip", "code"], "additionalProperties": False},
    "choice": {"anyOf": [{"type": "null"}, {"type": "string", "enum": ["yes", "no"]},
                         {"type": "object", "properties": {"why": {"const": "because"}}, "required": ["why"],
                          "additionalProperties": False}]},
}


@pytest.fixture
def llm(tiny_llm):
    return tiny_llm("llama")


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_sampled_output_parses_and_validates_against_its_schema(llm, name):
    outputs = llm.generate(["a", "Once upon", [7, 8, 9, 10]], max_tokens=200, temperature=1.5, seed=11,
                           json_schema=SCHEMAS[name])
    for output in outputs:
        assert output.finish_reason == "stop"  # ended by the grammar, not by max_tokens
        jsonschema.validate(json.loads(output.text), SCHEMAS[name])


def test_regex_and_lark_grammar_and_json_object(llm):
    text = llm.generate("x", max_tokens=40, temperature=1.0, seed=2, regex=r"[a-c]{3}-[0-9]{1,3}")[0].text
    assert re.fullmatch(r"[a-c]{3}-[0-9]{1,3}", text)
    lark = 'start: "say " WORD "!"\nWORD: /(cat|dog)+/'
    text = llm.generate("x", max_tokens=40, temperature=1.0, seed=3, grammar=lark)[0].text
    assert re.fullmatch(r"say (cat|dog)+!", text)
    any_object = Constraint.json_object()
    text = llm.generate("x", max_tokens=60, temperature=1.0, seed=4, constraint=any_object)[0].text
    assert text.startswith("{")  # cut by max_tokens or complete: a complete one parses
    if text.endswith("}"):
        assert isinstance(json.loads(text), dict)


def test_mask_never_empty_and_eos_allowed_exactly_when_the_grammar_accepts(llm):
    """Walk random paths through a grammar: at every step some token is allowed, and EOS is allowed
    exactly when the text so far is a complete match."""
    compiler = compiler_for("tiny-llama", llm.tokenizer, llm.engine.model_config.vocab_size)
    eos = llm.tokenizer.eos_token_ids[0]
    pattern = re.compile(r"(ab|cd)+(x[0-9]{0,2})?")
    generator = np.random.default_rng(0)
    for _ in range(20):
        matcher = compiler.matcher(Constraint.regex(pattern.pattern), frozenset({eos}))
        text = ""
        while not matcher.is_terminated():
            allowed = matcher.allowed()
            assert allowed.any()
            assert bool(allowed[eos]) == matcher.eos_allowed() == bool(pattern.fullmatch(text))
            token = int(generator.choice(torch.nonzero(allowed)[:, 0].numpy()))
            assert matcher.accept(token)
            if token != eos:
                text += llm.tokenizer.decode([token])
        assert pattern.fullmatch(text)


def test_accept_refuses_disallowed_tokens_and_rollback_restores_the_state(llm):
    compiler = compiler_for("tiny-llama", llm.tokenizer, llm.engine.model_config.vocab_size)
    ids = {char: llm.tokenizer.encode(char, add_special_tokens=False)[0] for char in "abc"}
    eos = llm.tokenizer.eos_token_ids[0]
    matcher = compiler.matcher(Constraint.regex("ab+"), frozenset({eos}))
    assert not matcher.accept(ids["b"]) and not matcher.accept(eos) and matcher.accepted == 0
    first = matcher.allowed().clone()
    assert matcher.accept(ids["a"]) and matcher.accept(ids["b"]) and matcher.accept(ids["b"])
    assert matcher.eos_allowed() and matcher.accept(eos) and matcher.is_terminated()
    matcher.rollback(1)  # the EOS
    assert not matcher.is_terminated() and matcher.accept(ids["b"])
    matcher.rollback(4)
    assert matcher.accepted == 0 and torch.equal(matcher.allowed(), first)
    with pytest.raises(ValueError, match="roll back 1 of 0"):
        matcher.rollback(1)


def test_ignore_eos_keeps_eos_out_and_stop_token_ids_end_where_the_grammar_accepts(llm):
    compiler = compiler_for("tiny-llama", llm.tokenizer, llm.engine.model_config.vocab_size)
    eos = llm.tokenizer.eos_token_ids[0]
    digit = llm.tokenizer.encode("7", add_special_tokens=False)[0]
    stop = llm.tokenizer.encode("!", add_special_tokens=False)[0]
    matcher = compiler.matcher(Constraint.regex("[0-9]+"), frozenset({stop}))  # ignore_eos, stop_token_ids=[!]
    assert matcher.accept(digit) and not matcher.allowed()[eos] and matcher.allowed()[stop]
    assert not matcher.accept(eos) and matcher.accept(stop) and matcher.is_terminated()


def test_constrain_applies_masks_and_biases_to_their_rows_only(llm):
    compiler = compiler_for("tiny-llama", llm.tokenizer, llm.engine.model_config.vocab_size)
    eos = llm.tokenizer.eos_token_ids[0]
    logits = torch.zeros(3, llm.engine.model_config.vocab_size)
    matcher = compiler.matcher(Constraint.regex("a"), frozenset({eos}))
    out = constrain(logits, [None, matcher, None], [(), (), ((5, 2.5),)])
    assert torch.equal(logits, torch.zeros_like(logits))  # never in place
    assert torch.equal(out[0], logits[0]) and out[2, 5] == 2.5 and out[2].sum() == 2.5
    assert torch.isfinite(out[1]).sum() == 1 and out[1, llm.tokenizer.encode("a", add_special_tokens=False)[0]] == 0
    assert constrain(logits, [None] * 3, [()] * 3) is logits


@pytest.mark.parametrize(("kind", "source", "complaint"), [
    ("json_schema", {"type": "strin"}, "Invalid type"),
    ("json_schema", {"type": "object", "if": {"required": ["a"]}}, "Unimplemented keys"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", ["a"], "must be a JSON schema"),
    ("regex", "a(b", "unclosed group"),
    ("regex", "", "non-empty string"),
    ("grammar", "start: missing", "unknown name"),
    ("regex", "a{0}", "empty text"),
])
def test_constraints_that_do_not_compile_are_refused_naming_the_field_before_anything_runs(llm, kind, source, complaint):
    steps = llm.engine.stats.steps
    with pytest.raises(InvalidArgumentError, match=re.escape(complaint)) as refused:
        llm.generate(["a", "b"], max_tokens=4, **{kind: source})
    assert refused.value.param == kind
    assert llm.engine.stats.steps == steps and llm.engine.pending() == 0
    with pytest.raises(InvalidArgumentError, match="at most one"):
        llm.generate("a", max_tokens=4, regex="a", grammar="start: \"a\"")


def test_constraints_with_batching_stop_strings_and_max_tokens(llm):
    schema = SCHEMAS["array"]
    prompts = [[5 + i, 6, 7] for i in range(4)]
    constrained = llm.generate(prompts, max_tokens=60, temperature=1.0, seed=5, json_schema=schema)
    free = llm.generate(prompts, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    assert all(isinstance(json.loads(out.text), list) for out in constrained)
    assert all(len(out.token_ids) == 8 for out in free)  # unconstrained rows in the same engine are untouched
    cut = llm.generate("a", max_tokens=3, json_schema=SCHEMAS["nested"])[0]
    assert cut.finish_reason == "length" and cut.text == '{"u'  # documented: a cut leaves a JSON prefix
    stopped = llm.generate("a", max_tokens=40, regex="(ab)+c", stop=["abab"], temperature=1.0, seed=1)[0]
    assert stopped.finish_reason == "stop" and "abab" not in stopped.text


def test_a_session_constraint_applies_to_one_generate_and_only_adds_its_tokens(llm):
    session = llm.create_session([5, 6, 7, 8])
    constrained = session.generate(max_tokens=30, regex="(yes|no)").result()
    assert llm.tokenizer.decode(constrained.token_ids) in ("yes", "no")
    assert session.tokens == [5, 6, 7, 8, *constrained.token_ids]
    free = session.generate(max_tokens=5, ignore_eos=True).result()
    assert len(free.token_ids) == 5 and session.tokens[-5:] == free.token_ids
    assert free.usage.reused_tokens == 4 + len(constrained.token_ids) - 1


def test_logit_bias_and_top_logprobs(llm):
    target = llm.tokenizer.encode("q", add_special_tokens=False)[0]
    out = llm.generate("hello", max_tokens=3, logit_bias={target: 100}, ignore_eos=True)[0]
    assert out.token_ids == [target] * 3
    stream = llm.start([5, 6, 7], SamplingParams(max_tokens=4, logprobs=True, top_logprobs=3, ignore_eos=True),
                       GenerationStream(llm.engine.cancel))
    result = stream.result()
    for token, logprob, top in zip(result.token_ids, result.logprobs, result.top_logprobs, strict=True):
        assert len(top) == 3 and top[0] == (token, pytest.approx(logprob))  # greedy: the chosen is the likeliest
        assert [value for _, value in top] == sorted((value for _, value in top), reverse=True)
    with pytest.raises(InvalidArgumentError, match="top_logprobs") as refused:
        SamplingParams(top_logprobs=21)
    assert refused.value.param == "top_logprobs"
    with pytest.raises(InvalidArgumentError, match="logit_bias") as refused:
        llm.generate("a", max_tokens=2, logit_bias={10**6: 1.0})
    assert refused.value.param == "logit_bias"


def test_n_choices_fork_the_first_and_compute_the_prompt_once(llm):
    prompt = list(range(10, 50))  # 40 tokens: two full pages and a partial one
    prefilled = llm.engine.stats.prefill_tokens
    streams = llm.start_choices(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=9, ignore_eos=True),
                                [GenerationStream(llm.engine.cancel) for _ in range(3)])
    results = [stream.result() for stream in streams]
    assert [r.usage.reused_tokens for r in results] == [0, 39, 39]
    assert llm.engine.stats.prefill_tokens - prefilled == 40 + 1 + 1
    assert len({tuple(r.token_ids) for r in results}) == 3  # seed + i: different, reproducible choices
    deadline = time.monotonic() + 5
    while llm.engine.kv_usage().used and time.monotonic() < deadline:  # released by the step after the last
        time.sleep(0.01)
    assert llm.engine.kv_usage().used == 0  # every fork gave its pages back


def test_objects_that_list_properties_are_generated_closed(llm):
    """A schema that leaves additionalProperties unsaid still gets only its listed keys (what a
    base model would otherwise pad objects with); objects it leaves open by other means stay open."""
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    for output in llm.generate(["x", "y", "z"], max_tokens=60, temperature=1.5, seed=8, json_schema=schema):
        assert set(json.loads(output.text)) == {"a"}
    assert as_generated({"properties": {}, "anyOf": [{"properties": {"b": {}}}]}) == {
        "properties": {}, "anyOf": [{"properties": {"b": {}}, "additionalProperties": False}]}
    assert as_generated({"allOf": [{"properties": {"b": {}}}]}) == {"allOf": [{"properties": {"b": {}}}]}


def test_numbers_without_bounds_end_within_64_bits(llm):
    """A model pushed to write nothing but digits (every digit's logit +100) still ends an unbounded
    integer at 19 digits inside the 64-bit range, and a number at 19 digits before the point and 9 after,
    so the JSON completes ("stop") instead of running to max_tokens; json_object's numbers too."""
    digits = llm.tokenizer.encode("0123456789", add_special_tokens=False)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"},
                                               "k": {"type": "integer", "minimum": 1}},
              "required": ["n", "x", "k"]}
    (output,) = llm.generate(["x"], max_tokens=150, logit_bias=[(token, 100.0) for token in digits], json_schema=schema)
    assert output.finish_reason == "stop"
    value = json.loads(output.text)
    assert all(isinstance(value[key], int) and -(2**63) <= value[key] < 2**63 for key in ("n", "k")) and value["k"] >= 1
    integral, _, decimals = re.search(r'"x": (-?[0-9.]+)', output.text).group(1).lstrip("-").partition(".")
    assert len(integral) <= 19 and len(decimals) <= 9
    assert as_generated({"type": ["integer", "null"], "maximum": 5}) == {"type": ["integer", "null"], "maximum": 5,
                                                                         "minimum": -(2**63 - 1024)}
    compiler = compiler_for("tiny-llama", llm.tokenizer, llm.engine.model_config.vocab_size)
    matcher = compiler.matcher(Constraint.json_object(), frozenset(llm.tokenizer.eos_token_ids))  # any object, too
    assert all(matcher.accept(token) for token in llm.tokenizer.encode('{"a": [' + "9" * 18, add_special_tokens=False))
    assert not matcher.accept(digits[9])
