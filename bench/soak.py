"""Soak: scripted agents against a real `kiln serve` for a long time, with everything that ends or moves a
session happening on the way, and the state that must not drift recorded over time.

`--agents` (16) threads, each with its own gRPC client, loop on sessions: a turn (append 1-24 random ids,
greedy generate 1-12 tokens, ignore_eos) most of the time; otherwise a fork (continue on the child; the
parent is parked, or closed), a close (and a new session), a cancel (a long generate cancelled after a few
tokens), or an idle pause past the session's TTL (a quarter of the agents make short-TTL sessions, which
the server evicts and restores on the next call). A history about to outgrow the context is forked at an
earlier point and the old session closed. The server (`--deterministic`, its snapshot directory in a
temporary directory) is SIGTERMed and started again on the same store `--restarts` (2) times; agents that
meet the restart wait for the new server and carry on with the same sessions.

Every agent knows its sessions' histories token for token (after a cancel or an interrupted turn it reads
the length back; tokens the server committed but never sent are the greedy continuation, taken from the
reference). Checked and recorded:
- sessions lost (must be 0): a session not closed by its agent that is gone or shorter than what its
  agent had acknowledged, at any call during the run and in a final pass over every live session;
- replies: a sample (`--check-every`) of greedy turns compared with an in-process reference (`kiln.LLM`
  over the same model, deterministic): same history, same tokens;
- invariant violations and engine errors (/metrics; must be 0), errors by type, inside a restart window
  (expected: the server is down) or outside it;
- over time (every `--sample-s`): the server's RSS, resident KV bytes (`kiln_kv_bytes`), live sessions;
  per-turn latency p50/p99 per time bucket.

    .venv/bin/python bench/soak.py                 # 30 minutes, the tiny model -> results/soak.{json,png}
    .venv/bin/python bench/soak.py --minutes 3 --name soak_quick
    .venv/bin/python bench/soak.py --model embedded
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median, quantiles
from typing import Any

import common
import servers

from kiln.client import Client, Session
from kiln.errors import KilnError, NotFoundError

sys.path.insert(0, str(common.BENCH_DIR.parent))  # the tiny model of the tests (tests/tiny_models.py)

SHORT_TTL_S = 2.0  # short-TTL agents' sessions; their pauses last PAUSE_S, past it
PAUSE_S = 3.0
ACTIONS = {"turn": 80, "fork": 5, "close": 3, "cancel": 5, "pause": 7}  # relative weights
PARKED_MAX = 4  # forked-from sessions an agent keeps alive (and checks) before closing the oldest
CONTEXT_CAP = 4096  # histories are forked back before they pass this (or the model's context)
KV_BUDGET_MB = 512
COUNTED = ("kiln_cache_invariant_violations", "kiln_generations", "kiln_snapshot_save_failures", "kiln_session_evictions",
           "kiln_snapshot_restores")


class HistoryMismatch(KilnError):
    """The server holds more tokens than the agent can account for (a bug in one or the other)."""

    code = "HISTORY_MISMATCH"


@dataclass
class Known:
    """One session as its agent knows it: every token, and how many of them the server acknowledged."""

    session_id: str
    tokens: list[int]
    acked: int


@dataclass
class Record:
    """What the whole soak saw, filled by every thread under `lock`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    turns: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, turn latency)
    errors: Counter[str] = field(default_factory=Counter)  # "expected:CODE" or "unexpected:CODE"
    actions: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)
    checks: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[dict[str, float]] = field(default_factory=list)


