"""A reasoning model's thinking as reasoning_content: the splitter (streamed and whole) and the grammar
that lets a constrained reply think first (the API's side: tests/server/test_model_chat_formats.py)."""

from __future__ import annotations

import pytest

from kiln.engine.constraints import Constraint, compiler_for
from kiln.reasoning import ReasoningSplitter, with_thought
from kiln.tools import Tool, ToolChoice, grammar
from tests.conftest import byte_tokenizer


def split(text: str, piece: int, opened: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter(opened)
    parts = [splitter.push(text[i : i + piece]) for i in range(0, len(text), piece)] + [splitter.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize("piece", [1, 3, 100])
def test_thinking_goes_to_reasoning_and_the_answer_to_content(piece):
    assert split("<think>\nLet me see.\n</think>\n\nParis.", piece) == ("Let me see.\n", "Paris.")
    assert split("It is 4.</think>\n\n4", piece, opened=True) == ("It is 4.", "4")  # R1: the prompt opened it
    assert split("Paris, no thinking.", piece) == ("", "Paris, no thinking.")
    assert split("<think>cut short by max_tok", piece) == ("cut short by max_tok", "")
    assert split("<thin", piece) == ("", "<thin")  # a reply too short to tell is content


def matches(rules: str, text: str) -> bool:
    tokenizer = byte_tokenizer()
    matcher = compiler_for("bytes", tokenizer, 256).matcher(Constraint.grammar(rules), frozenset(tokenizer.eos_token_ids))
    return all(matcher.accept(token) for token in tokenizer.encode(text, add_special_tokens=False)) and matcher.eos_allowed()


def test_a_constrained_reply_may_think_first_and_must_finish_an_opened_thought():
    ping = Tool("ping", "", {"type": "object", "properties": {}, "additionalProperties": False})
    call = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    required = grammar([ping], ToolChoice("required", parallel=False))
    assert matches(with_thought(required, opened=False), "<think>\nping it\n</think>\n\n" + call)
    assert matches(with_thought(required, opened=False), call)
    assert matches(with_thought(required, opened=True), "ping it</think>\n\n" + call)
    assert not matches(with_thought(required, opened=True), "a</think>b</think>" + call)  # one thought, then the call
    assert not matches(with_thought(required, opened=False), "<think>ping it</think> Sure!")
