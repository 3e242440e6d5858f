"""Chat rendering: OpenAI messages to plain ones, the model's jinja template, Gemma turns, transcripts."""

import pytest

from kiln.chat import from_openai_messages, tokens_for_chat
from kiln.errors import InvalidArgumentError
from kiln.tokenizer import Tokenizer
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
    ({"role": "assistant", "content": None, "tool_calls": []}, "tool_calls"),
    ({"role": "tool", "content": "42"}, "role"),
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


def test_gemma_turns_and_plain_transcript():
    plain = byte_tokenizer()
    assert plain.decode(tokens_for_chat(MESSAGES, plain)) == "System: Be kind.\nUser: Hi\nAssistant:"
    gemma = byte_tokenizer()
    gemma.backend.add_special_tokens(["<start_of_turn>", "<end_of_turn>"])
    ids = tokens_for_chat(MESSAGES, gemma)
    assert gemma.decode(ids, skip_special_tokens=False) == (
        "<start_of_turn>user\nBe kind.<end_of_turn>\n<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
