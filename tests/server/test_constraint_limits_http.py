"""The hostile-input findings of issue 25 § 7 over HTTP, against a `kiln serve` of this module's own (a
crash fails these tests, not pytest, nor the servers other modules share): each refused with 400 naming
its field and the limit, the server alive, a bystander session's generation unchanged and no invariant
counted."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.engine.test_constraint_limits import RECURSIVE_REF, chain

BYSTANDER_HISTORY = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def bystander(http):
    """The bystander's greedy continuation before any hostile request."""
    return _greedy(http)


def _greedy(http: httpx.Client) -> list[int]:
    session = http.post("/v1/sessions", json={"token_ids": BYSTANDER_HISTORY}).json()["session_id"]
    reply = http.post(f"/v1/sessions/{session}/generate", json={"max_tokens": 12, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["token_ids"]


def _refused(reply: httpx.Response, param: str, match: str) -> None:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and match in error["message"], error


@pytest.fixture
def session(http, server, bystander):
    """A session for one hostile request; afterwards the server still runs and the bystander's
    generation is what it was."""
    yield http.post("/v1/sessions", json={"token_ids": [1, 2, 3]}).json()["session_id"]
    assert server.process.poll() is None, "".join(server.log[-40:])
    assert _greedy(http) == bystander


def _generate(http: httpx.Client, session: str, **body: object) -> httpx.Response:
    return http.post(f"/v1/sessions/{session}/generate", content=json.dumps({"max_tokens": 8, **body}),
                     headers={"content-type": "application/json"})


def test_a_5000_rule_grammar_is_refused_not_a_segfault(http, session):
    _refused(_generate(http, session, grammar=chain(5000)), "grammar", "max_rules limit: rules (definitions and $refs) 5,000")


def test_a_schema_nested_400_deep_is_400_not_500(http, session):
    deep: dict = {"type": "integer"}
    for _ in range(400):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    _refused(_generate(http, session, json_schema=deep), "json_schema", "max_schema_depth limit")


def test_a_recursive_required_ref_is_refused_at_compile(http, session):
    _refused(_generate(http, session, json_schema=RECURSIVE_REF), "json_schema", "cannot produce a complete text")


def test_a_regex_of_a_million_repetitions_is_refused(http, session):
    _refused(_generate(http, session, regex="a{1000}{1000}"), "regex", "max_repeat_product limit")


def test_a_lone_surrogate_in_stop_is_refused_on_every_route(http, session):
    _refused(_generate(http, session, stop=["ok", "\ud800"]), "stop", "stop[1] is not valid Unicode")
    completion = http.post("/v1/completions", content=json.dumps({"model": "kiln", "prompt": "hi", "stop": "\ud800"}),
                           headers={"content-type": "application/json"})
    _refused(completion, "stop", "is not valid Unicode")
    chat = http.post("/v1/chat/completions", content=json.dumps(
        {"model": "kiln", "messages": [{"role": "user", "content": "hi"}], "stop": ["\udfff"]}),
        headers={"content-type": "application/json"})
    _refused(chat, "stop", "is not valid Unicode")


def test_top_k_of_10_to_the_24_is_refused(http, session):
    _refused(_generate(http, session, top_k=10**24), "top_k", "top_k must be an integer in [0, 2147483647]")
    completion = http.post("/v1/completions", json={"model": "kiln", "prompt": "hi", "top_k": 10**24})
    _refused(completion, "top_k", "top_k must be an integer")


def test_duplicate_tool_names_and_deep_tool_schemas_are_refused(http, session):
    def chat(tools: list[dict], tool_choice: str = "auto") -> httpx.Response:
        return http.post("/v1/chat/completions", json={"model": "kiln", "messages": [{"role": "user", "content": "hi"}],
                                                       "tools": tools, "tool_choice": tool_choice, "max_tokens": 4})

    def tool(name: str, parameters: dict | None = None) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}

    for choice in ("auto", "none", "required"):
        _refused(chat([tool("get"), tool("get")], choice), "tools", "tools[1].function.name 'get' repeats tools[0]'s")
    deep: dict = {"type": "integer"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}}
    _refused(chat([tool("get", deep)]), "tools[0].function.parameters", "max_schema_depth limit")


def test_no_invariant_was_counted(http, bystander):
    metrics = http.get("/metrics").text
    counted = [line for line in metrics.splitlines()
               if line.startswith("kiln_cache_invariant_violations") and not line.endswith(" 0.0")]
    assert not counted, counted
