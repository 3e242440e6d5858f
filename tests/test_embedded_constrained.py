"""Grammar-constrained decoding on the embedded Gemma 3 270M (base model, 262,144-token vocabulary):
structured output parses and validates, a tool call is well formed, and a session's history only gains
the generated tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kiln import LLM
from kiln.chat import tokens_for_chat
from kiln.engine.constraints import Constraint
from kiln.tools import ArgumentsDelta, Tool, ToolCallParser, ToolChoice, grammar
from tests.engine.test_constraints import SCHEMAS

pytestmark = pytest.mark.embedded

TOOL = Tool("get_weather", "Current weather in a city", {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False})


@pytest.fixture(scope="module")
def llm():
    with LLM(kv_budget_bytes=128 * 1024**2) as engine:
        yield engine


@pytest.mark.parametrize("name", ["nested", "numbers", "pattern"])
def test_schemas_on_the_embedded_model(llm, name):
    prompt = f"A JSON example of a {name} record:\n"
    for output in llm.generate([prompt, prompt], max_tokens=80, temperature=0.8, seed=1, json_schema=SCHEMAS[name]):
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), SCHEMAS[name])


def test_a_required_tool_call_on_the_embedded_model(llm):
    prompt = tokens_for_chat([{"role": "user", "content": "What is the weather in Paris?"}], llm.tokenizer, [TOOL])
    rules = grammar([TOOL], ToolChoice("required", parallel=False))
    output = llm.generate([prompt], max_tokens=60, constraint=Constraint.grammar(rules))[0]
    parser = ToolCallParser()
    arguments = "".join(d.text for d in parser.push(output.text) + parser.finish() if isinstance(d, ArgumentsDelta))
    assert parser.names == ["get_weather"]
    jsonschema.validate(json.loads(arguments), TOOL.schema)


def test_a_constrained_session_turn_only_adds_its_tokens(llm):
    session = llm.create_session()
    session.append_text("Is the sky blue? Answer:")
    before = session.tokens
    result = session.generate(max_tokens=10, regex=" (yes|no)").result()
    assert llm.tokenizer.decode(result.token_ids) in (" yes", " no")
    assert session.tokens == before + result.token_ids
    session.close()
