"""Slow and idle clients: a bystander's turn latency alone, and while attackers hold the HTTP edge.

One `kiln serve` (the embedded model, or `--model llama` for the tiny test model) and one bystander: an
HTTP client on a keep-alive connection that runs `--turns` greedy completions of `--max-tokens` tokens
(a fresh prompt each, so every turn prefills). The same turns are timed in each scenario:
- alone;
- slowloris: `--slowloris` connections, each sending a never-ending header block a byte a second (the
  server's header timeout closes them; the attacker reconnects at once);
- idle: `--idle` (2,000) connections opened and held, reconnected when the server closes them (its idle
  timeout);
- never-reading streams: `--streams` clients start a long streamed completion with a small receive
  buffer and never read (the server pauses them, then cancels them after its stall timeout; they
  reconnect).
The server runs with `--max-connections` above the attack's size, so what is measured is the cost of the
attackers being there, not the connection cap turning the bystander away (a cap the test suite covers).

Every scenario runs `--rounds` times, interleaved, so that a load that drifts (the machine is shared)
meets all of them alike. Writes bench/results/<name>.{json,png}: per scenario the bystander's median,
p90 and max turn latency over all its rounds and the median's ratio to alone, and per round the load
average and what the attack did (connections opened, closed by the server).

    .venv/bin/python bench/slow_clients.py               # the embedded model -> results/slow_clients.*
    .venv/bin/python bench/slow_clients.py --quick       # the tiny model, fewer turns
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import selectors
import socket
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from statistics import quantiles
from typing import Any

import common
import httpx
import servers

SCENARIOS = ("alone", "slowloris", "idle", "never_reading_streams")
HEADER_TIMEOUT_S = 10.0  # kiln serve's defaults, set explicitly so the JSON records them
IDLE_TIMEOUT_S = 5.0
STALL_TIMEOUT_S = 30.0
SMALL_RCVBUF = 4096
PAUSE_WAIT_S = 120.0  # the longest the never-reading streams may take to fill their buffers and be paused


_FORK = multiprocessing.get_context("fork")  # the attack's callables are closures: no pickling


@dataclass
class Attack:
    """Attacker connections kept at `size` until `stop` is set, by a process of their own: its loop over
    thousands of sockets must not take this process's GIL from the bystander's client it times."""

    name: str
    size: int
    connect: Callable[[], socket.socket]
    tick: Callable[[socket.socket], bool]  # once a second per connection: False when the server closed it
    watch_reads: bool = True  # anything to read means the server answered (an error) or closed: reconnect
    opened: Synchronized = field(default_factory=lambda: _FORK.Value("i", 0))
    closed_by_server: Synchronized = field(default_factory=lambda: _FORK.Value("i", 0))
    stop: EventType = field(default_factory=_FORK.Event)

    def run(self) -> None:
        live: list[socket.socket] = []
        with selectors.DefaultSelector() as watch:
            while not self.stop.is_set():
                while len(live) < self.size and not self.stop.is_set():
                    try:
                        sock = self.connect()
                    except OSError:  # refused or out of descriptors: try again next second
                        break
                    self.opened.value += 1
                    live.append(sock)
                    if self.watch_reads:
                        watch.register(sock, selectors.EVENT_READ)
                started = time.monotonic()
                for sock in [key.fileobj for key, _ in watch.select(0)]:
                    live.remove(sock)  # type: ignore[arg-type]
                    self._drop(watch, sock, by_server=True)  # type: ignore[arg-type]
                for sock in list(live):
                    if not self.tick(sock):
                        live.remove(sock)
                        self._drop(watch, sock, by_server=True)
                self.stop.wait(max(0.0, 1.0 - (time.monotonic() - started)))
            for sock in live:
                self._drop(watch, sock, by_server=False)

    def _drop(self, watch: selectors.BaseSelector, sock: socket.socket, by_server: bool) -> None:
        if self.watch_reads:
            watch.unregister(sock)
        sock.close()
        self.closed_by_server.value += by_server


def connector(port: int, rcvbuf: int | None = None) -> Callable[[], socket.socket]:
    def connect() -> socket.socket:
        sock = socket.socket()
        if rcvbuf is not None:  # before connecting, so the advertised window stays small
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(5)
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        return sock

    return connect


def slowloris_tick() -> Callable[[socket.socket], bool]:
    sent: weakref.WeakKeyDictionary[socket.socket, int] = weakref.WeakKeyDictionary()
    header = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Padding: "

    def tick(sock: socket.socket) -> bool:
        index = sent.get(sock, 0)
        byte = header[index : index + 1] or b"a"  # then padding for ever: the block never ends
        try:
            sock.send(byte)
        except OSError:
            return False
        sent[sock] = index + 1
        return True

    return tick


def stream_connector(port: int, max_tokens: int) -> Callable[[], socket.socket]:
    connect = connector(port, SMALL_RCVBUF)
    body = json.dumps({"prompt": "Write a very long story.", "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0, "stream": True, "logprobs": 5}).encode()  # ~300 bytes a token: buffers fill sooner
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    def open_stream() -> socket.socket:
        sock = connect()
        sock.setblocking(True)
        sock.sendall(request)
        sock.setblocking(False)
        return sock

    return open_stream


def hold(_: socket.socket) -> bool:
    return True


def attack_for(scenario: str, args: argparse.Namespace, port: int) -> Attack | None:
    if scenario == "slowloris":
        return Attack(scenario, args.slowloris, connector(port), slowloris_tick())
    if scenario == "idle":
        return Attack(scenario, args.idle, connector(port), hold)
    if scenario == "never_reading_streams":
        return Attack(scenario, args.streams, stream_connector(port, args.stream_tokens), hold, watch_reads=False)
    return None


def bystander_turns(client: httpx.Client, args: argparse.Namespace, label: str) -> list[float]:
    """Seconds per turn (after one untimed warm-up turn); each prompt is new, so each turn prefills."""
    latencies = []
    for turn in range(args.turns + 1):
        prompt = f"{label} turn {turn}: the bystander asks about the weather in city number {turn * 7919 % 1000}."
        started = time.perf_counter()
        reply = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": args.max_tokens,
                                                     "temperature": 0, "ignore_eos": True})
        elapsed = time.perf_counter() - started
        reply.raise_for_status()
        if turn:
            latencies.append(elapsed)
    return latencies


def run_scenario(scenario: str, client: httpx.Client, args: argparse.Namespace, server: servers.Server) -> dict[str, Any]:
    attack = attack_for(scenario, args, int(server.http_url.rsplit(":", 1)[1]))
    attacker = _FORK.Process(target=attack.run, daemon=True) if attack else None
    settled_s = None
    if attacker:
        started = time.monotonic()
        attacker.start()
        attack.stop.wait(args.settle_s)  # let the attack reach its size (and the server its steady state)
        if scenario == "never_reading_streams":  # measure the stalled state: every stream paused
            while server.metric("kiln_generations_paused") < args.streams and time.monotonic() - started < PAUSE_WAIT_S:
                attack.stop.wait(0.2)
        settled_s = time.monotonic() - started
    load = os.getloadavg()[0]
    try:
        latencies = bystander_turns(client, args, scenario)
    finally:
        if attacker:
            attack.stop.set()
            attacker.join(30)
    run: dict[str, Any] = {"latencies_s": latencies, "load_average_1m": load}
    if attack:
        run["attack"] = {"connections": attack.size, "opened": attack.opened.value,
                         "closed_by_server": attack.closed_by_server.value, "settled_s": settled_s}
        if scenario == "never_reading_streams":
            run["attack"]["paused_after_turns"] = server.metric("kiln_generations_paused")
    return run


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    latencies = [value for run in runs for value in run["latencies_s"]]
    return {"turn_latency_s": common.summarize(latencies), "p90_s": p90(latencies), "runs": runs}


def p90(values: list[float]) -> float | None:
    return quantiles(values, n=10)[-1] if len(values) >= 2 else None


def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else needed, hard))


def model_flags(name: str, scratch: Path) -> list[str]:
    if name == "embedded":
        return []
    sys.path.insert(0, str(common.BENCH_DIR.parent))  # the tiny model of the tests (tests/tiny_models.py)
    from tests.server.conftest import tiny_model_dir

    os.environ["KILN_CACHE_DIR"] = str(scratch / "cache")  # the server's converted weights: gone with the run
    return ["--model", str(tiny_model_dir(scratch, name))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    raise_fd_limit(args.idle + args.slowloris + args.streams + 512)
    max_connections = 2 * max(args.idle, args.slowloris, args.streams) + 64
    with tempfile.TemporaryDirectory(prefix="kiln-slow-clients-") as scratch:
        flags = ["--max-connections", str(max_connections), "--http-header-timeout-s", str(HEADER_TIMEOUT_S),
                 "--http-idle-timeout-s", str(IDLE_TIMEOUT_S), "--stall-timeout-s", str(STALL_TIMEOUT_S)]
        server = servers.start(extra_args=[*model_flags(args.model, Path(scratch)), *flags])
        try:
            with httpx.Client(base_url=server.http_url, timeout=300.0) as client:
                runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SCENARIOS}
                for _ in range(args.rounds):  # interleaved: a load that drifts meets every scenario alike
                    for name in SCENARIOS:
                        runs[name].append(run_scenario(name, client, args, server))
        finally:
            server.stop()
    scenarios = {name: pooled(scenario_runs) for name, scenario_runs in runs.items()}
    alone = scenarios["alone"]["turn_latency_s"]["median"]
    for result in scenarios.values():
        result["median_vs_alone"] = common.ratio(result["turn_latency_s"]["median"], alone)
    return {"config": {"model": args.model, "rounds": args.rounds, "turns": args.turns, "max_tokens": args.max_tokens,
                       "slowloris": args.slowloris, "idle": args.idle, "streams": args.streams,
                       "stream_tokens": args.stream_tokens, "settle_s": args.settle_s,
                       "server_flags": flags},
            "machine": common.machine_info(), "scenarios": scenarios}


def plot(name: str, result: dict[str, Any]) -> Path | None:
    scenarios = result["scenarios"]
    labels = [name.replace("_", " ") for name in scenarios]
    values = {"median": [s["turn_latency_s"]["median"] * 1000 for s in scenarios.values()],
              "p90": [(s["p90_s"] or 0.0) * 1000 for s in scenarios.values()],
              "max": [s["turn_latency_s"]["max"] * 1000 for s in scenarios.values()]}
    config = result["config"]
    return common.plot_bars(name, [("bystander turn latency (ms)", labels, values)],
                            f"A bystander's {config['max_tokens']}-token turn ({config['model']} model) while "
                            f"{config['slowloris']} slowloris / {config['idle']} idle / {config['streams']} "
                            "never-reading streams hold the HTTP port")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded", help='"embedded" (Gemma 3 270M) or a tiny test architecture (llama)')
    parser.add_argument("--rounds", type=int, default=3, help="times every scenario runs, interleaved")
    parser.add_argument("--turns", type=int, default=10, help="timed bystander turns per scenario and round")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--slowloris", type=int, default=500, help="slowloris connections")
    parser.add_argument("--idle", type=int, default=2000, help="idle connections")
    parser.add_argument("--streams", type=int, default=8, help="never-reading streamed completions")
    parser.add_argument("--stream-tokens", type=int, default=8192,
                        help="max_tokens of each never-reading stream (more than its socket buffers hold)")
    parser.add_argument("--settle-s", type=float, default=3.0, help="seconds an attack runs before the turns start")
    args = common.parse_run_args(parser, "slow_clients", "the tiny model, one round of 8 turns", quick)
    common.set_threads()
    common.warn_if_busy()
    result = run(args)
    print(f"wrote {common.write_results(args.name, result)}")
    if (png := plot(args.name, result)) is not None:
        print(f"wrote {png}")
    for scenario, row in result["scenarios"].items():
        print(f"{scenario:>22}: median {row['turn_latency_s']['median'] * 1000:7.1f} ms, p90 "
              f"{(row['p90_s'] or 0) * 1000:7.1f} ms, x{row['median_vs_alone']:.2f} of alone  "
              f"{[run.get('attack') for run in row['runs']] if scenario != 'alone' else ''}")


def quick(args: argparse.Namespace) -> None:
    args.model, args.rounds, args.turns, args.stream_tokens = "llama", 1, 8, 900  # the tiny model's context: 1,024


if __name__ == "__main__":
    main()
