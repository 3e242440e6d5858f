"""`Kiln-Session: NAME` through the real `openai` package against real `kiln serve` processes on
SmolLM2-135M-Instruct (its own chat template): an agent that re-sends its whole conversation each turn
prefills only the new messages, before and after a kill -9 and restart; an edited history forks at the
first difference; names are per API key; bad uses are refused."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import ServerHandle, start_server

MODEL = "smollm2-135m-instruct"
KEYS = ("key-a", "key-b")
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."}
QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which of the two is further north?",
             "Name a river in the first one."]


def serve(servers_root: Path, store: Path) -> ServerHandle:
    return start_server(MODEL, servers_root / "cache", KEYS, ("--snapshot-dir", str(store), "--speculative", "none"))


def client(server: ServerHandle, name: str | None = "agent-1", key: str = KEYS[0]) -> openai.OpenAI:
    headers = {"Kiln-Session": name} if name else {}
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key=key, max_retries=0, default_headers=headers)


def turn(oai: openai.OpenAI, messages: list[dict]):  # noqa: ANN201 - the raw response
    return oai.chat.completions.with_raw_response.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)


def test_an_agent_prefills_only_its_new_messages_before_and_after_kill_9(servers_root, tmp_path):
    store = tmp_path / "store"
    server = serve(servers_root, store)
    restarted = None
    try:
        agent, messages = client(server), [SYSTEM]
        history = 0  # the session's history after the last turn: its prompt and its reply
        session_id = None
        for number, question in enumerate(QUESTIONS[:-1]):
            messages.append({"role": "user", "content": question})
            raw = turn(agent, messages)
            reply = raw.parse()
            usage = reply.usage
            if number == 0:
                assert raw.headers["Kiln-Session-Recomputed"] == "new session"
                session_id = raw.headers["Kiln-Session-Id"]
            else:
                assert raw.headers["Kiln-Session-Recomputed"] == "none"
                assert raw.headers["Kiln-Session-Id"] == session_id
                # every earlier token, none again, but the last one generated (sampled, never yet fed)
                assert usage.prompt_tokens_details.cached_tokens == history - 1
            history = usage.prompt_tokens + usage.completion_tokens
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        assert httpx.get(f"{server.http_url}/v1/sessions/{session_id}", timeout=30,
                         headers={"Authorization": f"Bearer {KEYS[0]}"}).json()["history_tokens"] == history

        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        restarted = serve(servers_root, store)
        messages.append({"role": "user", "content": QUESTIONS[-1]})
        raw = turn(client(restarted), messages)
        assert raw.headers["Kiln-Session-Id"] == session_id and raw.headers["Kiln-Session-Recomputed"] == "none"
        resumed = raw.parse()
        assert resumed.usage.prompt_tokens_details.cached_tokens == history - 1  # from the snapshot, not recomputed
        stateless = client(restarted, None).chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                                   max_tokens=24)
        assert resumed.choices[0].message.content == stateless.choices[0].message.content
    finally:
        server.stop()
        if restarted is not None:
            restarted.stop()


@pytest.fixture(scope="module")
def persistent(servers_root, tmp_path_factory) -> ServerHandle:
    server = serve(servers_root, tmp_path_factory.mktemp("named") / "store")
    yield server
    server.stop()


def test_an_edited_history_forks_at_the_first_difference(persistent):
    agent = client(persistent, "editor")
    messages = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
    first = turn(agent, messages)
    messages.append({"role": "assistant", "content": first.parse().choices[0].message.content})
    messages.append({"role": "user", "content": QUESTIONS[1]})
    second = turn(agent, messages)
    edited = [{"role": "system", "content": "You are a geography teacher."}, *messages[1:]]
    third = turn(agent, edited)
    reason = third.headers["Kiln-Session-Recomputed"]
    assert reason.startswith("the rendering of earlier messages changed at token ")
    at = int(reason.rsplit(" ", 1)[1])
    assert 0 < at < second.parse().usage.prompt_tokens
    assert third.parse().usage.prompt_tokens_details.cached_tokens == at  # what the fork kept, nothing more
    old, new = second.headers["Kiln-Session-Id"], third.headers["Kiln-Session-Id"]
    assert new != old
    sessions = httpx.Client(base_url=persistent.http_url, headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=30)
    assert sessions.get(f"/v1/sessions/{old}").status_code == 404  # the name moved; the old session is closed
    assert sessions.get(f"/v1/sessions/{new}").status_code == 200


def test_names_belong_to_their_key_and_completions_take_them_too(persistent):
    a, b = (turn(client(persistent, "shared", key), [SYSTEM, {"role": "user", "content": "Hi"}]) for key in KEYS)
    assert a.headers["Kiln-Session-Id"] != b.headers["Kiln-Session-Id"]
    assert b.headers["Kiln-Session-Recomputed"] == "new session"
    completions = client(persistent, "notes").completions
    first = completions.with_raw_response.create(model=MODEL, prompt="One, two,", max_tokens=4, temperature=0)
    text = "One, two," + first.parse().choices[0].text
    again = completions.with_raw_response.create(model=MODEL, prompt=text + " and", max_tokens=4, temperature=0)
    assert again.headers["Kiln-Session-Id"] == first.headers["Kiln-Session-Id"]
    assert again.headers["Kiln-Session-Recomputed"] == "none"
    assert again.parse().usage.prompt_tokens_details.cached_tokens == first.parse().usage.total_tokens - 1


def test_streamed_turns_carry_the_session_headers(persistent):
    agent = client(persistent, "streamer")
    with agent.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[SYSTEM, {"role": "user", "content": "Hi"}], temperature=0, max_tokens=8,
            stream=True) as response:
        assert response.headers["Kiln-Session-Recomputed"] == "new session"
        assert response.headers["Kiln-Session-Id"]
        assert any(chunk.choices and chunk.choices[0].delta.content for chunk in response.parse())


@pytest.mark.parametrize(("name", "extra", "field"), [("bad name", {}, "Kiln-Session"), ("ok", {"n": 2}, "n")])
def test_bad_uses_are_refused_naming_the_field(persistent, name, extra, field):
    with pytest.raises(openai.BadRequestError) as refused:
        client(persistent, name).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                         max_tokens=4, **extra)
    assert refused.value.body["param"] == field
