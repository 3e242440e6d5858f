"""`kiln chat` over piped input on a tiny model directory: replies stream, and each turn reports what
it prefilled and what it reused from the session's cache; a model without a chat template is noted as
a base model; lines starting with "/" are commands. `kiln --version`; Ctrl-C during a start."""

import io
import json
import os
import re
import signal
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from kiln.cli import main
from tests.conftest import byte_tokenizer
from tests.tiny_models import tiny_hf_model


def tiny_model(root: Path) -> Path:
    model_dir = root / "tiny-llama"
    tiny_hf_model("llama").save_pretrained(model_dir)
    byte_tokenizer().backend.save(str(model_dir / "tokenizer.json"))
    return model_dir


def test_chat_reports_prefill_and_reuse_per_turn(tmp_path):
    model_dir = tiny_model(tmp_path)
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "chat", "--model", str(model_dir), "--max-tokens", "5", "--kv-budget-mb", "8"],
        input="hello there\nand again\n",
        capture_output=True, text=True, timeout=300, check=True, env=env,
    )
    stats = re.findall(r"prefilled (\d+) · reused (\d+) from cache · generated (\d+)", run.stderr)
    assert len(stats) == 2, run.stderr
    (first_prefill, first_reused, generated), (second_prefill, second_reused, _) = [tuple(map(int, s)) for s in stats]
    assert first_reused == 0 and first_prefill > 0 and second_prefill > 0
    # the whole first prompt at least: the conversation's rendering extends it (kiln/chat.py)
    assert first_prefill <= second_reused <= first_prefill + generated - 1
    assert run.stdout.count("model> ") == 2
    assert "is a base model (no chat template)" in run.stderr  # so it chats in a transcript (kiln/chat.py)


def test_version_names_the_package(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"kiln {version('kiln')}"


def test_chat_slash_commands_are_not_sent_to_the_model(tmp_path, monkeypatch, capsys):
    """Each command answers on stderr; only the three lines that are turns reach the model ("//" sends a
    line with one "/"), and /quit ends the chat before the line after it."""
    model_dir = tiny_model(tmp_path)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    lines = ["/help", "/system Answer briefly.", "hello", "/fork", "/save", "/bogus", "//slash", "/reset", "again",
             "/system", "/quit", "never sent"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["chat", "--model", str(model_dir), "--max-tokens", "3", "--kv-budget-mb", "8"]) == 0
    out, err = capsys.readouterr()
    assert out.count("model> ") == 3, out
    assert len(re.findall(r"prefilled \d+ · reused", err)) == 3
    for command in ("/help", "/reset", "/system TEXT", "/fork", "/save", "/quit"):
        assert re.search(rf"^  {re.escape(command)} ", err, re.M), err
    assert "system prompt set: Answer briefly." in err and "system prompt removed" in err
    assert re.search(r"forked: the conversation goes on in session \S+; session \S+ stays as it was", err)
    assert "not saved: snapshots are off" in err  # in process without --snapshot-dir
    assert "unknown command /bogus" in err and "a new conversation (the system prompt stays)" in err
    assert "kiln chat: loading" in err  # the start names its phases


WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
                   "additionalProperties": False}}}]


def chat_with_tools(tmp_path: Path, monkeypatch, capsys, model: str, lines: list[str], *flags: str) -> tuple[str, str]:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(WEATHER_TOOLS))
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["chat", "--model", model, "--tools", str(tools), "--kv-budget-mb", "32", *flags]) == 0
    return capsys.readouterr()


def test_chat_tools_show_the_call_and_take_its_result(tmp_path, monkeypatch, capsys):
    """--tool-choice required: the reply to the user is one call, printed as it parses, within its schema;
    the next line is its result, and the reply to that may be text (auto)."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    out, err = chat_with_tools(tmp_path, monkeypatch, capsys, str(tiny_model(tmp_path)),
                               ["What is the weather in Paris?", '{"sky": "sunny"}'], "--tool-choice", "required",
                               "--max-tokens", "120")
    call = re.match(r"model> \[call get_weather\] (\{.*?\})model> ", out)  # stdout holds only the replies
    assert call, out
    arguments = json.loads(call.group(1))
    assert set(arguments) == {"city"} and len(arguments["city"]) <= 12
    assert "the model called 1 tool(s): type each call's result" in err
    assert out.count("model> ") == 2 and len(re.findall(r"prefilled \d+ · reused", err)) == 2


def test_chat_tools_refuse_a_bad_file_or_choice(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "get_weather"}')
    model = str(tiny_model(tmp_path))
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["chat", "--model", model, "--tools", str(bad), "--kv-budget-mb", "8"]) == 2
    assert f"--tools {bad} must hold a JSON list of tools" in capsys.readouterr().err
    bad.write_text(json.dumps(WEATHER_TOOLS))
    assert main(["chat", "--model", model, "--tools", str(bad), "--tool-choice", "get_time", "--kv-budget-mb", "8"]) == 2
    assert "--tool-choice must be auto or required or a function of --tools" in capsys.readouterr().err


@pytest.mark.embedded
def test_the_embedded_instruct_model_calls_a_tool_in_chat(tmp_path, monkeypatch, capsys):
    """`kiln chat --model smollm2-135m-instruct --tools`: a real call with the city asked about, then an
    answer from its result."""
    out, _ = chat_with_tools(tmp_path, monkeypatch, capsys, "smollm2-135m-instruct",
                             ["What is the weather in Paris?", '{"temperature_c": 18, "sky": "sunny"}'],
                             "--tool-choice", "required")
    assert 'model> [call get_weather] {"city": "Paris"}' in out
    assert "sunny" in out.split("model> ")[2]


HELD_LOAD = """
import sys, time
from kiln.cli import main
import kiln.llm

def held(*args, **kwargs):
    time.sleep(60)  # a load that takes long: Ctrl-C lands in it

kiln.llm.load_model = held
sys.exit(main(sys.argv[1:]))
"""


def _interruptible() -> None:
    """Ctrl-C's default disposition, as a terminal gives a command: a suite run in the background (`make test &`)
    ignores SIGINT, and a child inherits that (Python then installs no handler, and kiln none either)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("moment", ["importing", "loading"])
def test_ctrl_c_during_the_start_exits_130_without_a_traceback(tmp_path, moment):
    """Ctrl-C lands while the command imports torch (just after kiln.startup, the first import of kiln.cli:
    `-X importtime` reports each import as it completes); the other once the load began."""
    launcher = ["-X", "importtime", "-m", "kiln.cli"] if moment == "importing" else ["-c", HELD_LOAD]
    command = [sys.executable, *launcher, "serve",
               "--model", str(tmp_path / "no-model"), "--no-persist", "--grpc-port", "0", "--http-port", "0"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               preexec_fn=_interruptible)
    if moment == "importing":
        assert any(line.rstrip().endswith("| kiln.startup") for line in process.stderr)
    else:
        assert process.stderr.readline().startswith("kiln serve: loading")
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 130
    err = process.stderr.read()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
