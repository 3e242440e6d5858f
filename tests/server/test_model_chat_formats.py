"""/v1/chat/completions on a tiny random model under real models' chat templates
(tests/fixtures/chat_templates/): a reasoning model's thinking as reasoning_content (DeepSeek R1's
template opens it in the prompt; Qwen 3's closes it with chat_template_kwargs enable_thinking false),
and a tool call in Llama 3's own syntax read back as OpenAI tool_calls."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from fastapi.testclient import TestClient

from kiln import LLM
from kiln.server.auth import ApiKeys
from kiln.server.http import build_http_app
from kiln.server.metrics import Metrics
from kiln.server.service import RuntimeService
from kiln.tokenizer import Tokenizer
from tests.conftest import byte_tokenizer

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
ASK = [{"role": "user", "content": "Hi"}]
NO_EOS = {"2": -100}  # the tiny models' EOS: a reply runs to max_tokens unless a grammar ends it


def chat_client(tiny_loaded, template: str) -> TestClient:
    loaded = tiny_loaded("llama")
    plain = byte_tokenizer()
    tokenizer = Tokenizer(plain.backend, None, plain.eos_token_ids, chat_template=(TEMPLATES / template).read_text())
    llm = LLM(loaded=dataclasses.replace(loaded, tokenizer=tokenizer), kv_budget_bytes=16 * 1024**2)
    service = RuntimeService(llm, "tiny-reasoner")
    return TestClient(build_http_app(service, ApiKeys(), Metrics(llm)))


def test_r1_thinking_is_reasoning_content_whole_and_streamed(tiny_loaded):
    """R1's template opens <think> for the model: a reply cut before </think> is all thinking."""
    http = chat_client(tiny_loaded, "DeepSeek-R1-Distill-Qwen-32B.jinja")
    request = {"messages": ASK, "max_tokens": 12, "temperature": 1.0, "seed": 1, "logit_bias": {"2": -100}}
    message = http.post("/v1/chat/completions", json=request).json()["choices"][0]["message"]
    assert message["reasoning_content"] and not message["content"]
    with http.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as events:
        chunks = [json.loads(line[6:]) for line in events.iter_lines() if line.startswith("data: {")]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert not "".join(d.get("content") or "" for d in deltas)


def test_enable_thinking_false_reaches_qwen3s_template(tiny_loaded):
    http = chat_client(tiny_loaded, "Qwen3-0.6B.jinja")
    request = {"messages": ASK, "max_tokens": 4, "logit_bias": {"2": -100}}
    thinking = http.post("/v1/chat/completions", json=request).json()
    plain = http.post("/v1/chat/completions", json={**request, "chat_template_kwargs": {"enable_thinking": False}}).json()
    # the template closed the thinking for the model: "<think>\n\n</think>\n\n" (19 bytes) ends the prompt
    assert plain["usage"]["prompt_tokens"] == thinking["usage"]["prompt_tokens"] + 19
    assert "reasoning_content" not in plain["choices"][0]["message"]
    refused = http.post("/v1/chat/completions", json={**request, "chat_template_kwargs": "no"})
    assert refused.status_code == 400


def test_a_llama_model_calls_in_its_own_json_and_the_call_comes_back_as_tool_calls(tiny_loaded):
    """Llama 3.2's template: the forced call is {"name": ..., "parameters": ...} (no markup), the
    grammar ends after it, and the client gets OpenAI tool_calls whole and streamed."""
    http = chat_client(tiny_loaded, "Llama-3.2-3B-Instruct.jinja")
    ping = {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
        "additionalProperties": False}}}
    request = {"messages": ASK, "max_tokens": 60, "tools": [ping], "tool_choice": "required", "logit_bias": NO_EOS,
               "temperature": 1.0, "seed": 2}
    choice = http.post("/v1/chat/completions", json=request).json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert call["function"]["name"] == "ping" and set(json.loads(call["function"]["arguments"])) == {"n"}
    with http.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as events:
        chunks = [json.loads(line[6:]) for line in events.iter_lines() if line.startswith("data: {")]
    streamed = [c for chunk in chunks for c in chunk["choices"][0]["delta"].get("tool_calls") or ()]
    assert "".join(c["function"]["arguments"] for c in streamed) == call["function"]["arguments"]
