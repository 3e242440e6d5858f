"""Sessions of a process that ends without closing: a script whose LLM is never closed saves its last turn
and hands its sessions off at interpreter exit (no traceback; the next process restores the whole history
at once), and a lease whose holder process on this host has exited (killed) is taken over at once, while
one of a live process, or of another host, is waited out. (`kiln serve` closes its LLM on SIGTERM:
tests/snapshots/test_server.py::test_two_servers_share_one_redis.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kiln.errors import FailedPreconditionError
from kiln.llm import LLM
from kiln.snapshots.ownership import Ownership
from kiln.snapshots.store import open_store, this_host
from tests.server.conftest import tiny_model_dir

PROMPT = list(range(40, 90))
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
LONG_TTL_S = 600.0  # a lease that cannot lapse during a test: only a hand-off or a take-over frees it

# A script that ends after its turn without llm.close(): its stdout is the session id and its history.
SCRIPT = f"""
import sys
from kiln.llm import LLM
llm = LLM(sys.argv[1], cache_dir=sys.argv[2], snapshot_dir=sys.argv[3], lease_ttl_s={LONG_TTL_S},
          speculative=None, kv_budget_bytes=16 << 20)
session = llm.create_session({PROMPT})
session.generate(**{GREEDY}).result()
print(session.id, *session.tokens)
"""

# Takes a lease and holds it (never renewed, never released) until stdin closes; `elsewhere` takes it as
# a process of another host would.
HOLDER = f"""
import socket, sys
from kiln.snapshots.store import open_store
if sys.argv[3] == "elsewhere":
    socket.gethostname = lambda: "another-host"
lease = open_store(sys.argv[1]).acquire_lease(sys.argv[2], "holder-x/1", {LONG_TTL_S})
print(lease.pid, lease.host, flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def model(servers_root) -> tuple[Path, Path]:
    return tiny_model_dir(servers_root, "llama"), servers_root / "cache"


def restored(model: tuple[Path, Path], store: Path, session_id: str) -> list[int]:
    """The session's history as another process gets it at once (a live lease would refuse it)."""
    with LLM(model[0], cache_dir=model[1], snapshot_dir=str(store), speculative=None, kv_budget_bytes=16 << 20) as llm:
        return llm.get_session(session_id).tokens


def test_a_script_that_never_closes_its_llm_hands_its_sessions_off_at_exit(model, tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model[0]), str(model[1]), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=True)
    assert "Traceback" not in done.stderr and "failed" not in done.stderr, done.stderr
    session_id, *history = done.stdout.split()
    assert len(history) == len(PROMPT) + GREEDY["max_tokens"]
    assert restored(model, tmp_path, session_id) == [int(token) for token in history]  # its last turn too


def hold(target: str, name: str, where: str = "here") -> tuple[subprocess.Popen, int, str]:
    """A process holding `name`'s lease (its pid and host as the lease records them)."""
    process = subprocess.Popen([sys.executable, "-c", HOLDER, target, name, where], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    pid, _, host = process.stdout.readline().strip().partition(" ")
    assert pid, "the holder process did not take its lease"
    return process, int(pid), host


def kill(process: subprocess.Popen) -> None:
    """SIGKILL: the holder never hands off."""
    process.kill()
    process.wait()
    process.stdin.close()
    process.stdout.close()


def test_a_lease_whose_holder_process_exited_is_taken_over_at_once(store_target):
    store = open_store(store_target)
    taker = Ownership(store, "taker")
    live, pid, host = hold(store_target, "s1")
    lease = store.lease_of("s1")
    assert (lease.holder, lease.pid, lease.host) == ("holder-x/1", pid, this_host()) and host == this_host()
    with pytest.raises(FailedPreconditionError, match="live on another server"):  # its process runs
        taker.acquire("s1")
    kill(live)
    taker.acquire("s1")  # at once: its lease had 600 s left
    assert store.lease_of("s1").holder == taker.holder

    elsewhere, _, other_host = hold(store_target, "s2", "elsewhere")
    kill(elsewhere)
    assert other_host != this_host()
    with pytest.raises(FailedPreconditionError, match="live on another server"):  # a pid of another host says nothing
        taker.acquire("s2")
    taker.close()
    store.close()
