"""Caller fairness: one API key's short turn while another key loads the server (issue 37 § 9).

Through the OpenAI HTTP API of a `kiln serve` on the embedded model with two API keys, a hog and a
bystander. The headline figure is the bystander's turn (an 8-token completion of a fresh prompt, wall
time to the response) under each load, over its time on the idle server measured in the same run:

- `streams`: the hog holds `--streams` streaming completions of `--long-tokens` tokens (the default is
  the server's `--max-num-seqs`, so without fair shares they take every batch slot), each read as it
  arrives; the bystander's turns start once every stream has its first token;
- `fan-out`: one hog request of 32 prompts x n=16 (512 generations, within the API's limits), streamed;
- `big bodies`: `--bodies` hog threads each posting, over and over, a completion whose `logit_bias` has
  `--bias-entries` entries; `/healthz` is timed every 50 ms alongside the bystander's turns.

A bystander turn that takes longer than `--turn-timeout-s` is recorded as null (it was shut out).
`--tree LABEL=PATH` (repeatable) starts one server per tree (PATH first on PYTHONPATH, e.g. an extract
of `git archive <commit> kiln`; `this` = the checkout) and interleaves their runs, so "before" and
"after" share the machine's load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import common
import httpx
import servers

HOG, BYSTANDER = "bench-hog", "bench-bystander"
FAN_OUT = {"prompts": 32, "n": 16, "max_tokens": 64}
HEALTH_EVERY_S = 0.05


class Tree:
    """A `kiln serve` of one source tree, with an HTTP client per key."""

    def __init__(self, label: str, path: str | None, args: argparse.Namespace) -> None:
        self.label = label
        self.args = args
        flags = ["--api-key", HOG, "--api-key", BYSTANDER, "--max-num-seqs", str(args.max_num_seqs)]
        self.server = servers.start(extra_args=flags, pythonpath=path)
        self.url = self.server.http_url
        self.turns = 0

    def client(self, key: str, timeout: float) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)

    def bystander_turns(self) -> list[float | None]:
        """Seconds of each of `--turns` bystander turns; None for one past --turn-timeout-s."""
        seconds: list[float | None] = []
        with self.client(BYSTANDER, self.args.turn_timeout_s) as http:
            for _ in range(self.args.turns):
                self.turns += 1
                body = {"prompt": common.random_ids(8, 10_000 + self.turns), "max_tokens": 8, "ignore_eos": True,
                        "temperature": 0}
                started = time.perf_counter()
                try:
                    reply = http.post("/v1/completions", json=body)
                    reply.raise_for_status()
                    seconds.append(time.perf_counter() - started)
                except httpx.TimeoutException:
                    seconds.append(None)
        return seconds


@contextmanager
def long_streams(tree: Tree) -> Iterator[None]:
    """The hog's streaming completions, all past their first token before the block runs; closed after."""
    args, stop = tree.args, threading.Event()
    first_tokens = threading.Barrier(args.streams + 1, timeout=600)

    def read(index: int) -> None:
        body = {"prompt": common.random_ids(16, 20_000 + index), "max_tokens": args.long_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with tree.client(HOG, 600) as http, http.stream("POST", "/v1/completions", json=body) as reply:
            lines = (line for line in reply.iter_lines() if line.startswith("data:"))
            next(lines)
            first_tokens.wait()
            for _ in lines:
                if stop.is_set():
                    return

    with ThreadPoolExecutor(args.streams) as pool:
        readers = [pool.submit(read, index) for index in range(args.streams)]
        first_tokens.wait()
        try:
            yield
        finally:
            stop.set()
            for reader in readers:
                reader.result()


@contextmanager
def fan_out(tree: Tree) -> Iterator[None]:
    """One streamed hog request of 32 prompts x n=16, running before the block; closed after."""
    stop, running = threading.Event(), threading.Event()
    prompts = [common.random_ids(16, 30_000 + i) for i in range(FAN_OUT["prompts"])]
    body = {"prompt": prompts, "n": FAN_OUT["n"], "max_tokens": FAN_OUT["max_tokens"], "ignore_eos": True,
            "temperature": 0, "stream": True}

    def read() -> None:
        with tree.client(HOG, 600) as http, http.stream("POST", "/v1/completions", json=body) as reply:
            reply.raise_for_status()
            for _ in reply.iter_lines():
                running.set()
                if stop.is_set():
                    return

    with ThreadPoolExecutor(1) as pool:
        reader = pool.submit(read)
        running.wait(600)
        try:
            yield
        finally:
            stop.set()
            reader.result()


class BigBodies:
    """The hog's threads posting huge logit_bias bodies over and over, and a /healthz prober."""

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        entries = tree.args.bias_entries
        self.body = httpx.Request("POST", "/", json={"prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0,
                                                     "logit_bias": {str(i): 0.5 for i in range(entries)}}).read()
        self.health_s: list[float] = []
        self.statuses: dict[int, int] = {}

    @contextmanager
    def running(self) -> Iterator[None]:
        stop = threading.Event()

        def post() -> None:
            with self.tree.client(HOG, 600) as http:
                while not stop.is_set():
                    reply = http.post("/v1/completions", content=self.body, headers={"Content-Type": "application/json"})
                    self.statuses[reply.status_code] = self.statuses.get(reply.status_code, 0) + 1

        def probe() -> None:
            with httpx.Client(base_url=self.tree.url, timeout=600) as http:
                while not stop.is_set():
                    started = time.perf_counter()
                    http.get("/healthz").raise_for_status()
                    self.health_s.append(time.perf_counter() - started)
                    time.sleep(HEALTH_EVERY_S)

        bodies = self.tree.args.bodies
        with ThreadPoolExecutor(bodies + 1) as pool:
            workers = [pool.submit(post) for _ in range(bodies)] + [pool.submit(probe)]
            time.sleep(1.0)  # every poster has a body in flight
            try:
                yield
            finally:
                stop.set()
                for worker in workers:
                    worker.result()


def run_tree(tree: Tree) -> dict[str, Any]:
    """Every scenario once on one tree: the bystander's turns alone and under each load."""
    results: dict[str, Any] = {"alone": tree.bystander_turns()}
    loads: dict[str, Callable[[], Any]] = {"streams": lambda: long_streams(tree), "fan-out": lambda: fan_out(tree)}
    for name, load in loads.items():
        with load():
            results[name] = tree.bystander_turns()
        print(f"[{tree.label}] {name}: {_show(results[name])} (alone {_show(results['alone'])})", file=sys.stderr, flush=True)
    bodies = BigBodies(tree)
    with bodies.running():
        results["big bodies"] = tree.bystander_turns()
    results["healthz_s"] = common.summarize(bodies.health_s)
    results["big_body_statuses"] = {str(code): count for code, count in sorted(bodies.statuses.items())}
    print(f"[{tree.label}] big bodies: {_show(results['big bodies'])}, /healthz max {results['healthz_s']['max']:.3f} s, "
          f"statuses {results['big_body_statuses']}", file=sys.stderr, flush=True)
    return results


def _show(seconds: list[float | None]) -> str:
    return ", ".join("shut out" if s is None else f"{s:.2f} s" for s in seconds)


def summarize(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per scenario: the bystander's median turn (null when any turn was shut out) and its ratio to alone."""
    summary: dict[str, Any] = {}
    for scenario in ("alone", "streams", "fan-out", "big bodies"):
        turns = [s for run in runs for s in run[scenario]]
        shut_out = sum(s is None for s in turns)
        median = None if shut_out else statistics.median(turns)
        summary[scenario] = {"median_s": median, "turns": len(turns), "shut_out": shut_out}
    alone = summary["alone"]["median_s"]
    for scenario in ("streams", "fan-out", "big bodies"):
        summary[scenario]["over_alone"] = common.ratio(summary[scenario]["median_s"], alone)
    summary["healthz_max_s"] = max(run["healthz_s"]["max"] for run in runs)
    summary["healthz_median_s"] = statistics.median(run["healthz_s"]["median"] for run in runs)
    return summary


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], help="LABEL=PATH: a kiln tree to measure (default: this=the checkout)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of every scenario per tree, interleaved")
    parser.add_argument("--turns", type=int, default=3, help="bystander turns per scenario")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="kiln serve --max-num-seqs (its default)")
    parser.add_argument("--streams", type=int, default=32, help="the hog's long streams")
    parser.add_argument("--long-tokens", type=int, default=4000, help="max_tokens of each long stream")
    parser.add_argument("--bodies", type=int, default=4, help="hog threads posting huge logit_bias bodies")
    parser.add_argument("--bias-entries", type=int, default=250_000, help="logit_bias entries per body")
    parser.add_argument("--turn-timeout-s", type=float, default=60.0, help="a bystander turn past this is shut out")
    args = common.parse_run_args(parser, "caller_fairness", "one repeat, one turn, 8 streams of 400 tokens", _quick)
    args.trees = dict(_tree(text) for text in args.tree) or {"this": None}
    return args


