"""`kiln serve` as a process: refuses unsafe binds and busy ports, shuts down cleanly on SIGTERM, exits
non-zero when its engine dies, and keeps each instance's sessions apart."""

import asyncio
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from kiln import LLM, KilnError
from kiln.cli import EXIT_ENGINE_FAILED, main
from kiln.client import Client
from kiln.server.app import EngineFailedError, ServeOptions, serve_async, try_it
from kiln.snapshots.instance import default_directory
from tests.server.conftest import free_port, start_server, tiny_model_dir


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
    # all of turn one's prompt, and its reply too unless the conversation's rendering writes it otherwise
    assert prefilled + reused <= second_reused <= prefilled + reused + generated - 1


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
            model="kiln", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0,
        )
        assert reply.choices[0].message.content and reply.usage.completion_tokens <= 8
    finally:
        assert server.stop() < 10
    with LLM(kv_budget_bytes=64 * 1024**2) as llm:
        assert remote == llm.generate(prompt, max_tokens=12)[0].token_ids


BREAK_THE_ENGINE = """
import sys
from kiln.cli import main
from kiln.engine.engine import Engine

def broken(self, *args, **kwargs):
    raise RuntimeError("injected: a bug in the step and in its error handler")

Engine.step = broken  # a step fails, and so does failing its requests: the loop dies
Engine._fail = broken
sys.exit(main(sys.argv[1:]))
"""


def test_serve_exits_non_zero_when_the_engine_dies(servers_root):
    """The first generation kills the engine's loop: it ends UNAVAILABLE, and the process exits with
    the status a supervisor restarts on (not the usage error's 2)."""
    server = start_server(str(tiny_model_dir(servers_root)), servers_root / "cache", launcher=("-c", BREAK_THE_ENGINE))
    try:
        reply = httpx.post(f"{server.http_url}/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 2}, timeout=60)
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "UNAVAILABLE"
        assert server.process.wait(timeout=60) == EXIT_ENGINE_FAILED, "".join(server.log)
    finally:
        server.stop()
    assert any("engine failed" in line for line in server.log), "".join(server.log)


def test_serve_async_shuts_down_and_raises_when_the_engine_dies(tiny_llm, monkeypatch):
    """In process: the watchdog stops the server once the loop died, and serve_async raises."""
    llm = tiny_llm("llama")
    options = ServeOptions(grpc_port=free_port(), http_port=free_port(), shutdown_grace_s=0)
    # signals belong to the main thread; this server runs on another
    monkeypatch.setattr(asyncio.SelectorEventLoop, "add_signal_handler", lambda *args: None)
    outcome: list[BaseException | None] = []

    def serve() -> None:
        try:
            asyncio.run(serve_async(llm, options))
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - the outcome is the test's subject
            outcome.append(error)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{options.http_port}"
    deadline = time.monotonic() + 60
    while not _answers(f"{url}/healthz"):
        assert thread.is_alive() and time.monotonic() < deadline, outcome

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in the step and in its error handler")

    monkeypatch.setattr(llm.engine, "step", broken)
    monkeypatch.setattr(llm.engine, "_fail", broken)
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 2}, timeout=60)
    assert reply.status_code == 503
    thread.join(timeout=60)
    assert not thread.is_alive() and isinstance(outcome[0], EngineFailedError)
    assert isinstance(outcome[0].__cause__, RuntimeError)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        time.sleep(0.05)  # not listening yet
        return False


def test_a_port_in_use_is_refused_before_the_model_loads(capsys):
    """The model path does not exist: a refusal that names the ports came before any load."""
    with socket.socket() as grpc_busy, socket.socket() as http_busy:
        for busy in (grpc_busy, http_busy):
            busy.bind(("127.0.0.1", 0))
            busy.listen()
        grpc_port, http_port = grpc_busy.getsockname()[1], http_busy.getsockname()[1]
        free = str(free_port())
        assert main(["serve", "--model", "unused", "--grpc-port", free, "--http-port", str(http_port)]) == 2
        assert f"--http-port {http_port} is in use; pick another with --http-port" in capsys.readouterr().err
        assert main(["serve", "--model", "unused", "--grpc-port", str(grpc_port), "--http-port", str(http_port)]) == 2
        err = capsys.readouterr().err
    assert f"--grpc-port {grpc_port} is in use and --http-port {http_port} is in use" in err, err
    assert "pick another with --grpc-port / --http-port" in err


def test_each_instance_keeps_its_own_sessions_and_the_banner_leaves_none(tmp_path, monkeypatch, capsys):
    """Two servers' default stores: the model's instance directory under XDG_DATA_HOME, held by the live
    server (a second one of the same instance is refused before it loads), found again by the same
    instance and never seen by another. The banner's SDK example closes the session it opens."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    model = tiny_model_dir(tmp_path)
    server = start_server(str(model), tmp_path / "cache", default_store=True)
    try:
        host, grpc_port = server.grpc_address.rsplit(":", 1)
        banner = try_it(ServeOptions(host=host, grpc_port=int(grpc_port), http_port=0), auth=False)
        sdk_example = re.search(r"<<'PY'\n(from kiln.client.*?)\nPY\n", banner, re.S).group(1)
        run = subprocess.run([sys.executable, "-"], input=sdk_example, capture_output=True, text=True, timeout=120,
                             cwd=Path(__file__).resolve().parents[2])
        assert run.returncode == 0, run.stderr
        with Client(server.grpc_address) as client:
            assert client.list_sessions() == []  # the example's session is gone, saved copy included
            kept = client.create_session([5, 6, 7]).id
        assert main(["serve", "--model", str(model), "--grpc-port", str(free_port()), "--http-port", str(free_port())]) == 2
        assert f"instance tiny-llama is already served by process {server.process.pid}" in capsys.readouterr().err
    finally:
        assert server.stop() < 30 and server.process.returncode == 0, "".join(server.log)
    assert any(line.startswith("kiln serve: listening on") for line in server.log), "".join(server.log)
    own = default_directory("tiny-llama")
    assert own == tmp_path / "data" / "kiln" / "instances" / "tiny-llama" / "snapshots"
    with LLM(str(model), cache_dir=str(tmp_path / "cache"), snapshot_dir=str(own)) as again:
        assert [info.session_id for info in again.sessions.list()] == [kept]
    with LLM(str(model), cache_dir=str(tmp_path / "cache"), snapshot_dir=str(default_directory("other"))) as other:
        assert other.sessions.list() == []
