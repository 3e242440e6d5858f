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

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = re.compile(r"\.venv/bin/python - <<'PY'\n(.*?)\nPY\n", re.S)


@pytest.mark.parametrize("keyed", [False, True])
def test_the_banners_examples_run_as_printed(tiny_server, auth_server, keyed):
    server = auth_server if keyed else tiny_server
    http = urlsplit(server.http_url)
    host, grpc_port = server.grpc_address.rsplit(":", 1)
    banner = try_it(ServeOptions(host=host, grpc_port=int(grpc_port), http_port=http.port), auth=keyed)
    scripts = SCRIPT.findall(banner)
    assert len(scripts) == 2 and banner.count("<<'PY'") == 2
    env = {**os.environ, "KILN_API_KEY": server.api_keys[0] if keyed else ""}
    for script in scripts:
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
