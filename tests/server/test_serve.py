"""`kiln serve` as a process: refuses unsafe binds, and shuts down cleanly on SIGTERM."""

import re
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


def test_chat_talks_to_a_running_server(tiny_server):
    run = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "chat", "--server", tiny_server.grpc_address, "--max-tokens", "4"],
        input="hello there\nand again\n", capture_output=True, text=True, timeout=120, check=True,
    )
    stats = re.findall(r"prefilled (\d+) · reused (\d+) from cache · generated (\d+)", run.stderr)
    assert len(stats) == 2, run.stderr
    (prefilled, reused, generated), (_, second_reused, _) = [tuple(map(int, s)) for s in stats]
    assert second_reused == prefilled + reused + generated - 1  # all of turn one but its last token
