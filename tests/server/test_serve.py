"""`kiln serve` as a process: refuses unsafe binds, and shuts down cleanly on SIGTERM."""

import subprocess
import sys

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
