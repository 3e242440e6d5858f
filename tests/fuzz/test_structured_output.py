"""Structured output under hostile constraints: JSON schemas, regexes and Lark grammars
(tests/fuzz/constraint_strategies.py) on a session's generate and in chat's response_format.

Properties: each request answers within COMPILE_BOUND_S (compile included: a constraint too costly to
compile must be refused, INVALID_ARGUMENT naming its limit, not ground through); the answer is 200 or
a 400 INVALID_ARGUMENT naming the constraint's field (never 409 from a failed invariant mid-generation,
never 5xx); a generation that ended "stop" under a JSON schema wrote JSON. After each run,
FuzzTarget.check_unharmed (the server survived, the bystander is unchanged, invariants 0).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hypothesis import given

from tests.fuzz.conftest import RAW, REQUEST_TIMEOUT_S, FuzzTarget, fuzz_settings
from tests.fuzz.constraint_strategies import (
    PATHOLOGICAL_GRAMMARS,
    PATHOLOGICAL_REGEXES,
    PATHOLOGICAL_SCHEMAS,
    grammars,
    json_schemas,
    regexes,
)

COMPILE_BOUND_S = 20.0  # a request under a constraint answers within this, compile included
EXAMPLES = 15
MAX_TOKENS = 8
PARSE_ERROR = "error parsing the body"  # FastAPI's 400 for a body its JSON parser gave up on (nesting)
PATHOLOGICAL = ([("json_schema", schema) for schema in PATHOLOGICAL_SCHEMAS]
                + [("regex", json.dumps(regex)) for regex in PATHOLOGICAL_REGEXES]
                + [("grammar", json.dumps(grammar)) for grammar in PATHOLOGICAL_GRAMMARS])
STRATEGIES = {"json_schema": json_schemas(), "regex": regexes().map(json.dumps), "grammar": grammars().map(json.dumps)}


@pytest.fixture
def base_session(fuzz_target: FuzzTarget) -> Iterator[str]:
    """The session every constrained generate of a test forks (so none grows a history of its own)."""
    created = fuzz_target.post("/v1/sessions", {"token_ids": list(b"Answer: ")})
    assert created.status_code == 201, created.text
    yield created.json()["session_id"]


def check_constrained(target: FuzzTarget, base: str, field: str, value: str) -> None:
    """One generate on a fork of `base` under `field` = `value` (JSON text: a schema may nest deeper than
    Python's json module goes), and what its answer must be."""
    target.tried[f"POST /v1/sessions/{{session_id}}/generate ({field})"] += 1
    fork = target.post(f"/v1/sessions/{base}/fork", {}).json()["session_id"]
    try:
        reply = target.post_spliced(f"/v1/sessions/{fork}/generate", {"max_tokens": MAX_TOKENS, field: RAW}, value,
                                    COMPILE_BOUND_S)
    finally:
        target.http.delete(f"{target.url}/v1/sessions/{fork}", headers=target.headers(), timeout=REQUEST_TIMEOUT_S)
    shown = f"{field}={value[:300]}"
    assert reply.status_code in (200, 400), f"{shown}: {reply.status_code} {reply.text[:500]}"
    if reply.status_code == 400:
        assert_refused(reply.json()["error"], field, shown)
        return
    result = reply.json()
    if field == "json_schema" and result["finish_reason"] == "stop":
        json.loads(result["text"])


def assert_refused(error: dict, field: str, shown: str) -> None:
    """INVALID_ARGUMENT naming the constraint's field, or (param null) a body too deeply nested to parse."""
    assert error["code"] == "INVALID_ARGUMENT", f"{shown}: {error}"
    assert error["param"] is not None and error["param"].startswith(field) or PARSE_ERROR in error["message"], \
        f"{shown}: {error}"


@pytest.mark.parametrize(("field", "value"), PATHOLOGICAL,
                         ids=[f"{field}-{index}" for index, (field, _) in enumerate(PATHOLOGICAL)])
def test_pathological_constraint(fuzz_target: FuzzTarget, base_session: str, field: str, value: str) -> None:
    check_constrained(fuzz_target, base_session, field, value)
    fuzz_target.check_unharmed()


@pytest.mark.parametrize("field", sorted(STRATEGIES))
def test_drawn_constraint(fuzz_target: FuzzTarget, base_session: str, field: str) -> None:
    @given(value=STRATEGIES[field])
    @fuzz_settings(EXAMPLES)
    def answers_well(value: str) -> None:
        check_constrained(fuzz_target, base_session, field, value)

    answers_well()
    fuzz_target.check_unharmed()


def test_response_format_schemas(fuzz_target: FuzzTarget) -> None:
    """The same schemas as chat's response_format: 200 or 400 naming it, within the bound."""
    @given(schema=json_schemas())
    @fuzz_settings(EXAMPLES)
    def answers_well(schema: str) -> None:
        fuzz_target.tried["POST /v1/chat/completions (response_format)"] += 1
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS,
                "response_format": {"type": "json_schema", "json_schema": {"name": "fuzz", "schema": RAW}}}
        reply = fuzz_target.post_spliced("/v1/chat/completions", body, schema, COMPILE_BOUND_S)
        assert reply.status_code in (200, 400), f"{schema[:300]}: {reply.status_code} {reply.text[:500]}"
        if reply.status_code == 400:
            assert_refused(reply.json()["error"], "response_format", schema[:300])

    answers_well()
    fuzz_target.check_unharmed()
