"""`kiln serve` as a process: refuses unsafe binds, and shuts down cleanly on SIGTERM."""

import re
import subprocess
import sys

import openai
import pytest

from kiln import LLM, KilnError
from kiln.client import Client
from tests.server.conftest import start_server, tiny_model_dir


def test_non_loopback_bind_without_key_is_refused(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "serve", "--host", "0.0.0.0", "--model", "unused"],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert run.returncode == 2
    assert "refusing to serve on 0.0.0.0 without an API key" in run.stderr


def test_sigterm_shuts_down_cleanly_and_quickly(tmp_path):
    server = start_server(str(tiny_model_dir(tmp_path)), tmp_path / "cache")
    seconds = server.stop()
    assert server.process.returncode == 0, "".join(server.log)
    assert seconds < 10
    assert any("shut down in" in line for line in server.log)


def test_sigterm_during_a_generation_ends_it_and_exits(tmp_path):
    server = start_server(str(tiny_model_dir(tmp_path)), tmp_path / "cache", extra=("--shutdown-grace-s", "0"))
    with Client(server.grpc_address) as client:
        generation = client.create_session([5, 6, 7]).generate(max_tokens=500, ignore_eos=True)
        next(generation)  # it is running
        seconds = server.stop()
        try:
            reason = generation.result().finish_reason
        except KilnError:  # the stream may end with the connection instead of a final event
            reason = "cancelled"
    assert reason == "cancelled" and len(generation.token_ids) < 500
    assert server.process.returncode == 0, "".join(server.log)
    assert seconds < 10
    assert any("1 generations cancelled" in line for line in server.log), "".join(server.log)


def test_chat_talks_to_a_running_server(tiny_server):
    run = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "chat", "--server", tiny_server.grpc_address, "--max-tokens", "4"],
        input="hello there\nand again\n", capture_output=True, text=True, timeout=120, check=True,
    )
    stats = re.findall(r"prefilled (\d+) · reused (\d+) from cache · generated (\d+)", run.stderr)
    assert len(stats) == 2, run.stderr
    (prefilled, reused, generated), (_, second_reused, _) = [tuple(map(int, s)) for s in stats]
    assert second_reused == prefilled + reused + generated - 1  # all of turn one but its last token


@pytest.mark.embedded
def test_embedded_model_served_over_grpc_and_http(tmp_path):
    """`kiln serve` with no --model serves the embedded Gemma 3 270M: a gRPC SDK session and an OpenAI
    chat request both answer, and the session's greedy tokens are the in-process ones."""
    prompt = "The capital of France is"
    server = start_server(None, None)
    try:
        with Client(server.grpc_address, tokenizer="server") as client, client.create_session() as session:
            session.append_text(prompt)
            generation = session.generate(max_tokens=12)
            remote = list(generation)
            assert generation.result().usage.prefilled_tokens == len(client.tokenize(prompt, add_special_tokens=True))
        reply = openai.OpenAI(base_url=server.http_url + "/v1", api_key="none").chat.completions.create(
            model="kiln", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
        )
        assert reply.choices[0].message.content and reply.usage.completion_tokens <= 8
    finally:
        assert server.stop() < 10
    with LLM(kv_budget_bytes=64 * 1024**2) as llm:
        assert remote == llm.generate(prompt, max_tokens=12)[0].token_ids
