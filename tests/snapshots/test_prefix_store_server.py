"""The persistent prefix store through real `kiln serve` processes and the `openai` package: a stateless
chat (no session, no header) killed with kill -9 between turns and restarted on the same store resumes
from the store: the next turn's cached_tokens cover the earlier turns' full pages, as an uninterrupted
server's prefix cache does, and its reply is the uninterrupted server's."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import ServerHandle, start_server, tiny_model_dir
from tests.tiny_models import TINY_CONFIGS

PAGE = 16  # kiln serve's default page size
QUESTIONS = ["Name three rivers of Europe and say which is longest.", "And which of them is shortest?",
             "Which one flows through Vienna?", "How many countries does it cross?"]


@pytest.fixture(scope="module")
def model(servers_root) -> tuple[str, Path]:
    return str(tiny_model_dir(servers_root, "llama")), servers_root / "cache"


def serve(model: tuple[str, Path], *extra: str) -> ServerHandle:
    return start_server(model[0], model[1], (), ("--speculative", "none", *extra), TINY_CONFIGS["llama"].vocab_size)


def metric(server: ServerHandle, name: str) -> float:
    text = httpx.get(server.http_url + "/metrics", timeout=30).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name)


def ask(server: ServerHandle, messages: list[dict]):  # noqa: ANN201 - openai's ChatCompletion
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0)
    name = client.models.list().data[0].id
    return client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=24)


def test_a_stateless_chat_resumes_from_the_prefix_store_after_kill_9(model, tmp_path):
    store = ("--snapshot-dir", str(tmp_path / "store"), "--instance-id", "node-1")
    uninterrupted, first = serve(model), serve(model, *store)
    try:
        messages: list[dict] = [{"role": "system", "content": "You answer questions about geography in one line."}]
        for question in QUESTIONS[:-1]:
            messages.append({"role": "user", "content": question})
            replies = [ask(server, messages) for server in (uninterrupted, first)]
            assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
            messages.append({"role": "assistant", "content": replies[1].choices[0].message.content})
        last = replies[1].usage
        pages = (last.prompt_tokens + last.completion_tokens - 1) // PAGE  # the full pages the last turn named
        deadline = time.monotonic() + 30
        while metric(first, "kiln_prefix_store_pages") < pages:  # written behind: wait before killing
            assert time.monotonic() < deadline, "the last turn's pages were not written to the store"
            time.sleep(0.05)
        first.process.send_signal(signal.SIGKILL)
        first.process.wait()

        restarted = serve(model, *store)
        messages.append({"role": "user", "content": QUESTIONS[-1]})
        resumed, expected = ask(restarted, messages), ask(uninterrupted, messages)
        cached = resumed.usage.prompt_tokens_details.cached_tokens
        assert cached == expected.usage.prompt_tokens_details.cached_tokens  # what the pool kept, the store kept
        assert cached >= PAGE * ((last.prompt_tokens - 1) // PAGE) > 0  # at least the last turn's prompt
        assert resumed.choices[0].message.content == expected.choices[0].message.content
        assert metric(restarted, "kiln_prefix_store_restored_tokens_total") == cached
        assert metric(restarted, "kiln_prefill_tokens_total") == resumed.usage.prompt_tokens - cached
        restarted.stop()
    finally:
        for server in (uninterrupted, first):
            server.stop()
