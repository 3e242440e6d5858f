"""What every fuzzer shares: one real `kiln serve` on a tiny model, the properties checked after
each run, and the run's size.

Properties (issue 25 § 8), checked by `FuzzTarget.check_unharmed` after every fuzz run:
- the server process is alive and healthy;
- a bystander session, made under another key before the fuzzing, has the same history and the same
  greedy continuation (token ids and text) afterwards;
- the invariant counters (`kiln_cache_invariant_violations_total`) did not move;
- no request ended INTERNAL (kiln_requests_total{status="INTERNAL"}: the counted typed internal error
  both transports answer a bug with).
Each request has a deadline (REQUEST_TIMEOUT_S): one that does not answer within it fails the run.

The run's size: FUZZ_EXAMPLES hypothesis examples per strategy (KILN_FUZZ_EXAMPLES; `make fuzz` sets a
large one), derandomised so CI runs the same inputs every time.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import requests
from hypothesis import HealthCheck, settings

from tests.server.conftest import ServerHandle, start_server, tiny_model_dir
from tests.tiny_models import TINY_CONFIGS

FUZZ_EXAMPLES = int(os.environ.get("KILN_FUZZ_EXAMPLES", "0")) or None  # None: each test's CI default
REQUEST_TIMEOUT_S = 30.0  # no request may take longer (a hang is a failure, not a slow pass)
FUZZ_KEY, BYSTANDER_KEY = "fuzz-key", "bystander-key"
BYSTANDER_PROMPT = list(b"The bystander's history: it must not change.")
BYSTANDER_TOKENS = 12
UNTHROTTLED = ("--auth-failure-threshold", "0")
RAW = "\u0000raw JSON goes here\u0000"  # the placeholder post_spliced replaces
COUNTERS = {  # counters no request may move: the invariant checks, and INTERNAL answers on both transports
    "kiln_cache_invariant_violations_total": "", "kiln_requests_total": 'status="INTERNAL"'}


def fuzz_settings(ci_examples: int) -> settings:
    """Hypothesis settings of one fuzz test: `ci_examples` in `make test`, KILN_FUZZ_EXAMPLES under
    `make fuzz`; derandomised (the same inputs every run), no per-example deadline (the server's
    answer time is bounded by REQUEST_TIMEOUT_S instead), no example database."""
    return settings(max_examples=FUZZ_EXAMPLES or ci_examples, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


@dataclass
class FuzzTarget:
    """The server under fuzzing. Should a fuzz run kill it, that run fails (check_unharmed) and the next
    test gets a fresh server (`begin`), so one crash does not hide what the other fuzzers find."""

    start: Callable[[], ServerHandle]
    server: ServerHandle | None = None
    http: requests.Session = field(default_factory=requests.Session)
    bystander_id: str = ""
    bystander_reply: dict = field(default_factory=dict)
    counted: dict[str, float] = field(default_factory=dict)  # the counters' values at the last check
    tried: Counter = field(default_factory=Counter)  # inputs sent per route, reported at the end
    _channel: grpc.Channel | None = None

    @property
    def url(self) -> str:
        return self.server.http_url

    @property
    def vocab_size(self) -> int:
        return self.server.vocab_size

    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.server.grpc_address)
        return self._channel

    def begin(self) -> None:
        """Before a test: a running server with its bystander (a fresh one if the last died), and the
        counters as they stand, so the test is blamed only for what it moves."""
        if self.server is None or self.server.process.poll() is not None:
            self.stop()
            self.server = self.start()
            created = self.post("/v1/sessions", {"token_ids": BYSTANDER_PROMPT}, BYSTANDER_KEY)
            assert created.status_code == 201, created.text
            self.bystander_id = created.json()["session_id"]
            self.bystander_reply = self._bystander_continuation()
        self.counted = self.counters()

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.server is not None:
            self.server.stop()

    def headers(self, key: str = FUZZ_KEY) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def post(self, path: str, body: object, key: str = FUZZ_KEY) -> requests.Response:
        return self.http.post(self.url + path, json=body, headers=self.headers(key), timeout=REQUEST_TIMEOUT_S)

    def post_spliced(self, path: str, body: dict, raw: str, timeout: float = REQUEST_TIMEOUT_S) -> requests.Response:
        """POST `body` with its RAW value replaced by the JSON text `raw` (which may nest deeper than
        Python's json module encodes)."""
        text = json.dumps(body).replace(json.dumps(RAW), raw)
        return self.http.post(self.url + path, data=text.encode(), timeout=timeout,
                              headers={**self.headers(), "Content-Type": "application/json"})

    def get(self, path: str, key: str = FUZZ_KEY) -> requests.Response:
        return self.http.get(self.url + path, headers=self.headers(key), timeout=REQUEST_TIMEOUT_S)

    def _bystander_continuation(self) -> dict:
        """The greedy continuation of the bystander's history, generated on a fork (so the bystander
        itself never changes), with its history."""
        history = self.get(f"/v1/sessions/{self.bystander_id}/tokens", BYSTANDER_KEY)
        assert history.status_code == 200, f"the bystander session is gone: {history.text}"
        fork = self.post(f"/v1/sessions/{self.bystander_id}/fork", {}, BYSTANDER_KEY).json()["session_id"]
        reply = self.post(f"/v1/sessions/{fork}/generate", {"max_tokens": BYSTANDER_TOKENS, "temperature": 0,
                                                             "ignore_eos": True}, BYSTANDER_KEY)
        assert reply.status_code == 200, reply.text
        self.http.delete(f"{self.url}/v1/sessions/{fork}", headers=self.headers(BYSTANDER_KEY), timeout=REQUEST_TIMEOUT_S)
        return {"history": history.json()["token_ids"], "token_ids": reply.json()["token_ids"],
                "text": reply.json()["text"]}

    def counters(self) -> dict[str, float]:
        """Each of COUNTERS: the sum of its /metrics samples whose labels contain the given text."""
        text = self.http.get(self.url + "/metrics", timeout=REQUEST_TIMEOUT_S).text
        return {name: _sum_of(text, name, labels) for name, labels in COUNTERS.items()}

    def check_unharmed(self) -> None:
        """The properties every fuzz run must leave true; counters are compared with the last check, so
        a run is blamed only for what it caused."""
        assert self.server.process.poll() is None, "kiln serve died:\n" + "".join(self.server.log[-40:])
        health = self.http.get(self.url + "/healthz", timeout=REQUEST_TIMEOUT_S)
        assert health.status_code == 200 and health.json()["status"] == "serving", health.text
        assert self._bystander_continuation() == self.bystander_reply, "the bystander session changed"
        counted, self.counted = self.counted, self.counters()
        grown = {name: self.counted[name] - counted[name] for name in COUNTERS if self.counted[name] != counted[name]}
        assert not grown, f"counters that must stay put grew: {grown}\n" + "".join(self.server.log[-60:])


def _sum_of(metrics: str, name: str, labels: str) -> float:
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return sum(float(value) for found, value in pattern.findall(metrics) if labels in found)


@pytest.fixture(scope="package")
def fuzz_target(tmp_path_factory) -> Iterator[FuzzTarget]:
    """One `kiln serve` for every fuzzer (two keys: the fuzzer's and the bystander's; snapshots in a
    temporary directory, so the snapshot routes run too), its bystander made before any fuzzing. Invalid
    requests send wrong keys by the hundred: the failed-authentication throttle is off, or it would
    lock the fuzzer's own address out (tests/server/test_quotas.py tests it)."""
    root: Path = tmp_path_factory.getbasetemp() / "fuzz-servers"
    root.mkdir(exist_ok=True)

    def start() -> ServerHandle:
        snapshots = tmp_path_factory.mktemp("fuzz-snapshots")
        return start_server(str(tiny_model_dir(root)), root / "cache", (FUZZ_KEY, BYSTANDER_KEY),
                            ("--snapshot-dir", str(snapshots), *UNTHROTTLED), vocab_size=TINY_CONFIGS["llama"].vocab_size)

    target = FuzzTarget(start)
    try:
        target.begin()
        yield target
        print("\nfuzz inputs tried per route:", *(f"  {route}: {count}" for route, count in sorted(target.tried.items())),
              sep="\n")
    finally:
        target.stop()


@pytest.fixture(autouse=True)
def _live_target(request) -> None:
    """Every fuzz test starts on a live server (the last one may have been killed by a finding)."""
    if "fuzz_target" in request.fixturenames:
        request.getfixturevalue("fuzz_target").begin()
