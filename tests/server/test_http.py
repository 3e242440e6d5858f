"""The HTTP API against a real `kiln serve` process: the official openai client, prefix reuse across
chat turns, REST sessions, error envelopes, auth and owner scoping, cancellation, /metrics."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kiln.errors import KilnError
from kiln.server import metrics as metrics_module
from kiln.server.auth import ApiKeys
from kiln.server.http import build_http_app
from kiln.server.metrics import Metrics
from kiln.server.service import RuntimeService
from tests.server.conftest import held_until_released

TIMEOUT = 60.0
LONG = {"max_tokens": 500, "ignore_eos": True}  # long enough to still be running when the client leaves


@pytest.fixture(scope="module")
def http(tiny_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_server.http_url, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def oai(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.http_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(oai) -> str:
    return oai.models.list().data[0].id


def sse_events(lines: Iterator[str]) -> list[dict]:
    """The JSON events of an SSE body, checking it ends with [DONE]."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return events
        events.append(json.loads(line.removeprefix("data: ")))
    raise AssertionError(f"the stream ended without [DONE] after {events}")


def scrape(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics by (name, sorted labels)."""
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def assert_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and set(error) == {"message", "type", "param", "code"}
    return error


def unique_text(length: int) -> str:
    """Text no earlier test sent, so the prefix cache holds none of it."""
    words = uuid.uuid4().hex
    return (f"{words} " * (length // 33 + 1))[:length]


# ---- OpenAI API through the official client ------------------------------------------------------


def test_completion_streamed_equals_whole_and_reports_usage(oai, model):
    prompt = unique_text(40)
    whole = oai.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert whole.object == "text_completion" and whole.model == model
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(prompt.encode()) and whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12

    chunks = list(oai.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # the second request found the whole prompt's full pages in the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= len(prompt) // 16 * 16 - 16


def test_completion_cuts_stop_string_in_whole_and_streamed_replies(oai, model):
    # a fixed prompt: for about 1 prompt in 100 the random model's bytes decode to nothing but U+FFFD
    options = {"model": model, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
               "extra_body": {"ignore_eos": True}}
    text = oai.completions.create(**options).choices[0].text
    stop = next(char for char in text[1:] if char.isalnum())
    expected = text[: text.find(stop)]
    cut = oai.completions.create(**options, stop=[stop, "never-there"])
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    streamed = list(oai.completions.create(**options, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_completion_of_token_ids_and_several_prompts(oai):
    reply = oai.completions.create(model="kiln", prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=3, logprobs=0)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage.prompt_tokens == 6 and reply.usage.completion_tokens <= 6
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) and all(lp <= 0 for lp in logprobs.token_logprobs)


def test_chat_whole_and_streamed(oai, model):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": unique_text(30)}]}]
    whole = oai.chat.completions.create(model=model, messages=messages, max_completion_tokens=10, seed=7,
                                        logprobs=True)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    chunks = list(oai.chat.completions.create(model=model, messages=messages, max_tokens=10, seed=7, stream=True,
                                              logprobs=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in whole.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole.choices[0].logprobs.content],
                                                          abs=1e-3)
    assert len(streamed) == whole.usage.completion_tokens


def test_multi_turn_chat_reuses_the_repeated_history(oai, model, http):
    messages = [{"role": "user", "content": unique_text(300)}]
    first = oai.chat.completions.create(model=model, messages=messages, max_tokens=8)
    # Earlier chats may have cached the chat format's opening (a base model's preamble and examples); the
    # new message itself is prefilled.
    unique = len(http.post("/v1/tokenize", json={"text": messages[0]["content"]}).json()["token_ids"])
    assert first.usage.prompt_tokens - first.usage.prompt_tokens_details.cached_tokens >= unique
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    hits_before = scrape(http)[("kiln_prefix_cache_hit_tokens_total", ())]
    second = oai.chat.completions.create(model=model, messages=messages, max_tokens=8)
    hits = scrape(http)[("kiln_prefix_cache_hit_tokens_total", ())] - hits_before
    assert hits >= 0.8 * first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == hits


def test_openai_client_raises_typed_errors(oai, model):
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="less than or equal to 16"):
        oai.completions.create(model=model, prompt="hi", max_tokens=2, n=17)
    with pytest.raises(openai.BadRequestError, match="image_url"):
        oai.chat.completions.create(model=model, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}])


# ---- REST sessions -------------------------------------------------------------------------------


def test_session_flow_with_streamed_generate_and_fork(http):
    created = http.post("/v1/sessions", json={"token_ids": [5, 6, 7, 8, 9], "ttl_s": 600})
    assert created.status_code == 201
    session = created.json()["session_id"]
    assert http.post(f"/v1/sessions/{session}/tokens", json={"token_ids": [10, 11]}).json()["history_tokens"] == 7

    whole = http.post(f"/v1/sessions/{session}/generate", json={"max_tokens": 4, "ignore_eos": True, "logprobs": True})
    result = whole.json()
    assert len(result["token_ids"]) == 4 and len(result["logprobs"]) == 4
    assert result["usage"]["prefilled_tokens"] == 7 and result["finish_reason"] == "length"

    with http.stream("POST", f"/v1/sessions/{session}/generate",
                     json={"max_tokens": 5, "ignore_eos": True, "stream": True, "logprobs": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.iter_lines())
    streamed = [event["token_id"] for event in events[:-1]]
    assert len(streamed) == 5 and events[-1]["usage"]["generated_tokens"] == 5
    assert all(event["logprob"] <= 0 for event in events[:-1])
    assert events[-1]["usage"]["reused_tokens"] >= 7 + 4 - 1  # only the last generated token was recomputed

    history = http.get(f"/v1/sessions/{session}/tokens").json()["token_ids"]
    assert history == [5, 6, 7, 8, 9, 10, 11, *result["token_ids"], *streamed]
    fork = http.post(f"/v1/sessions/{session}/fork", json={"at": 9})
    assert fork.status_code == 201 and fork.json()["history_tokens"] == 9
    fork_id = fork.json()["session_id"]
    assert http.get(f"/v1/sessions/{fork_id}/tokens").json()["token_ids"] == history[:9]
    listed = {info["session_id"] for info in http.get("/v1/sessions").json()["data"]}
    assert {session, fork_id} <= listed

    assert http.delete(f"/v1/sessions/{session}").json() == {"session_id": session, "deleted": True}
    assert_error(http.get(f"/v1/sessions/{session}"), 404, "NOT_FOUND")
    assert http.get(f"/v1/sessions/{fork_id}").json()["history_tokens"] == 9


def test_tokenize_round_trip(http):
    ids = http.post("/v1/tokenize", json={"text": "héllo ☃"}).json()["token_ids"]
    assert len(ids) == len("héllo ☃".encode())
    assert http.post("/v1/detokenize", json={"token_ids": ids}).json() == {"text": "héllo ☃"}


def test_second_concurrent_generate_waits_its_turn_and_a_leaving_stream_client_cancels(http):
    session = http.post("/v1/sessions", json={"token_ids": [5, 6, 7, 8, 9]}).json()["session_id"]
    with ThreadPoolExecutor(1) as pool:
        with http.stream("POST", f"/v1/sessions/{session}/generate", json={**LONG, "stream": True}) as response:
            lines = response.iter_lines()  # kept open: dropping the iterator would close the stream
            assert next(lines).startswith("data: ")
            second = pool.submit(http.post, f"/v1/sessions/{session}/generate", json={"max_tokens": 2, "ignore_eos": True})
            assert_error(http.post(f"/v1/sessions/{session}/tokens", json={"token_ids": [3]}), 409, "FAILED_PRECONDITION")
        reply = second.result(timeout=TIMEOUT)  # the first one's client left: its turn ended, this one ran
    assert reply.status_code == 200 and len(reply.json()["token_ids"]) == 2, reply.text
    assert wait_idle(http, session)["history_tokens"] < 5 + 2 + LONG["max_tokens"]


def test_a_non_streaming_client_that_gives_up_cancels_too(http):
    # Sampled, not greedy: a tiny model's greedy text loops, speculation then drafts it whole and 500
    # tokens took under the client's 0.1 s.
    session = http.post("/v1/sessions", json={"token_ids": [5, 6, 7, 8, 9]}).json()["session_id"]
    with pytest.raises(httpx.ReadTimeout):
        http.post(f"/v1/sessions/{session}/generate", json={**LONG, "temperature": 1.0, "seed": 1}, timeout=0.1)
    assert wait_idle(http, session)["history_tokens"] < 5 + LONG["max_tokens"]


def test_closing_a_session_mid_stream_ends_the_stream_with_an_error_event(http):
    session = http.post("/v1/sessions", json={"token_ids": [5, 6, 7, 8, 9]}).json()["session_id"]
    with http.stream("POST", f"/v1/sessions/{session}/generate", json={**LONG, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert http.delete(f"/v1/sessions/{session}").status_code == 200
        events = sse_events(lines)
    assert events[-1]["error"]["code"] == "CANCELLED"
    assert all("token_id" in event for event in events[:-1])


def wait_idle(http: httpx.Client, session: str) -> dict:
    deadline = time.monotonic() + 10
    while (info := http.get(f"/v1/sessions/{session}").json())["generating"]:
        assert time.monotonic() < deadline, "the generation went on after its client left"
        time.sleep(0.05)
    return info


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/sessions", {"token_ids": [1], "bogus": 1}, "bogus"),  # Kiln's own API; OpenAI's ignores unknown fields
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**9},
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "warm"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 2.5}, "frequency_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ("/v1/sessions", {"token_ids": [1], "ttl": 5}, "ttl"),
    ("/v1/sessions", {"token_ids": [1], "ttl_s": 1e-300}, "ttl_s"),  # would expire before the reply
    ("/v1/chat/completions", {"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
    ("/v1/completions", {"prompt": "hi", "stop": [1, 2]}, "stop"),
    ("/v1/sessions", {"token_ids": [1], "kv_policy": "lru"}, "kv_policy"),
    ("/v1/sessions", {"token_ids": [1], "kv_policy": "restore", "kv_window_tokens": 3}, "kv_window_tokens"),
])
def test_invalid_requests_get_400_envelopes(http, path, body, param):
    assert assert_error(http.post(path, json=body), 400, "INVALID_ARGUMENT")["param"] == param


def test_bodies_that_are_not_requests_are_400_and_the_connection_stays_usable(http):
    lone_surrogate = b'{"prompt": "\\ud800x", "max_tokens": 2}'
    for path in ("/v1/completions", "/v1/tokenize"):
        body = lone_surrogate if path == "/v1/completions" else b'{"text": "\\ud800"}'
        response = http.post(path, content=body, headers={"content-type": "application/json"})
        assert "not valid Unicode" in assert_error(response, 400, "INVALID_ARGUMENT")["message"]
    empty = http.post("/v1/completions", content=b"", headers={"content-type": "application/json"})
    assert "body is missing" in assert_error(empty, 400, "INVALID_ARGUMENT")["message"]
    stop = http.post("/v1/completions", json={"prompt": "hi", "stop": [1]})
    assert assert_error(stop, 400, "INVALID_ARGUMENT")["message"] == "stop: must be a string or an array of strings"
    wrong_method = assert_error(http.put("/v1/completions", json={}), 405, "UNIMPLEMENTED")
    assert wrong_method["message"] == "PUT is not allowed on /v1/completions (allowed: POST)"
    assert http.head("/healthz").status_code == 200


def test_extreme_but_valid_sampling_values_complete(http):
    """Once these killed the engine thread: float32 rounds them to 0. Now greedy in effect."""
    for body in ({"temperature": 1e-300}, {"temperature": 1e-39}, {"temperature": 1.0, "top_p": 1e-46}):
        response = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, **body})
        assert response.status_code == 200, response.text
    assert http.get("/healthz").json()["status"] == "serving"


def test_malformed_json_and_out_of_vocabulary_ids_are_400(http, tiny_server):
    response = http.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert "malformed JSON" in assert_error(response, 400, "INVALID_ARGUMENT")["message"]
    outside = tiny_server.vocab_size
    assert_error(http.post("/v1/completions", json={"prompt": [1, outside]}), 400, "INVALID_ARGUMENT")
    assert_error(http.post("/v1/sessions", json={"token_ids": [-1]}), 400, "INVALID_ARGUMENT")
    session = http.post("/v1/sessions", json={"token_ids": [1]}).json()["session_id"]
    assert_error(http.post(f"/v1/sessions/{session}/tokens", json={"token_ids": [outside]}), 400, "INVALID_ARGUMENT")


def test_unknown_session_and_route_are_404(http):
    for call in (http.get, http.delete):
        assert_error(call("/v1/sessions/no-such-session"), 404, "NOT_FOUND")
    assert_error(http.post("/v1/sessions/no-such-session/generate", json={}), 404, "NOT_FOUND")
    assert_error(http.get("/v1/nothing-here"), 404, "NOT_FOUND")


def test_auth_keys_and_owner_scoping(auth_server):
    url = auth_server.http_url
    a = httpx.Client(base_url=url, timeout=TIMEOUT, headers={"authorization": "Bearer key-a"})
    b = httpx.Client(base_url=url, timeout=TIMEOUT, headers={"authorization": "Bearer key-b"})
    anonymous = httpx.Client(base_url=url, timeout=TIMEOUT)
    with a, b, anonymous:
        assert_error(anonymous.get("/v1/models"), 401, "UNAUTHENTICATED")
        assert_error(anonymous.post("/v1/completions", content=b"{oops"), 401, "UNAUTHENTICATED")
        wrong = anonymous.get("/v1/sessions", headers={"authorization": "Bearer key-c"})
        assert assert_error(wrong, 401, "UNAUTHENTICATED") and wrong.headers["www-authenticate"] == "Bearer"
        assert anonymous.get("/healthz").json()["status"] == "serving"
        assert anonymous.get("/metrics").status_code == 200

        session = a.post("/v1/sessions", json={"token_ids": [3, 4]}).json()["session_id"]
        assert a.get(f"/v1/sessions/{session}").status_code == 200
        theirs = assert_error(b.get(f"/v1/sessions/{session}"), 404, "NOT_FOUND")
        missing = assert_error(b.get("/v1/sessions/x"), 404, "NOT_FOUND")
        assert theirs["message"].replace(session, "x") == missing["message"]
        assert_error(b.post(f"/v1/sessions/{session}/tokens", json={"token_ids": [5]}), 404, "NOT_FOUND")
        assert_error(b.delete(f"/v1/sessions/{session}"), 404, "NOT_FOUND")
        assert session not in {info["session_id"] for info in b.get("/v1/sessions").json()["data"]}
        assert a.get(f"/v1/sessions/{session}").json()["history_tokens"] == 2
        assert a.delete(f"/v1/sessions/{session}").status_code in (200, 204)
        assert "closed" in assert_error(a.get(f"/v1/sessions/{session}"), 404, "NOT_FOUND")["message"]
        ended = assert_error(b.get(f"/v1/sessions/{session}"), 404, "NOT_FOUND")  # not even that it existed
        assert ended["message"].replace(session, "x") == missing["message"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="key-b", max_retries=0)
        assert client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=2).choices


# ---- metrics -------------------------------------------------------------------------------------


def test_metrics_expose_every_kiln_metric_and_count_requests(http):
    http.get("/v1/sessions/not-a-session")
    samples = scrape(http)
    names = {name for name, _ in samples}
    declared = set(re.findall(r'"(kiln_[a-z_]+)"', Path(metrics_module.__file__).read_text()))
    assert len(declared) >= 10
    assert {metric for metric in declared if not any(name.startswith(metric) for name in names)} == set()

    route = "http/v1/sessions/{session_id}"
    not_found = ("kiln_requests_total", (("route", route), ("status", "NOT_FOUND")))
    before = samples[not_found]
    http.get("/v1/sessions/not-a-session")
    http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    after = scrape(http)
    assert after[not_found] == before + 1
    assert after[("kiln_requests_total", (("route", "http/v1/completions"), ("status", "OK")))] >= 1
    assert ("kiln_request_duration_seconds_count", (("route", route),)) in after


# ---- in process ----------------------------------------------------------------------------------


def test_unexpected_errors_are_internal_and_shutdown_is_unavailable(tiny_llm, monkeypatch, caplog):
    service = RuntimeService(tiny_llm("llama"), "tiny")
    http = TestClient(build_http_app(service, ApiKeys(), Metrics(service.llm)), raise_server_exceptions=False)

    def broken(*_: object) -> None:
        raise RuntimeError("a bug")

    def odd(*_: object) -> None:
        raise KilnError("an error without a status")

    monkeypatch.setattr(service, "tokenize", broken)
    monkeypatch.setattr(service, "detokenize", odd)
    bug = http.post("/v1/tokenize", json={"text": "x"})
    assert "a bug" not in assert_error(bug, 500, "INTERNAL")["message"]
    assert bug.headers["connection"] == "close"  # the server drops the connection after a bug
    with caplog.at_level(logging.ERROR):
        assert_error(http.post("/v1/detokenize", json={"token_ids": [1]}), 500, "INTERNAL")
    assert "an error without a status" in caplog.text
    internal = scrape(http)[("kiln_requests_total", (("route", "http/v1/tokenize"), ("status", "INTERNAL")))]
    assert internal == 1
    assert http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 200

    service.stop_admitting()
    assert_error(http.post("/v1/completions", json={"prompt": [1, 2]}), 503, "UNAVAILABLE")
    assert http.get("/healthz").status_code == 503


def test_oversized_bodies_are_refused_before_they_are_read(tiny_llm):
    """A declared Content-Length over the limit and a chunked upload that grows past it both get 413
    with RESOURCE_EXHAUSTED (as gRPC reports an oversized message), counted; smaller bodies pass."""
    service = RuntimeService(tiny_llm("llama"), "tiny")
    http = TestClient(build_http_app(service, ApiKeys(), Metrics(service.llm), max_request_bytes=1000))
    body = json.dumps({"prompt": list(range(3, 400)), "max_tokens": 1}).encode()
    assert len(body) > 1000
    error = assert_error(http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"}),
                         413, "RESOURCE_EXHAUSTED")
    assert "1000 bytes" in error["message"] and error["type"] == "invalid_request_error"

    def chunks() -> Iterator[bytes]:  # no Content-Length: sent with Transfer-Encoding: chunked
        yield from (body[i : i + 100] for i in range(0, len(body), 100))

    chunked = assert_error(http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}),
                           413, "RESOURCE_EXHAUSTED")
    assert chunked["message"].startswith("request body of at least")  # counted as it arrived, no length declared
    assert http.post("/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 1}).status_code == 200
    refused = scrape(http)[("kiln_requests_total", (("route", "http/v1/completions"), ("status", "RESOURCE_EXHAUSTED")))]
    assert refused == 2


@pytest.mark.parametrize(("path", "body", "held"), [
    ("/v1/tokenize", {"text": "héllo " * 150_000}, "encode"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 1}, "encode"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, "encode"),
    ("/v1/sessions", {"token_ids": [1, 2]}, "create_session"),
])
def test_a_slow_route_leaves_the_loop_serving_everyone_else(tiny_llm, monkeypatch, path, body, held):
    """Tokenizing (a prompt, a chat, megabytes of text) and session calls run off the event loop."""
    service = RuntimeService(tiny_llm("llama"), "tiny")
    target = service.llm.tokenizer if held == "encode" else service
    entered, release = held_until_released(monkeypatch, target, held)
    with TestClient(build_http_app(service, ApiKeys(), Metrics(service.llm))) as http, ThreadPoolExecutor(1) as pool:
        slow = pool.submit(http.post, path, json=body)
        try:
            assert entered.wait(timeout=30)
            health = http.get("/healthz")
            answered_meanwhile = not slow.done()
        finally:
            release.set()
        assert answered_meanwhile and health.status_code == 200
        assert slow.result().status_code in (200, 201), slow.result().text


def test_a_session_gets_its_own_kv_policy(http):
    body = {"token_ids": list(range(5, 105)), "kv_policy": "restore", "kv_sink_tokens": 16, "kv_window_tokens": 32}
    info = http.post("/v1/sessions", json=body).json()
    assert (info["kv_policy"], info["kv_sink_tokens"], info["kv_window_tokens"]) == ("restore", 16, 32)
    assert info["kv_bytes_per_token"] > 0 and info["tier_bytes_per_token"] > 0
    generated = http.post(f"/v1/sessions/{info['session_id']}/generate", json={"max_tokens": 2})
    assert generated.status_code == 200, generated.text
    assert http.get(f"/v1/sessions/{info['session_id']}").json()["host_tier_bytes"] > 0


def held_store_lock(store) -> tuple[threading.Event, threading.Event]:  # noqa: ANN001 - the SessionStore
    """Another thread holds the store's lock (as a slow session operation would) until `release`, or
    10 s at most (a server that blocks its loop on it then fails the test rather than hanging)."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store.lock:
            entered.set()
            release.wait(timeout=10)

    threading.Thread(target=hold, daemon=True).start()
    assert entered.wait(timeout=30)
    return entered, release


@pytest.mark.parametrize("held", ["engine", "store"])
def test_a_scrape_during_a_slow_operation_leaves_the_loop_serving(tiny_llm, monkeypatch, held):
    """A scrape reads state under the engine and store locks; while another thread holds one, health
    probes and generations on the same loop are still answered."""
    service = RuntimeService(tiny_llm("llama"), "tiny")
    if held == "engine":
        entered, release = held_until_released(monkeypatch, service.llm.engine, "kv_usage")
    else:
        entered, release = held_store_lock(service.sessions)
    with TestClient(build_http_app(service, ApiKeys(), Metrics(service.llm))) as http, ThreadPoolExecutor(1) as pool:
        scrape = pool.submit(http.get, "/metrics")
        try:
            assert entered.wait(timeout=30)
            health = http.get("/healthz")
            completion = http.post("/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 2, "stream": True})
            answered_meanwhile = not release.is_set() and not scrape.done()
        finally:
            release.set()
        assert answered_meanwhile
        assert health.status_code == 200 and health.json()["status"] == "serving"
        assert completion.status_code == 200 and completion.text.endswith("data: [DONE]\n\n")
        assert scrape.result().status_code == 200 and "kiln_sessions_active" in scrape.result().text


def test_healthz_reports_a_dead_engine_and_generations_are_unavailable(tiny_llm, monkeypatch):
    service = RuntimeService(tiny_llm("llama"), "tiny")

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in the step and in its error handler")

    monkeypatch.setattr(service.llm.engine, "step", broken)  # a step fails, and so does failing its requests
    monkeypatch.setattr(service.llm.engine, "_fail", broken)
    with TestClient(build_http_app(service, ApiKeys(), Metrics(service.llm))) as http:
        failed = http.post("/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 2})
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "UNAVAILABLE"
        health = http.get("/healthz")
        assert health.status_code == 503 and health.json()["status"] == "engine_failed"
        refused = http.post("/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 2})
        assert refused.status_code == 503
