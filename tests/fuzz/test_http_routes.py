"""schemathesis against the OpenAPI document a real `kiln serve` serves: every route with valid and
invalid requests generated from the document, then stateful sequences that follow its links (create a
session -> append / generate / fork / snapshot -> restore -> close).

Checks on every response: no 5xx, a documented status and content type, a body matching the documented
schema, invalid input refused (4xx); after each run, FuzzTarget.check_unharmed (bystander unchanged,
invariants 0, no INTERNAL, server alive).
"""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import given, settings
from hypothesis.stateful import run_state_machine_as_test
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.fuzz.conftest import RAW, REQUEST_TIMEOUT_S, FuzzTarget, fuzz_settings

ROUTES = (
    "POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /v1/models/{model_id}",
    "GET /v1/sessions", "POST /v1/sessions", "GET /v1/sessions/{session_id}", "DELETE /v1/sessions/{session_id}",
    "GET /v1/sessions/{session_id}/tokens", "POST /v1/sessions/{session_id}/tokens",
    "POST /v1/sessions/{session_id}/generate", "POST /v1/sessions/{session_id}/fork",
    "POST /v1/sessions/{session_id}/snapshot", "GET /v1/snapshots", "GET /v1/snapshots/{snapshot_id}",
    "DELETE /v1/snapshots/{snapshot_id}", "POST /v1/snapshots/{snapshot_id}/restore", "POST /v1/tokenize",
    "POST /v1/detokenize", "GET /healthz", "HEAD /healthz", "GET /health", "HEAD /health", "GET /metrics",
    "POST /v1/responses", "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}",
    "GET /v1/responses/{response_id}/input_items",
)
# no inputs, not even a key: nothing to make invalid
OPEN_ROUTES = ("GET /healthz", "HEAD /healthz", "GET /health", "HEAD /health", "GET /metrics")
BODILESS = ("POST /v1/sessions/{session_id}/snapshot", "POST /v1/snapshots/{snapshot_id}/restore")  # a body is ignored
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES_PER_ROUTE = 8
STATEFUL_RUNS, STEPS = 15, 10


@pytest.fixture(scope="module")
def api(fuzz_target: FuzzTarget) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(fuzz_target.url + "/openapi.json", headers=fuzz_target.headers(),
                                         timeout=REQUEST_TIMEOUT_S)


def test_the_document_needs_the_key_and_names_every_route(fuzz_target: FuzzTarget, api) -> None:
    unauthenticated = fuzz_target.http.get(fuzz_target.url + "/openapi.json", timeout=REQUEST_TIMEOUT_S)
    assert unauthenticated.status_code == 401
    assert sorted(result.ok().label for result in api.get_all_operations()) == sorted(ROUTES)


@pytest.mark.parametrize(("route", "mode"), [(route, GenerationMode.POSITIVE) for route in ROUTES]
                         + [(route, GenerationMode.NEGATIVE) for route in ROUTES if route not in OPEN_ROUTES])
def test_route(fuzz_target: FuzzTarget, api, route: str, mode: GenerationMode) -> None:
    method, path = route.split(" ")
    operation = api[path][method]
    checks = CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])

    @given(case=operation.as_strategy(generation_mode=mode))
    @fuzz_settings(EXAMPLES_PER_ROUTE)
    def answers_well(case: schemathesis.Case) -> None:
        fuzz_target.tried[f"{route} ({mode.value})"] += 1
        case.call_and_validate(base_url=fuzz_target.url, session=fuzz_target.http, headers=fuzz_target.headers(),
                               checks=checks, timeout=REQUEST_TIMEOUT_S)

    answers_well()
    fuzz_target.check_unharmed()


