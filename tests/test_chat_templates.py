"""Real models' chat templates (tests/fixtures/chat_templates/) rendered by Kiln for a conversation with
tools, a tool call and its result, compared with transformers' apply_chat_template given the same
conversation the way each model family takes it; and each family's tool-call syntax chosen from its
template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import AddedToken

from kiln.chat import from_openai_messages, prompt_for_chat
from kiln.reasoning import opened_in, thinks
from kiln.tokenizer import Tokenizer
from kiln.tool_syntax import HERMES, LLAMA3, MISTRAL, MISTRAL_ARGS, PHI4, syntax_for
from kiln.tools import Tool, tools_prompt
from tests.conftest import byte_tokenizer

transformers = pytest.importorskip("transformers")

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
BOS, EOS = "<s>", "</s>"
WEATHER = Tool("get_weather", "Weather now", {"type": "object", "properties": {"city": {"type": "string"}},
                                               "required": ["city"]})
CALL = {"id": "abc123XYZ", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "abc123XYZ", "content": "21 C"}]
DEFINITION = WEATHER.definition()
ARGUMENTS = {"city": "Paris"}
TOOL_CALL = {"id": "abc123XYZ", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
NATIVE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
          {"role": "tool", "tool_call_id": "abc123XYZ", "content": "21 C"}]


def tokenizers_for(name: str) -> tuple[Tokenizer, object]:
    """Kiln's tokenizer and transformers' for the same byte vocabulary with this template."""
    template = (TEMPLATES / f"{name}.jinja").read_text()
    backend = byte_tokenizer().backend
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (BOS, EOS)])
    kiln = Tokenizer(backend, backend.token_to_id(BOS), (backend.token_to_id(EOS),), chat_template=template)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(backend.to_str()),
                                              bos_token=BOS, eos_token=EOS, chat_template=template)
    return kiln, hf


def the_models_own_rendering(name: str, hf: object, **options: object) -> str:
    """transformers' rendering of CONVERSATION as each family's documentation passes tools, calls and results."""
    render = {"tokenize": False, "add_generation_prompt": True, **options}
    if name == "SmolLM3-3B":  # tools as xml_tools; calls and results as the text the template renders as they are
        call = HERMES.calls_text([("get_weather", json.dumps(ARGUMENTS))])
        messages = [*NATIVE[:2], {"role": "assistant", "content": call}, NATIVE[3]]
        return hf.apply_chat_template(messages, xml_tools=[DEFINITION], **render)
    if name == "Phi-4-mini-instruct":  # tools as JSON in the system message; calls in the assistant's text
        call = PHI4.calls_text([("get_weather", json.dumps(ARGUMENTS))])
        messages = [{**NATIVE[0], "tools": json.dumps([DEFINITION])}, NATIVE[1],
                    {"role": "assistant", "content": call}, NATIVE[3]]
        return hf.apply_chat_template(messages, **render)
    if name == "SmolLM2-135M-Instruct":  # no tools in the template: Kiln's own text; results in the tool role
        call = HERMES.calls_text([("get_weather", json.dumps(ARGUMENTS))])
        messages = [{"role": "system", "content": "Be brief.\n\n" + tools_prompt([WEATHER])}, NATIVE[1],
                    {"role": "assistant", "content": call}, NATIVE[3]]
        return hf.apply_chat_template(messages, **render)
    return hf.apply_chat_template(NATIVE, tools=[{"type": "function", "function": DEFINITION}], **render)


@pytest.mark.parametrize("name", ["Qwen2.5-7B-Instruct", "Qwen3-0.6B", "Llama-3.1-8B-Instruct", "Llama-3.2-3B-Instruct",
                                  "Mistral-Nemo-Instruct-2407", "Ministral-3-8B-Instruct-2512", "SmolLM3-3B",
                                  "Phi-4-mini-instruct", "SmolLM2-135M-Instruct"])
def test_kiln_renders_a_tool_conversation_as_transformers_does(name):
    kiln, hf = tokenizers_for(name)
    text, _ = prompt_for_chat(from_openai_messages(CONVERSATION), kiln, [WEATHER])
    expected = the_models_own_rendering(name, hf)
    assert text == expected
    assert "get_weather" in text.split("Weather in Paris?")[0] + text  # the tools reached the prompt
    assert "21 C" in text and "Paris" in text


@pytest.mark.parametrize(("name", "options"), [("Qwen3-0.6B", {"enable_thinking": False}),
                                               ("SmolLM3-3B", {"enable_thinking": False}),
                                               ("DeepSeek-R1-Distill-Qwen-32B", {})])
def test_template_options_pass_through_and_reasoning_templates_are_recognised(name, options):
    kiln, hf = tokenizers_for(name)
    messages = [{"role": "user", "content": "Hi"}]
    text, _ = prompt_for_chat(from_openai_messages(messages), kiln, options=options)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **options)
    assert thinks(kiln.chat_template)
    # R1 opens the thinking for the model; Qwen 3 and SmolLM3 without thinking close it for the model
    assert opened_in(text) == (name == "DeepSeek-R1-Distill-Qwen-32B")


@pytest.mark.parametrize(("name", "syntax"), [
    ("Qwen2.5-7B-Instruct", HERMES), ("Qwen3-0.6B", HERMES), ("SmolLM3-3B", HERMES), ("SmolLM2-135M-Instruct", HERMES),
    ("Llama-3.1-8B-Instruct", LLAMA3), ("Llama-3.2-3B-Instruct", LLAMA3), ("Mistral-Nemo-Instruct-2407", MISTRAL),
    ("Ministral-3-8B-Instruct-2512", MISTRAL_ARGS), ("Phi-4-mini-instruct", PHI4)])
def test_each_family_writes_its_own_tool_call_syntax(name, syntax):
    kiln, _ = tokenizers_for(name)
    assert syntax_for(kiln) is syntax
