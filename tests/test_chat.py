"""Chat rendering: OpenAI messages to plain ones, the model's jinja template, Gemma turns, transcripts."""

import json

import pytest

from kiln.chat import (
    TEMPLATE,
    TRANSCRIPT,
    TRANSCRIPT_PREAMBLE,
    chat_format,
    from_openai_messages,
    tokens_for_chat,
)
from kiln.errors import InvalidArgumentError
from kiln.tokenizer import Tokenizer
from kiln.tools import Tool
from tests.conftest import byte_tokenizer

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]


def with_template(template: str) -> Tokenizer:
    plain = byte_tokenizer()
    return Tokenizer(plain.backend, plain.bos_token_id, plain.eos_token_ids, chat_template=template)


def test_openai_messages_become_plain_text_messages():
    messages = from_openai_messages([
        {"role": "developer", "content": "Rules."},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
        {"role": "assistant", "content": "Hey"},
    ])
    assert messages == [{"role": "system", "content": "Rules."}, {"role": "user", "content": "Hello"},
                        {"role": "assistant", "content": "Hey"}]


@pytest.mark.parametrize(("message", "complaint"), [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "image_url"),
    ({"role": "assistant", "content": None, "tool_calls": []}, "content"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
     "arguments must be a JSON object"),
    ({"role": "user", "content": "hi", "tool_calls": []}, "tool_calls"),
    ({"role": "tool", "content": "42"}, "tool_call_id"),
    ({"role": "user"}, "content"),
    ({"role": ["user"], "content": "hi"}, "role"),
    ({"role": {"a": 1}, "content": "hi"}, "role"),
    ({"role": "user", "content": [{"type": "text"}]}, "string `text`"),
    ("hello", "object"),
])
def test_non_text_messages_are_refused(message, complaint):
    with pytest.raises(InvalidArgumentError, match=complaint):
        from_openai_messages([message])


def test_jinja_chat_template_is_rendered_for_generation():
    tokenizer = with_template(CHATML)
    text = tokenizer.decode(tokens_for_chat(MESSAGES, tokenizer))
    assert text == "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_template_errors_and_sandbox_escapes_are_invalid_arguments():
    refusing = with_template("{{ raise_exception('system messages are not supported') }}")
    with pytest.raises(InvalidArgumentError, match="system messages are not supported"):
        tokens_for_chat(MESSAGES, refusing)
    escaping = with_template("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidArgumentError):
        tokens_for_chat(MESSAGES, escaping)


def test_a_model_without_a_chat_template_chats_in_a_transcript_that_stops_at_the_next_user_turn():
    plain = byte_tokenizer()
    assert chat_format(plain) is TRANSCRIPT and chat_format(with_template(CHATML)) is TEMPLATE
    text = plain.decode(tokens_for_chat(MESSAGES + [{"role": "assistant", "content": "Hello."},
                                                    {"role": "user", "content": "Bye"}], plain))
    assert text == ("Be kind.\n\n"  # the system message replaces the preamble; the example turns stay
                    "User: What is the capital of Italy?\nAssistant: The capital of Italy is Rome.\n\n"
                    "User: How many legs does a spider have?\nAssistant: A spider has eight legs.\n\n"
                    "User: Hi\nAssistant: Hello.\n\nUser: Bye\nAssistant:")
    assert plain.decode(tokens_for_chat(MESSAGES[1:], plain)).startswith(TRANSCRIPT_PREAMBLE + "\n\nUser: What")
    assert TRANSCRIPT.stop == ("\n\nUser:", "\nUser:") and TRANSCRIPT.max_tokens == 128 and TEMPLATE.stop == ()


def test_chat_format_template_forces_the_models_turns_and_a_bad_name_is_refused():
    gemma = byte_tokenizer()
    gemma.backend.add_special_tokens(["<start_of_turn>", "<end_of_turn>"])
    ids = tokens_for_chat(MESSAGES, gemma, form=chat_format(gemma, "template"))
    assert gemma.decode(ids, skip_special_tokens=False) == (
        "<start_of_turn>user\nBe kind.<end_of_turn>\n<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
    plain = byte_tokenizer()
    assert plain.decode(tokens_for_chat(MESSAGES, plain, form=TEMPLATE)) == "System: Be kind.\nUser: Hi\nAssistant:"
    with pytest.raises(InvalidArgumentError, match="chat_format must be one of auto, template, transcript"):
        chat_format(plain, "chatml")


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOLS = [Tool("get_weather", "Weather now", {"type": "object", "properties": {"city": {"type": "string"}}})]
TOOL_TURNS = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]


def test_tool_calls_and_results_render_as_text_without_a_tool_template():
    plain = byte_tokenizer()
    text = plain.decode(tokens_for_chat(from_openai_messages(TOOL_TURNS), plain, TOOLS))
    assert text.startswith("You can call these tools:\n" + json.dumps(TOOLS[0].definition()))
    assert ('Assistant: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n\n'
            "User: <tool_response>\n21 C\n</tool_response>\nAssistant:") in text


def test_a_template_that_knows_tools_gets_them_and_the_calls_as_objects():
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:"
                "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
                "{{ m.content }};{% endfor %}")
    tokenizer = with_template(template)
    text = tokenizer.decode(tokens_for_chat(from_openai_messages(TOOL_TURNS), tokenizer, TOOLS))
    assert text == "[get_weather]user:Weather?;assistant:get_weather(Paris);tool:21 C;"


def test_a_template_without_tools_gets_them_as_text_and_the_result_in_a_tool_turn():
    """SmolLM2's kind of template (any role by name): the tools join the system message, the call is the
    assistant's text, and the result is a "tool" turn, not a user turn in <tool_response> markup (which
    SmolLM2-135M-Instruct copied into its answer)."""
    chatml = with_template(CHATML)
    text = chatml.decode(tokens_for_chat(from_openai_messages([{"role": "system", "content": "Be kind."}, *TOOL_TURNS]),
                                         chatml, TOOLS))
    assert text.startswith("<|im_start|>system\nBe kind.\n\nYou can call these tools:\n")
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>\n<|im_start|>tool\n21 C<|im_end|>\n<|im_start|>assistant\n") in text
    assert "tool_response" not in text
    # a template that names its roles itself (Gemma's alternation) gets the result as a user turn
    gemma_like = with_template("{% for m in messages %}{% if m.role == 'user' %}U:{% else %}A:{% endif %}{{ m.content }}|"
                               "{% endfor %}")
    text = gemma_like.decode(tokens_for_chat(from_openai_messages(TOOL_TURNS), gemma_like, TOOLS))
    assert text.endswith("U:<tool_response>\n21 C\n</tool_response>|")
