"""The banner `kiln serve` prints once ready: its examples run as printed against a real server, lint clean."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from kiln.server.app import ServeOptions, try_it
from tests.server.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = re.compile(r"\.venv/bin/python - <<'PY'\n(.*?)\nPY\n", re.S)


@pytest.mark.parametrize("keyed", [False, True])
def test_the_banners_examples_run_as_printed(tiny_server, auth_server, keyed):
    server = auth_server if keyed else tiny_server
    http = urlsplit(server.http_url)
    host, grpc_port = server.grpc_address.rsplit(":", 1)
    banner = try_it(ServeOptions(host=host, grpc_port=int(grpc_port), http_port=http.port), auth=keyed)
    scripts = SCRIPT.findall(banner)
    assert len(scripts) == 3 and banner.count("<<'PY'") == 3
    env = {**os.environ, "KILN_API_KEY": server.api_keys[0] if keyed else ""}
    for script in scripts[:2]:  # the third needs the instruct model's server: test_the_instruct_examples_...
        lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F,E9",
                               "--stdin-filename", "banner.py", "-"], input=script, capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout
        run = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, cwd=ROOT, env=env,
                             timeout=120)
        assert run.returncode == 0, run.stderr
        assert run.stdout.count("\n") >= 2
    curl = re.search(r"  (curl .*?)\n\n", banner, re.S).group(1).replace("\\\n", " ")
    if shutil.which("curl"):
        reply = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, env=env, timeout=60)
        assert '"finish_reason"' in reply.stdout, reply.stdout + reply.stderr


@pytest.mark.embedded
def test_the_instruct_models_examples_run_as_printed(tmp_path):
    """The banner's second server, started by the command it prints (with the first server's key), answers its
    chat and tool-call script: the capital, a get_weather call for Paris, then an answer from the result."""
    grpc_port, http_port = free_port(), free_port()
    banner = try_it(ServeOptions(), auth=True, instruct_ports=(grpc_port, http_port))
    command = re.search(r"  (\.venv/bin/kiln serve --model smollm2-135m-instruct .*)\n", banner).group(1)
    assert command.endswith(f'--grpc-port {grpc_port} --http-port {http_port} --api-key "$KILN_API_KEY"')
    env = {**os.environ, "KILN_API_KEY": "banner-key", "XDG_DATA_HOME": str(tmp_path)}
    server = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for line in server.stderr:
            if line.startswith("kiln serve: ready"):
                break
        run = subprocess.run([sys.executable, "-"], input=SCRIPT.findall(banner)[2], capture_output=True, text=True,
                             cwd=ROOT, env=env, timeout=120)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert run.returncode == 0, run.stderr
    capital, call, answer = run.stdout.splitlines()
    assert "Paris" in capital and call == 'get_weather {"city": "Paris"}' and "sunny" in answer