def _tree(text: str) -> tuple[str, str | None]:
    label, _, path = text.partition("=")
    if not label or not path:
        raise SystemExit(f"--tree takes LABEL=PATH, got {text!r}")
    return label, (None if path == "this" else os.path.abspath(path))


def _quick(args: argparse.Namespace) -> None:
    args.repeats, args.turns, args.max_num_seqs, args.streams, args.long_tokens = 1, 1, 8, 8, 400


def main() -> None:
    args = parse_args()
    common.warn_if_busy()
    machine = common.machine_info()
    trees: dict[str, Tree] = {}
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in args.trees}
    try:
        for label, path in args.trees.items():
            trees[label] = Tree(label, path, args)
            trees[label].bystander_turns()  # untimed warm-up
        for _ in range(args.repeats):
            for label, tree in trees.items():
                runs[label].append(run_tree(tree))
    except Exception:
        for label, tree in trees.items():
            print(f"kiln serve ({label}) stderr, last 60 lines:\n" + "".join(tree.server.log[-60:]), file=sys.stderr)
        raise
    finally:
        for tree in trees.values():
            tree.server.stop()
    machine["trees"] = {label: path or machine["kiln_package"] for label, path in args.trees.items()}
    report(args, machine, runs)


def report(args: argparse.Namespace, machine: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> None:
    summary = {label: summarize(tree_runs, args) for label, tree_runs in runs.items()}
    payload = {
        "benchmark": "caller_fairness",
        "machine": machine,
        "args": {key: value for key, value in vars(args).items() if key != "tree"},
        "method": {
            "transport": "POST /v1/completions with httpx to one kiln serve per tree, embedded model, two API keys",
            "bystander_turn": "8 fresh prompt ids, max_tokens=8, ignore_eos; perf_counter from send to response",
            "order": "for each repeat, every scenario on each tree in turn",
        },
        "summary": summary,
        "runs": runs,
    }
    path = common.write_results(args.name, payload)
    scenarios = ["alone", "streams", "fan-out", "big bodies"]
    values = {label: [summary[label][s]["median_s"] for s in scenarios] for label in runs}
    png = common.plot_bars(args.name, [("bystander turn, s (median; no bar: shut out)", scenarios, values)],
                           "A bystander key's 8-token turn beside a hog key")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    for label, s in summary.items():
        print(f"{label}: alone {s['alone']['median_s']:.3f} s; " + "; ".join(
            f"{name} {_ratio(s[name])}" for name in scenarios[1:]) + f"; /healthz max {s['healthz_max_s']:.3f} s")


def _ratio(scenario: dict[str, Any]) -> str:
    if scenario["median_s"] is None:
        return f"shut out in {scenario['shut_out']}/{scenario['turns']} turns"
    return f"{scenario['median_s']:.3f} s ({scenario['over_alone']:.1f}x)"


if __name__ == "__main__":
    main()