@pytest.mark.parametrize("route", [route for route in ROUTES if route.startswith("POST") and route not in BODILESS])
def test_deeply_nested_bodies(fuzz_target: FuzzTarget, route: str) -> None:
    """JSON nested far deeper than any parser's recursion goes: a clean 400, whatever the route."""
    session = fuzz_target.post("/v1/sessions", {}).json()["session_id"]
    path = route.split(" ")[1].replace("{session_id}", session).replace("{snapshot_id}", "none")
    for depth in (900, 100_000):
        for body in ("[" * depth + "]" * depth, '{"a": ' * depth + "1" + "}" * depth):
            fuzz_target.tried[f"{route} (nested {depth} deep)"] += 1
            reply = fuzz_target.post_spliced(path, {"body": RAW}, body)
            assert reply.status_code == 400, f"{route}, {depth} deep: {reply.status_code} {reply.text[:300]}"
    fuzz_target.check_unharmed()


LONE_SURROGATE = "\ud800"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "twin", "parameters": {"type": "object"}}}
SWEEP_FINDINGS = [  # issue 25 § 7's smaller findings: (route, body with RAW, RAW's JSON text, the param refused)
    ("/v1/completions", {"prompt": RAW, "max_tokens": 2}, json.dumps(LONE_SURROGATE), "prompt"),
    ("/v1/completions", {"prompt": RAW, "max_tokens": 2}, json.dumps(["a", "b" + LONE_SURROGATE]), "prompt"),
    ("/v1/tokenize", {"text": RAW}, json.dumps(LONE_SURROGATE), "text"),
    ("/v1/chat/completions", {**CHAT, "messages": RAW}, json.dumps([{"role": "user", "content": LONE_SURROGATE}]),
     "messages"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": RAW}, json.dumps(LONE_SURROGATE), "stop"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": RAW}, json.dumps(["x", LONE_SURROGATE]), "stop"),
    ("/v1/chat/completions", {**CHAT, "stop": RAW}, json.dumps(LONE_SURROGATE), "stop"),
    ("/v1/sessions/{session_id}/generate", {"max_tokens": 2, "stop": RAW}, json.dumps([LONE_SURROGATE]), "stop"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": RAW}, str(10**24), "top_k"),
    ("/v1/chat/completions", {**CHAT, "tools": RAW}, json.dumps([TOOL, TOOL]), "tools"),
]


@pytest.mark.parametrize(("path", "body", "raw", "param"), SWEEP_FINDINGS,
                         ids=[f"{path.split('/')[-1]}-{param}-{i}" for i, (path, _, _, param) in enumerate(SWEEP_FINDINGS)])
def test_sweep_findings_are_refused(fuzz_target: FuzzTarget, path: str, body: dict, raw: str, param: str) -> None:
    session = fuzz_target.post("/v1/sessions", {"token_ids": [65]}).json()["session_id"]
    reply = fuzz_target.post_spliced(path.replace("{session_id}", session), body, raw)
    assert reply.status_code == 400, f"{path} {param}={raw[:80]}: {reply.status_code} {reply.text[:300]}"
    assert reply.json()["error"]["param"].startswith(param), reply.text


def test_linked_sequences(fuzz_target: FuzzTarget, api) -> None:
    """Sessions and snapshots made by one call and used by the next, as the document's links chain them."""
    machine = api.as_state_machine()

    class Sequences(machine):  # type: ignore[misc, valid-type]
        def get_call_kwargs(self, case: schemathesis.Case) -> dict:
            fuzz_target.tried[f"{case.operation.label} (stateful)"] += 1
            return {"base_url": fuzz_target.url, "session": fuzz_target.http, "headers": fuzz_target.headers(),
                    "timeout": REQUEST_TIMEOUT_S}

        def validate_response(self, response, case, additional_checks=(), **kwargs) -> None:  # noqa: ANN001
            case.validate_response(response, checks=CHECKS)

    run_state_machine_as_test(Sequences, settings=settings(fuzz_settings(STATEFUL_RUNS), stateful_step_count=STEPS))
    fuzz_target.check_unharmed()