class Soak:
    """The server (restartable on one store), the reference, the agents' shared state."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.store = tempfile.TemporaryDirectory(prefix="kiln-soak-")
        self.model_path, self.reference = load_model(args.model, Path(self.store.name))
        self.record = Record()
        self.ready = threading.Event()
        self.done = threading.Event()
        self.restarting = False
        self.started = time.monotonic()
        self.machine = common.machine_info()  # at the start: the load average before the run
        self.counters: dict[str, Counter[str]] = {family: Counter() for family in COUNTED}  # over every incarnation
        self.server = self.start_server()
        self.ready.set()

    # ---- the server ---------------------------------------------------------------------------------

    def start_server(self) -> servers.Server:
        extra = ["--snapshot-dir", str(Path(self.store.name) / "snapshots"), "--deterministic",
                 "--kv-budget-mb", str(KV_BUDGET_MB)]
        return servers.start(extra_args=[*extra, *(["--model", self.model_path] if self.model_path else [])])

    def restart(self) -> None:
        """SIGTERM (graceful: every session saved) and a new server on the same store."""
        self.ready.clear()
        self.restarting = True
        at = self.elapsed()
        self.tally()
        stop_started = time.monotonic()
        self.server.stop()
        stopped = time.monotonic()
        self.server = self.start_server()
        self.record.restarts.append({"at_s": at, "shutdown_s": stopped - stop_started,
                                     "start_s": time.monotonic() - stopped})
        self.restarting = False
        self.ready.set()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def metrics(self) -> str:
        with urllib.request.urlopen(self.server.http_url + "/metrics", timeout=30) as reply:
            return reply.read().decode()

    def tally(self) -> None:
        """Add this incarnation's counters (a restarted server counts from zero) to the run's."""
        text = self.metrics()
        for family, counts in self.counters.items():
            counts.update(counters(text, family))

    # ---- checks -------------------------------------------------------------------------------------

    def check(self, history: list[int], generated: list[int]) -> None:
        """The reference's greedy tokens after `history` must be `generated`."""
        want = self.reference.generate([history], max_tokens=len(generated), temperature=0.0, ignore_eos=True)[0].token_ids
        with self.record.lock:
            self.record.checks += 1
            if want != generated:
                self.record.mismatches.append({"history_tokens": len(history), "server": generated, "reference": want})

    def greedy(self, history: list[int], count: int) -> list[int]:
        return self.reference.generate([history], max_tokens=count, temperature=0.0, ignore_eos=True)[0].token_ids

    def error(self, error: BaseException, address: str) -> None:
        """Count an error; expected while a restart is under way or from a client of a stopped server."""
        expected = self.restarting or not self.ready.is_set() or address != self.server.grpc_address
        with self.record.lock:
            self.record.errors[f"{'expected' if expected else 'unexpected'}:{getattr(error, 'code', type(error).__name__)}"] += 1

    def lose(self, session_id: str, why: str) -> None:
        with self.record.lock:
            self.record.lost.append(f"{session_id}: {why}")


def load_model(name: str, scratch: Path) -> tuple[str | None, Any]:
    """(the --model path for the server, None for the embedded one; the in-process reference)."""
    from kiln import LLM

    if name == "embedded":
        return None, LLM(deterministic=True, kv_budget_bytes=KV_BUDGET_MB * 2**20)
    from tests.server.conftest import tiny_model_dir

    os.environ["KILN_CACHE_DIR"] = str(scratch / "cache")  # the server's converted weights: gone with the run
    path = tiny_model_dir(scratch, name)
    return str(path), LLM(str(path), deterministic=True, kv_budget_bytes=KV_BUDGET_MB * 2**20, cache_dir=str(scratch / "cache"))


