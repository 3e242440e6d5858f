"""Tool calls as text: ToolCallParser turns generated text back into OpenAI tool calls, piece by piece, as
streaming sends them, in each model family's syntax; the grammar writes that syntax (its control tokens
as tokens) and ends after one call when only one is allowed; the `auto` grammar keeps plain text from
opening a call."""

import pytest
from tokenizers import AddedToken

from kiln.engine.constraints import Constraint, compiler_for
from kiln.tool_syntax import (
    KILN,
    LLAMA3,
    MISTRAL,
    MISTRAL_ARGS,
    SYNTAXES,
    ToolSyntax,
    markup_decoder,
    syntax_for,
)
from kiln.tools import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    Tool,
    ToolCallParser,
    ToolChoice,
    grammar,
)
from tests.conftest import byte_tokenizer

PARIS, ROME = KILN.call_text("get_weather", '{"city": "Paris"}'), KILN.call_text("get_weather", '{"city": "Rome"}')
TRICKY = '{"city": "Pa}ris \\"{[", "days": [1, {"n": 2}]}'  # braces and quotes inside strings


def parsed(text: str, complete: bool = True, piece: int = 1, syntax: ToolSyntax = KILN) -> tuple[list, ToolCallParser]:
    """Every delta of `text` fed `piece` characters at a time, then finished."""
    parser = ToolCallParser(syntax)
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
    later = KILN.call_text("get_weather", '{"city": "Parisville"}')
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


@pytest.mark.parametrize("piece", [1, 2, 7, 1000])
@pytest.mark.parametrize("syntax", SYNTAXES, ids=lambda syntax: syntax.name)
def test_each_familys_calls_parse_streamed_and_whole(syntax, piece):
    text = syntax.calls_text([("get_weather", TRICKY), ("ping", "{}")])
    deltas, parser = parsed(text, piece=piece, syntax=syntax)
    assert calls(deltas) == [("get_weather", TRICKY), ("ping", "{}")] and parser.calls_complete
    assert not any(isinstance(d, ContentDelta) for d in deltas)
    assert calls(parsed(syntax.calls_text([("ping", "{}")]) + syntax.separator + syntax.call_open, piece=piece,
                        syntax=syntax)[0]) == [("ping", "{}")]  # a next call that never came is no call


def test_llama_calls_after_python_tag_and_plain_replies_that_only_look_alike():
    deltas, _ = parsed('<|python_tag|>{"name": "ping", "parameters": {}}', syntax=LLAMA3)
    assert calls(deltas) == [("ping", "{}")]
    for text in ('{"nom": 1}', "The answer is {1, 2}.", " {not a call"):
        deltas, _ = parsed(text, syntax=LLAMA3, piece=3)
        assert all(isinstance(d, ContentDelta) for d in deltas) and "".join(d.text for d in deltas) == text


def test_mistral_call_ids_are_what_its_template_accepts_back():
    assert all(len(i) == 9 and i.isalnum() for i in (MISTRAL.call_id() for _ in range(20)))
    assert KILN.call_id().startswith("call_")


@pytest.mark.parametrize("syntax", SYNTAXES, ids=lambda syntax: syntax.name)
def test_the_grammar_writes_the_familys_syntax_and_its_control_tokens_as_tokens(syntax):
    """Written by the grammar token by token (greedily: the lowest allowed id), decoded as the server
    decodes a tool-calling reply, and read back as the call; one call allowed: the grammar ends there."""
    tokenizer = byte_tokenizer()
    tokenizer.backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in syntax.special])
    ping = Tool("ping", "", {"type": "object", "properties": {}, "additionalProperties": False})
    rules = grammar([ping], ToolChoice("required", parallel=False), syntax=syntax, tokenizer=tokenizer)
    matcher = compiler_for(f"bytes-{syntax.name}", tokenizer, tokenizer.backend.get_vocab_size()).matcher(
        Constraint.grammar(rules), frozenset(tokenizer.eos_token_ids))
    written: list[int] = []
    while not matcher.is_terminated() and len(written) < 200:
        allowed = matcher.allowed().nonzero().flatten().tolist()
        token = next(t for t in allowed if t not in tokenizer.eos_token_ids) if not matcher.eos_allowed() else None
        if token is None:
            break
        assert matcher.accept(token)
        written.append(token)
    assert matcher.eos_allowed() and not [t for t in matcher.allowed().nonzero().flatten().tolist()
                                          if t not in tokenizer.eos_token_ids]  # nothing may follow the one call
    text = markup_decoder(tokenizer, syntax)(written)
    assert text == syntax.calls_text([("ping", "{}")])
    for token in syntax.special:  # the markup's control tokens were written as themselves
        assert (tokenizer.token_to_id(token) in written) == (token in text)
    assert calls(parsed(text, syntax=syntax)[0]) == [("ping", "{}")]


def test_a_repeat_is_known_when_its_object_closes_and_a_cut_repeat_leaves_a_whole_reply():
    text = PARIS + "\n" + PARIS
    _, parser = parsed(text[: text.rindex("}") + 1])  # the repeat's object closed, its </tool_call> not yet written
    assert parser.repeated
    _, cut = parsed(text[:-20], complete=False)  # max_tokens cut the repeat: nothing of it was shown
    assert cut.calls_complete and not cut.repeated
    _, inside = parsed(PARIS[:-20], complete=False)  # cut inside the only call: not a whole reply
    assert not inside.calls_complete


@pytest.mark.parametrize(("tokens", "syntax"), [(("[TOOL_CALLS]",), MISTRAL), (("[TOOL_CALLS]", "[ARGS]"), MISTRAL_ARGS),
                                                (("<|python_tag|>",), LLAMA3), (("[ARGS]",), KILN), ((), KILN)])
def test_a_model_whose_template_names_no_syntax_is_known_by_all_of_its_control_tokens(tokens, syntax):
    tokenizer = byte_tokenizer()
    tokenizer.backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    assert tokenizer.chat_template is None and syntax_for(tokenizer) is syntax


def test_mistral_names_outside_the_object_stream_their_arguments_and_end_on_a_repeat():
    ping, paris = MISTRAL_ARGS.call_text("ping", "{}"), MISTRAL_ARGS.call_text("get_weather", TRICKY)
    assert paris == f"[TOOL_CALLS]get_weather[ARGS]{TRICKY}"
    deltas, parser = parsed(paris + ping + paris + ping, syntax=MISTRAL_ARGS, piece=2)
    assert calls(deltas) == [("get_weather", TRICKY), ("ping", "{}")] and parser.repeated
    arguments = [d.text for d in deltas if isinstance(d, ArgumentsDelta) and d.index == 0]
    assert len(arguments) > 1  # streamed as written, not once whole
    for text in ("[TOOL_CALL", "TOOL_CALLS] is a token", "get_weather[ARGS]{}"):  # not a call: plain text
        deltas, _ = parsed(text, syntax=MISTRAL_ARGS, piece=3)
        assert "".join(d.text for d in deltas if isinstance(d, ContentDelta)) == text and not calls(deltas)
