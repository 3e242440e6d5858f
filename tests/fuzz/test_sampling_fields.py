"""Sampling fields at their extremes, as JSON text (so NaN, Infinity and numbers past float range, which
Python's JSON reader accepts, reach the server): every generating route answers 200 or a 400 naming the
field, within REQUEST_TIMEOUT_S; then FuzzTarget.check_unharmed.
"""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import RAW, FuzzTarget, fuzz_settings

EXAMPLES = 25
FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop_token_ids", "logit_bias")
EXTREMES = ("NaN", "Infinity", "-Infinity", "1e400", "-1e400", "-0.0", "1e-320", str(2**64), str(-(2**70)), "0", "-1",
            "[]", "[-1]", f"[{2**40}]", '{"0": NaN}', '{"99999999999999999999": 1}', '{"1": 1e400}', "null", '"1"', "true")
ROUTES = {  # route -> a body with RAW where the drawn field goes
    "/v1/sessions/{session_id}/generate": {"max_tokens": 2},
    "/v1/completions": {"prompt": "a", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2},
}
SESSION_ONLY = {"logit_bias"}  # the session route has no logit_bias (an unknown field there: 400 too)


def values() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(EXTREMES), st.floats().map(json.dumps), st.integers().map(str))


@given(route=st.sampled_from(sorted(ROUTES)), field=st.sampled_from(FIELDS), value=values())
@fuzz_settings(EXAMPLES)
def check(fuzz_target: FuzzTarget, session: str, route: str, field: str, value: str) -> None:
    fuzz_target.tried[f"POST {route} ({field} extremes)"] += 1
    reply = fuzz_target.post_spliced(route.replace("{session_id}", session), {**ROUTES[route], field: RAW}, value)
    assert reply.status_code in (200, 400), f"{route} {field}={value}: {reply.status_code} {reply.text[:300]}"
    if reply.status_code == 400:
        param = reply.json()["error"]["param"] or ""
        assert param.startswith(field) or field in SESSION_ONLY, f"{route} {field}={value}: {reply.text[:300]}"


def test_sampling_extremes(fuzz_target: FuzzTarget) -> None:
    session = fuzz_target.post("/v1/sessions", {"token_ids": list(b"sample me")}).json()["session_id"]
    check(fuzz_target, session)
    fuzz_target.check_unharmed()
