"""What the OpenAI API says of and does with the served model: /v1/models lists its facts (the ones
`kiln models` prints), its id is the name it was served by, and an HF directory's generation_config.json
supplies the sampling defaults of a request that leaves them out (as vLLM does), a request's own values
winning. A GGUF file has no generation config: Kiln's defaults stay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kiln.llm import LLM
from kiln.models.facts import model_facts
from kiln.models.generation_config import GenerationDefaults
from kiln.models.loader import load_model
from kiln.server.app import ServeOptions, ServingStack
from tests.server.conftest import tiny_model_dir
from tests.tiny_gguf import write_gguf
from tests.tiny_models import TINY_CONFIGS, hf_state_dict, tiny_hf_model

SHIPPED = {"temperature": 1.5, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 3, "do_sample": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny HF model in a models directory, with a generation_config.json."""
    directory = tiny_model_dir(tmp_path_factory.mktemp("models"))
    (directory / "generation_config.json").write_text(json.dumps(SHIPPED))
    return directory


@pytest.fixture(scope="module")
def served(model_dir) -> TestClient:
    """The OpenAI API of a server of that model, named by its name in the models directory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_MODELS_DIR", str(model_dir.parent))
        llm = LLM(model_dir.name, cache_dir=str(model_dir.parent / "cache"), kv_budget_bytes=16 * 1024**2)
    with llm:
        yield TestClient(ServingStack.build(llm, ServeOptions(env={}, allowed_hosts=("testserver",))).http_app)


def test_v1_models_lists_the_served_name_with_the_models_facts(served, model_dir):
    listed = served.get("/v1/models").json()["data"]
    assert [model["id"] for model in listed] == [model_dir.name]
    assert listed[0] == listed[0] | model_facts(model_dir).to_json()
    assert (listed[0]["architecture"], listed[0]["context_length"], listed[0]["chat_template"]) == (
        "llama", TINY_CONFIGS["llama"].max_position_embeddings, False)
    assert served.get(f"/v1/models/{model_dir.name}").json() == listed[0]


def completion(served: TestClient, **body: object) -> dict:
    reply = served.post("/v1/completions", json={"prompt": "Once", "ignore_eos": True, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_generation_config_fills_what_a_request_leaves_out(served):
    assert completion(served)["usage"]["completion_tokens"] == 3  # max_new_tokens
    assert completion(served, max_tokens=5)["usage"]["completion_tokens"] == 5  # the request's own wins
    chat = served.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                     "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == 3  # over the chat format's default reply limit too
    shipped = completion(served, max_tokens=12, seed=7)["choices"][0]["text"]
    stated = completion(served, max_tokens=12, seed=7, temperature=1.5, top_k=20, repetition_penalty=1.1)
    greedy = completion(served, max_tokens=12, seed=7, temperature=0)
    assert shipped == stated["choices"][0]["text"] != greedy["choices"][0]["text"]


def test_generation_defaults_come_only_from_generation_config(tmp_path):
    directory = tiny_model_dir(tmp_path)
    assert load_model(directory, cache_dir=tmp_path / "cache").generation_defaults == GenerationDefaults()
    (directory / "generation_config.json").write_text(json.dumps({**SHIPPED, "top_p": 0.8, "bos_token_id": 1}))
    assert load_model(directory, cache_dir=tmp_path / "cache").generation_defaults == GenerationDefaults(
        temperature=1.5, top_p=0.8, top_k=20, repetition_penalty=1.1, max_tokens=3)
    gguf_file = tmp_path / "tiny.gguf"
    write_gguf(gguf_file, "llama", TINY_CONFIGS["llama"], hf_state_dict(tiny_hf_model("llama")))
    assert load_model(gguf_file, cache_dir=tmp_path / "cache").generation_defaults == GenerationDefaults()
    (directory / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="temperature must be a number"):
        load_model(directory, cache_dir=tmp_path / "cache")