class Agent:
    """One scripted agent: its client, its current session, the sessions it parked."""

    def __init__(self, soak: Soak, index: int) -> None:
        self.soak = soak
        self.rng = random.Random(soak.args.seed * 1000 + index)
        self.ttl_s = SHORT_TTL_S if index % 4 == 0 else None
        self.client = Client(soak.server.grpc_address)
        self.vocab = self.client.health().vocab_size
        self.context = min(CONTEXT_CAP, self.client.health().max_model_len) - 64
        self.current = self.create()
        self.parked: list[Known] = []
        self.closed: set[str] = set()  # ids this agent closed: their absence is no loss
        self.generate_start: int | None = None  # history length when a generate still unfinished began

    def create(self) -> Known:
        prompt = self.ids(self.rng.randint(8, 64))
        return Known(self.client.create_session(prompt, self.ttl_s).id, prompt, len(prompt))

    def ids(self, count: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(count)]

    def session(self) -> Session:
        return self.client.get_session(self.current.session_id)

    def run(self) -> None:
        while not self.soak.done.is_set():
            action = self.rng.choices(list(ACTIONS), list(ACTIONS.values()))[0]
            try:
                getattr(self, action)()
                with self.soak.record.lock:
                    self.soak.record.actions[action] += 1
            except (KilnError, OSError) as error:
                self.soak.error(error, self.client.address)
                self.recover()
        self.client.close()

    # ---- actions ------------------------------------------------------------------------------------

    def turn(self) -> None:
        if len(self.current.tokens) + 40 > self.context:
            self.fork(at=self.rng.randint(len(self.current.tokens) // 4, len(self.current.tokens) // 2), close=True)
        started = time.monotonic()
        session = self.session()
        appended = self.ids(self.rng.randint(1, 24))
        self.current.tokens += appended
        session.append(appended)
        self.current.acked = len(self.current.tokens)
        history = list(self.current.tokens)
        generated = self.generate(session, self.rng.randint(1, 12))
        with self.soak.record.lock:
            self.soak.record.turns.append((self.soak.elapsed(), time.monotonic() - started))
        if self.rng.randrange(self.soak.args.check_every) == 0:
            self.soak.check(history, generated)

    def generate(self, session: Session, count: int) -> list[int]:
        self.generate_start = len(self.current.tokens)
        generation = session.generate(max_tokens=count, temperature=0.0, ignore_eos=True)
        generated = []
        for token in generation:
            generated.append(token)
            self.current.tokens.append(token)
        generation.result()
        self.current.acked = len(self.current.tokens)
        self.generate_start = None
        return generated

    def fork(self, at: int | None = None, close: bool | None = None) -> None:
        at = self.rng.randint(1, len(self.current.tokens)) if at is None else at
        child = self.session().fork(at)
        parent, self.current = self.current, Known(child.id, self.current.tokens[:at], at)
        if close if close is not None else self.rng.random() < 0.5:
            self.close_known(parent)
        else:
            self.parked.append(parent)
            if len(self.parked) > PARKED_MAX:
                self.close_known(self.parked.pop(0))

    def close(self) -> None:
        self.close_known(self.current)
        self.current = self.create()

    def close_known(self, known: Known) -> None:
        """Check the session is whole, then close it."""
        session = self.client.get_session(known.session_id)
        self.verify(known, session.info().history_tokens)
        session.close()
        self.closed.add(known.session_id)

    def cancel(self) -> None:
        if len(self.current.tokens) + 64 > self.context:
            return
        session = self.session()
        self.generate_start = len(self.current.tokens)
        generation = session.generate(max_tokens=64, temperature=0.0, ignore_eos=True)
        for _, token in zip(range(self.rng.randint(1, 4)), generation, strict=False):
            self.current.tokens.append(token)
        generation.cancel()
        self.resync()

    def pause(self) -> None:
        """Idle: past the TTL for a short-TTL agent (evicted, then restored by the next call)."""
        if self.ttl_s is not None:
            self.soak.done.wait(PAUSE_S)
        self.verify(self.current, self.session().info().history_tokens)

    # ---- keeping the agent's knowledge true ---------------------------------------------------------

    def verify(self, known: Known, history: int) -> None:
        if history < known.acked:
            self.soak.lose(known.session_id, f"{history} tokens, {known.acked} acknowledged")
        elif history != len(known.tokens):
            raise HistoryMismatch(f"session {known.session_id}: {history} tokens, its agent knows {len(known.tokens)}")

    def resync(self) -> None:
        """After a cancel or an interrupted call: the server's history length decides which of the tokens
        sent took; tokens it committed beyond what arrived are the greedy continuation from where the
        unfinished generate began (checked against what did arrive)."""
        known, start = self.current, self.generate_start
        self.generate_start = None
        if known.session_id in self.closed:  # closed, and the call that was to replace it failed
            self.current = self.create()
            return
        try:
            history = self.session().info().history_tokens
        except NotFoundError:
            self.soak.lose(known.session_id, "gone")
            self.current = self.create()
            return
        if history < known.acked:
            self.soak.lose(known.session_id, f"{history} tokens, {known.acked} acknowledged")
        if history <= len(known.tokens):
            del known.tokens[history:]
        elif start is not None:
            full = self.soak.greedy(known.tokens[:start], history - start)
            if full[: len(known.tokens) - start] != known.tokens[start:]:
                self.soak.error(HistoryMismatch("streamed tokens differ from the reference"), self.client.address)
            known.tokens[start:] = full
        else:
            self.soak.error(HistoryMismatch(f"{history} tokens, {len(known.tokens)} known"), self.client.address)
            self.current = self.create()
            return
        known.acked = len(known.tokens)

    def recover(self) -> None:
        """Wait for a serving server (a restart), reconnect, and bring the current session in line."""
        while not self.soak.done.is_set():
            self.soak.ready.wait()
            if self.client.address != self.soak.server.grpc_address:
                self.client.close()
                self.client = Client(self.soak.server.grpc_address)
            try:
                self.resync()
                return
            except (KilnError, OSError) as error:
                self.soak.error(error, self.client.address)
                self.soak.done.wait(0.2)

    def final_check(self) -> None:
        """Every session this agent still holds is whole on the server."""
        client = Client(self.soak.server.grpc_address)
        for known in [self.current, *self.parked]:
            try:
                self.verify(known, client.get_session(known.session_id).info().history_tokens)
            except NotFoundError:
                self.soak.lose(known.session_id, "gone at the end")
        client.close()


def sample(soak: Soak) -> None:
    """Every --sample-s: the server's RSS, its KV pages in use (live sessions' histories) and cached (the
    prefix index's unreferenced pages, kept until the pool needs them), live sessions, the saver's backlog."""
    while not soak.done.wait(soak.args.sample_s):
        if not soak.ready.is_set():
            continue
        try:
            row = kv_sample(soak.metrics())
            row.update(t_s=soak.elapsed(), rss_bytes=rss_bytes(soak.server.process.pid), restarts=len(soak.record.restarts))
        except (OSError, ValueError):
            continue  # a restart began between the check and the scrape
        with soak.record.lock:
            soak.record.samples.append(row)


def kv_sample(text: str) -> dict[str, float]:
    pages = {state: gauge(text, f'kiln_kv_pages{{state="{state}"}}') for state in ("used", "cached", "free")}
    page_bytes = gauge(text, "kiln_kv_capacity_bytes") / max(1.0, sum(pages.values()))
    return {"kv_used_bytes": pages["used"] * page_bytes, "kv_cached_bytes": pages["cached"] * page_bytes,
            "sessions": gauge(text, "kiln_sessions_active"), "backlog_s": gauge(text, "kiln_snapshot_backlog_seconds")}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for {pid}")


def gauge(text: str, sample_name: str) -> float:
    found = re.search(rf"^{re.escape(sample_name)} (\S+)$", text, re.MULTILINE)
    if found is None:
        raise ValueError(f"no {sample_name} in /metrics")
    return float(found.group(1))


def counters(text: str, family: str) -> dict[str, int]:
    """Every labelled sample of a counter family: {label value: count}."""
    return {m.group(1): int(float(m.group(2))) for m in re.finditer(rf'^{family}_total{{\w+="([^"]*)"}} (\S+)$', text, re.MULTILINE)}


def say(soak: Soak, line: str) -> None:
    print(f"[{soak.elapsed():7.1f} s] {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    soak = Soak(args)
    say(soak, f"server ready; starting {args.agents} agents for {args.minutes} minutes")
    agents = [Agent(soak, k) for k in range(args.agents)]
    threads = [threading.Thread(target=agent.run, daemon=True) for agent in agents]
    threads.append(threading.Thread(target=sample, args=(soak,), daemon=True))
    for thread in threads:
        thread.start()
    duration = args.minutes * 60
    for k in range(1, args.restarts + 1):
        soak.done.wait(max(0.0, duration * k / (args.restarts + 1) - soak.elapsed()))
        say(soak, f"restart {k}: {len(soak.record.turns)} turns so far")
        soak.restart()
    soak.done.wait(max(0.0, duration - soak.elapsed()))
    soak.done.set()
    say(soak, f"stopping the agents after {len(soak.record.turns)} turns")
    for thread in threads:
        thread.join(120)
    say(soak, "final check of every live session")
    for agent in agents:
        agent.final_check()
    soak.tally()
    soak.server.stop()
    soak.reference.close()
    soak.store.cleanup()
    say(soak, "done")
    return summarize(soak, args)


def summarize(soak: Soak, args: argparse.Namespace) -> dict[str, Any]:
    record = soak.record
    bucket_s = max(10.0, args.minutes * 60 / 30)
    buckets: dict[int, list[float]] = {}
    for at, latency in record.turns:
        buckets.setdefault(int(at // bucket_s), []).append(latency)
    latency = [{"t_s": k * bucket_s, "turns": len(v), "p50_ms": 1000 * median(v), "p99_ms": 1000 * p99(v)}
               for k, v in sorted(buckets.items())]
    return {
        "method": __doc__,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "quick"},
        "machine": soak.machine,
        "turns": len(record.turns),
        "actions": dict(record.actions),
        "sessions_lost": len(record.lost),
        "lost": record.lost,
        "reference_checks": record.checks,
        "reference_mismatches": record.mismatches,
        "errors": dict(record.errors),
        "invariant_violations": dict(soak.counters["kiln_cache_invariant_violations"]),
        "generations": dict(soak.counters["kiln_generations"]),
        "snapshot_save_failures": dict(soak.counters["kiln_snapshot_save_failures"]),
        "session_evictions": dict(soak.counters["kiln_session_evictions"]),
        "snapshot_restores": dict(soak.counters["kiln_snapshot_restores"]),
        "restarts": record.restarts,
        "rss_growth_after_warmup_bytes": growth_after_warmup(record.samples, "rss_bytes"),
        "kv_used_growth_after_warmup_bytes": growth_after_warmup(record.samples, "kv_used_bytes"),
        "backlog_s_max": max((row["backlog_s"] for row in record.samples), default=None),
        "latency_buckets": latency,
        "samples": record.samples,
    }


def p99(values: list[float]) -> float:
    return quantiles(values, n=100)[98] if len(values) > 1 else values[0]


def growth_after_warmup(samples: list[dict[str, Any]], key: str) -> float | None:
    """The most `key` rose in any server incarnation from a quarter into its life to any later sample."""
    growth = None
    for incarnation in {row["restarts"] for row in samples}:
        values = [row[key] for row in samples if row["restarts"] == incarnation]
        if len(values) >= 4:
            warm = values[len(values) // 4]
            growth = max(growth or 0, max(values[len(values) // 4 :]) - warm)
    return growth


def plot(name: str, result: dict[str, Any]) -> Path | None:
    """RSS and resident KV over time; per-turn p50/p99 per bucket; restarts as vertical lines."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot written", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, latency) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    minutes = [row["t_s"] / 60 for row in result["samples"]]
    memory.plot(minutes, [row["rss_bytes"] / 2**20 for row in result["samples"]], label="server RSS (MiB)")
    memory.plot(minutes, [row["kv_used_bytes"] / 2**20 for row in result["samples"]], label="KV in use by sessions (MiB)")
    memory.plot(minutes, [row["kv_cached_bytes"] / 2**20 for row in result["samples"]], label="KV cached, reclaimable (MiB)")
    memory.set(ylabel="MiB", title=f"soak: {result['config']['agents']} agents, {result['turns']} turns, "
               f"{result['sessions_lost']} sessions lost, {len(result['reference_mismatches'])} reference mismatches")
    buckets = result["latency_buckets"]
    for key in ("p50_ms", "p99_ms"):
        latency.plot([b["t_s"] / 60 for b in buckets], [b[key] for b in buckets], marker=".", label=f"turn {key[:3]}")
    latency.set(xlabel="minutes", ylabel="turn latency (ms)", yscale="log")
    for ax in (memory, latency):
        for restart in result["restarts"]:
            ax.axvline(restart["at_s"] / 60, color="grey", linestyle=":")
        ax.grid(True, alpha=0.3)
        ax.legend()
    path = common.RESULTS_DIR / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--model", default="llama", help='"embedded" (Gemma 3 270M) or a tiny test architecture (llama)')
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--check-every", type=int, default=10, help="compare one greedy turn in N with the reference")
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    args = common.parse_run_args(parser, "soak", "3 minutes", quick)
    common.RESULTS_DIR = args.results_dir
    common.set_threads()
    result = run(args)
    print(f"wrote {common.write_results(args.name, result)}")
    if (png := plot(args.name, result)) is not None:
        print(f"wrote {png}")
    print(f"{result['turns']} turns, {result['sessions_lost']} sessions lost, {result['reference_checks']} replies "
          f"checked ({len(result['reference_mismatches'])} differ), errors {result['errors']}, invariant "
          f"violations {result['invariant_violations']}, RSS growth after warm-up {result['rss_growth_after_warmup_bytes']}")


def quick(args: argparse.Namespace) -> None:
    args.minutes = 3.0

if __name__ == "__main__":
    main()
