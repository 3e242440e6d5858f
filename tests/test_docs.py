"""The architecture document is in the repository and every citation of it names a real section; nothing
cites a design document outside the repository; README § Agent frameworks' examples run as printed."""

import importlib.util
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
CITATION = re.compile(r"docs/architecture\.md § ([A-Z][\w -]*\w)")


def cited_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "kiln").rglob("*.py")), *sorted((ROOT / "kiln").rglob("*.cpp")),
            *sorted((ROOT / "kiln").rglob("*.h")), *sorted((ROOT / "bench").glob("*.py"))]


def test_every_citation_of_the_architecture_names_one_of_its_sections():
    sections = {line.removeprefix("## ").strip() for line in ARCHITECTURE.read_text().splitlines() if line.startswith("## ")}
    broken = [f"{path.relative_to(ROOT)}: § {name}" for path in cited_files()
              for name in CITATION.findall(path.read_text()) if name not in sections]
    assert not broken, f"citations of sections docs/architecture.md lacks ({sorted(sections)}): {broken}"


def test_nothing_cites_the_design_brief_outside_the_repository():
    offenders = [str(path.relative_to(ROOT)) for path in cited_files() if "DESIGN.md" in path.read_text()]
    assert not offenders


AGENT_FRAMEWORKS = re.compile(r"^## Agent frameworks\n(.*?)^## ", re.S | re.M)
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
README_URL = "http://127.0.0.1:8000"
AGENT_SCRIPTS = ("openai chat", "openai responses", "langchain", "agents sdk")
NEEDS = {"langchain": "langchain_openai", "agents sdk": "agents"}


def agent_frameworks_blocks() -> list[tuple[str, str]]:
    """README § Agent frameworks' fenced blocks, as (language, text)."""
    return BLOCK.findall(AGENT_FRAMEWORKS.search((ROOT / "README.md").read_text()).group(1))


@pytest.fixture(scope="module")
def agents_server(tmp_path_factory) -> Iterator[str]:
    """The section's `kiln serve` command as printed, on free ports and a fresh store."""
    command = next(text for language, text in agent_frameworks_blocks() if language == "bash").strip()
    assert command == ".venv/bin/kiln serve --model smollm2-135m-instruct --snapshot-dir /tmp/kiln-agents"
    store = tmp_path_factory.mktemp("agents") / "store"
    command = command.replace("/tmp/kiln-agents", str(store))
    http_port = free_port()
    env = {key: value for key, value in os.environ.items() if key != "KILN_API_KEY"}
    server = subprocess.Popen(["bash", "-c", f"exec {command} --grpc-port {free_port()} --http-port {http_port}"],
                              cwd=ROOT, env=env, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for line in server.stderr:
            if line.startswith("kiln serve: ready"):
                break
        threading.Thread(target=server.stderr.read, daemon=True).start()  # never a full pipe
        yield f"http://127.0.0.1:{http_port}"
    finally:
        server.terminate()
        server.wait(timeout=60)


@pytest.mark.embedded
@pytest.mark.parametrize("name", AGENT_SCRIPTS)
def test_the_agent_framework_examples_run_as_printed(agents_server, name):
    """Each script runs against the server the section starts (lint clean, exit 0), in the README's order on
    a fresh server; one followed by an output block prints that output."""
    blocks = agent_frameworks_blocks()
    scripts = [text for language, text in blocks if language == "python"]
    assert len(scripts) == len(AGENT_SCRIPTS)
    if name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None:
        pytest.skip(f"{NEEDS[name]} is not installed")
    script = scripts[AGENT_SCRIPTS.index(name)]
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F,E9",
                           "--stdin-filename", "readme.py", "-"], input=script, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    assert script.count(README_URL) == 1
    run = subprocess.run([sys.executable, "-"], input=script.replace(README_URL, agents_server), capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("\n") >= 2
    following = blocks[blocks.index(("python", script)) + 1:][:1]
    if following and following[0][0] == "":
        assert run.stdout == following[0][1]
