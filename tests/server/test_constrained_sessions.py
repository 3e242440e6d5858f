"""Constrained generates on sessions over the wire: the Python SDK (sync and asyncio) over gRPC and REST
sessions; a constraint that does not compile is INVALID_ARGUMENT naming the field, before anything runs."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest

from kiln.client import AsyncClient, Client
from kiln.errors import InvalidArgumentError

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer",
                                                                                      "minimum": 0, "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}


def test_sdk_session_generate_with_a_schema_a_regex_and_a_grammar(tiny_server):
    with Client(tiny_server.grpc_address, tokenizer="server") as client:
        session = client.create_session([5, 6, 7])
        text = "".join(session.generate_text(max_tokens=60, json_schema=SCHEMA, temperature=1.0, seed=2))
        jsonschema.validate(json.loads(text), SCHEMA)
        history = session.info().history_tokens
        assert "".join(session.generate_text(max_tokens=20, regex=r"[0-9]{2}")).isdigit()
        assert re.fullmatch(r"(ab|ba)+\.", "".join(session.generate_text(max_tokens=30, grammar='start: /(ab|ba)+\\./')))
        assert session.info().history_tokens > history  # generated tokens joined the history; nothing else did

        for options, field in [({"json_schema": {"type": "strin"}}, "json_schema"), ({"regex": "a("}, "regex"),
                                ({"grammar": "start: nope"}, "grammar"), ({"regex": "a", "grammar": "start: \"a\""}, "grammar")]:
            before = session.info().history_tokens
            with pytest.raises(InvalidArgumentError, match=field):
                session.generate(max_tokens=4, **options)
            assert session.info().history_tokens == before and not session.info().generating


def test_async_sdk_constrained_generate(tiny_server):
    async def run() -> str:
        async with AsyncClient(tiny_server.grpc_address, tokenizer="server") as client:
            session = await client.create_session([9, 10])
            return "".join([piece async for piece in session.generate_text(max_tokens=20, regex="(on|off)")])

    assert asyncio.run(run()) in ("on", "off")


def test_rest_session_generate_with_a_schema(tiny_server):
    with httpx.Client(base_url=tiny_server.http_url, timeout=60) as http:
        session = http.post("/v1/sessions", json={"token_ids": [5, 6]}).json()["session_id"]
        result = http.post(f"/v1/sessions/{session}/generate", json={"max_tokens": 60, "json_schema": SCHEMA}).json()
        jsonschema.validate(json.loads(result["text"]), SCHEMA)
        refused = http.post(f"/v1/sessions/{session}/generate", json={"max_tokens": 4, "regex": "("})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "regex"
