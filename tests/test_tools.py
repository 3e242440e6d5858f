"""Tool calls as text: ToolCallParser turns generated text back into OpenAI tool calls, piece by piece, as
streaming sends them; the `auto` grammar keeps plain text from opening a call."""

import pytest

from kiln.engine.constraints import Constraint, compiler_for
from kiln.tools import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    Tool,
    ToolCallParser,
    ToolChoice,
    call_text,
    grammar,
)

PARIS, ROME = call_text("get_weather", '{"city": "Paris"}'), call_text("get_weather", '{"city": "Rome"}')


def parsed(text: str, complete: bool = True, piece: int = 1) -> tuple[list, ToolCallParser]:
    """Every delta of `text` fed `piece` characters at a time, then finished."""
    parser = ToolCallParser()
    deltas = [d for start in range(0, len(text), piece) for d in parser.push(text[start : start + piece])]
    return deltas + parser.finish(complete), parser


def calls(deltas: list) -> list[tuple[str, str]]:
    names = [d.name for d in deltas if isinstance(d, CallStart)]
    arguments = ["".join(d.text for d in deltas if isinstance(d, ArgumentsDelta) and d.index == i)
                 for i in range(len(names))]
    return list(zip(names, arguments, strict=True))


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_a_repeated_call_ends_the_reply_and_is_never_handed_out(piece):
    text = "\n".join([PARIS, ROME, PARIS, ROME, PARIS])
    deltas, parser = parsed(text, piece=piece)
    assert calls(deltas) == [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]
    assert parser.repeated and parser.names == ["get_weather", "get_weather"]
    assert not any(isinstance(d, ContentDelta) for d in deltas)


def test_a_call_that_only_begins_like_an_earlier_one_goes_out_whole():
    later = call_text("get_weather", '{"city": "Parisville"}')
    deltas, parser = parsed(PARIS + "\n" + later)
    assert calls(deltas)[1] == ("get_weather", '{"city": "Parisville"}') and not parser.repeated


@pytest.mark.parametrize("cut", range(1, len(PARIS + "\n" + ROME)))
def test_a_reply_cut_anywhere_puts_no_call_markup_into_content(cut):
    deltas, _ = parsed((PARIS + "\n" + ROME)[:cut], complete=False)
    assert not any(isinstance(d, ContentDelta) for d in deltas)
    for name, arguments in calls(deltas):  # a cut call keeps the arguments written so far
        assert name == "get_weather" and any(whole.startswith(arguments) for whole in ('{"city": "Paris"}', '{"city": "Rome"}'))


def test_a_complete_reply_too_short_to_tell_is_content_and_plain_text_streams():
    assert parsed("<tool")[0] == [ContentDelta("<tool")]
    deltas, _ = parsed("Sunny, 21 C.", piece=4)
    assert "".join(d.text for d in deltas) == "Sunny, 21 C." and all(isinstance(d, ContentDelta) for d in deltas)


def test_under_auto_plain_text_cannot_open_a_call_even_after_whitespace(tiny_llm):
    """A transcript's reply opens with a space: " <tool_call>" would be neither a call nor text to show."""
    llm = tiny_llm("llama")
    compiler = compiler_for("tiny-llama", llm.tokenizer, llm.engine.model_config.vocab_size)
    rules = grammar([Tool("ping")], ToolChoice("auto"))

    def accepts(text: str) -> bool:
        matcher = compiler.matcher(Constraint.grammar(rules), frozenset(llm.tokenizer.eos_token_ids))
        return all(matcher.accept(token) for token in llm.tokenizer.encode(text, add_special_tokens=False))

    assert accepts(" Sunny. <tool_call> is how I would call it") and accepts("<tool_call>\n{")
    assert accepts(" \n<tool_call") and not accepts(" \n<tool_call>")
