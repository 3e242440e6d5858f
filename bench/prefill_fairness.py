"""Prefill fairness: time to first token of a short request while a long prompt is being prefilled.

Through the OpenAI HTTP API of a fresh `kiln serve` on the embedded model. For each long prompt length
and repeat:

1. baseline: a short completion (`--short-tokens` prompt ids, max_tokens=1) on the idle server;
2. a long completion (`length` prompt ids, max_tokens=1) starts on a background thread;
3. once at least `--delay-s` has passed and the server's `kiln_prefill_tokens_total` shows that part of
   the long prompt is computed (so it is surely mid-prefill), the same kind of short completion is sent;
   its latency (wall time to the response, which with max_tokens=1 is its time to first token) is the
   headline figure;
4. the long request's total time is recorded when it returns.

Prompts are seeded random token ids, different for every request, so no prefix cache serves them; the
usage block confirms the prompt lengths and that nothing was cached.

`--prefill-chunk-tokens 256,1024` runs one server per value (`default`: no flag, the server's own) and
interleaves their trials, so load from other processes falls on every configuration alike: the short
request's latency is about two steps, and a step's length is set by the prefill chunk, while a smaller
chunk costs the long request some throughput (its total time says how much).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import common
import servers

PREFILL_METRIC = "kiln_prefill_tokens_total"
POLL_S = 0.05  # how often /metrics is read while waiting for the long prefill to start


@dataclass
class Reply:
    seconds: float
    prompt_tokens: int
    cached_tokens: int
    finished_at: float  # perf_counter


@dataclass
class Trial:
    config: str  # which server: "chunk 256", or "default"
    length: int
    repeat: int
    baseline_s: float  # the short request alone on the idle server
    short_s: float  # the short request while the long one is prefilled
    short_sent_after_s: float  # since the long request was sent
    long_prefilled_when_short_sent: int  # prompt tokens the server had computed by then (all requests since the long one)
    long_total_s: float
    short_finished_first: bool  # the short response arrived before the long one
    long_prompt_tokens: int
    long_cached_tokens: int
    short_prompt_tokens: int


class Client:
    """An OpenAI client on one server; every prompt is a list of token ids."""

    def __init__(self, server: servers.Server) -> None:
        import openai

        self.server = server
        self.openai = openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", timeout=600, max_retries=0)

    def complete(self, ids: list[int]) -> Reply:
        start = time.perf_counter()
        reply = self.openai.completions.create(model="kiln", prompt=ids, max_tokens=1, temperature=0.0,
                                               extra_body={"ignore_eos": True})
        end = time.perf_counter()
        usage = reply.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return Reply(end - start, usage.prompt_tokens, cached, end)

    def close(self) -> None:
        self.openai.close()


def wait_for_prefill(server: servers.Server, before: float, sent_at: float, delay_s: float, long_done: threading.Event) -> int:
    """Block until `delay_s` has passed since `sent_at` and the server has computed prompt tokens since
    `before` (the metric's value when the long request was sent); returns how many."""
    while True:
        progress = int(server.metric(PREFILL_METRIC) - before)
        if (progress > 0 and time.perf_counter() - sent_at >= delay_s) or long_done.is_set():
            return progress
        time.sleep(POLL_S)


def run_trial(config: str, client: Client, pool: ThreadPoolExecutor, length: int, repeat: int, args: argparse.Namespace) -> Trial:
    seed = args.seed + 1000 * length + 10 * repeat  # a fresh prompt for every request: no prefix-cache hits
    baseline = client.complete(common.random_ids(args.short_tokens, seed + 1))
    before = client.server.metric(PREFILL_METRIC)
    long_done = threading.Event()
    sent_at = time.perf_counter()
    long_future = pool.submit(client.complete, common.random_ids(length, seed))
    long_future.add_done_callback(lambda _: long_done.set())
    progress = wait_for_prefill(client.server, before, sent_at, args.delay_s, long_done)
    if long_done.is_set():
        print(f"warning: the {length}-token request finished before the short one was sent", file=sys.stderr)
    short_sent = time.perf_counter()
    short = client.complete(common.random_ids(args.short_tokens, seed + 2))
    long = long_future.result()
    return Trial(config, length, repeat, baseline.seconds, short.seconds, short_sent - sent_at, progress, long.seconds,
                 short.finished_at < long.finished_at, long.prompt_tokens, long.cached_tokens, short.prompt_tokens)


def summarize(trials: list[Trial], config: str, length: int) -> dict[str, Any]:
    mine = [t for t in trials if t.config == config and t.length == length]
    short = common.summarize([t.short_s for t in mine])
    baseline = common.summarize([t.baseline_s for t in mine])
    return {
        "short_latency_s": short,
        "baseline_short_latency_s": baseline,
        "short_over_baseline": common.ratio(short["median"], baseline["median"]),
        "long_total_s": common.summarize([t.long_total_s for t in mine]),
        "short_sent_after_s": common.summarize([t.short_sent_after_s for t in mine]),
        "short_finished_first": sum(t.short_finished_first for t in mine),
        "trials": len(mine),
    }


def server_configs(args: argparse.Namespace) -> dict[str, list[str]]:
    """{label: kiln serve flags}, one per --prefill-chunk-tokens value."""
    common_flags = ["--kv-budget-mb", str(args.kv_budget_mb)]
    if args.max_batched_tokens:
        common_flags += ["--max-batched-tokens", str(args.max_batched_tokens)]
    return {("default" if chunk == "default" else f"chunk {chunk}"):
            common_flags + ([] if chunk == "default" else ["--prefill-chunk-tokens", chunk])
            for chunk in args.prefill_chunk_tokens}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=common.ints, default=[4096, 8192, 16384], help="long prompt lengths, tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-chunk-tokens", default="256,1024",
                        help="one server per value, trials interleaved; 'default' starts one without the flag")
    parser.add_argument("--short-tokens", type=int, default=10, help="prompt length of the short request")
    parser.add_argument("--delay-s", type=float, default=1.0, help="least time between the long and the short request")
    parser.add_argument("--kv-budget-mb", type=int, default=2048, help="kiln serve --kv-budget-mb (2 GiB holds ~58k fp32 tokens)")
    parser.add_argument("--max-batched-tokens", type=int, help="kiln serve --max-batched-tokens (default: the server's)")
    parser.add_argument("--seed", type=int, default=0)
    args = common.parse_run_args(parser, "prefill_fairness", "lengths 2048,4096, one repeat", _quick)
    args.prefill_chunk_tokens = args.prefill_chunk_tokens.split(",")
    return args


def _quick(args: argparse.Namespace) -> None:
    args.lengths, args.repeats = [2048, 4096], 1


def main() -> None:
    args = parse_args()
    if reason := common.missing_reason("kiln-http"):
        raise SystemExit(reason)
    common.warn_if_busy()
    machine = common.machine_info()
    configs = server_configs(args)
    clients: dict[str, Client] = {}
    trials: list[Trial] = []
    try:
        for label, flags in configs.items():  # all up before any trial; an idle server costs no CPU
            clients[label] = Client(servers.start(extra_args=flags))
            clients[label].complete(common.random_ids(1024, args.seed + 7))  # untimed warm-up
        with ThreadPoolExecutor(1) as pool:
            for repeat in range(args.repeats):
                for length in args.lengths:
                    for label, client in clients.items():
                        trial = run_trial(label, client, pool, length, repeat, args)
                        trials.append(trial)
                        print(f"[{label}, {length}] repeat {repeat}: short {trial.short_s:.3f} s (alone {trial.baseline_s:.3f} s), "
                              f"long {trial.long_total_s:.1f} s", file=sys.stderr, flush=True)
        capacity = {label: client.server.metric("kiln_kv_capacity_bytes") for label, client in clients.items()}
    except Exception:
        for label, client in clients.items():
            print(f"kiln serve ({label}) stderr, last 60 lines:\n" + "".join(client.server.log[-60:]), file=sys.stderr)
        raise
    finally:
        for client in clients.values():
            client.close()
            client.server.stop()
    machine["kiln_serve_args"] = configs
    machine["kv_capacity_bytes"] = capacity
    report(args, machine, list(configs), trials)


def report(args: argparse.Namespace, machine: dict[str, Any], configs: list[str], trials: list[Trial]) -> None:
    summary = {config: {str(n): summarize(trials, config, n) for n in args.lengths} for config in configs}
    payload = {
        "benchmark": "prefill_fairness",
        "machine": machine,
        "args": vars(args),
        "method": {
            "transport": "POST /v1/completions (openai package) to a fresh kiln serve per configuration, embedded model, token-id prompts",
            "short_latency": "perf_counter from sending the short request (max_tokens=1) to its response; with one token that is its time to first token",
            "when_sent": f"after --delay-s and once {PREFILL_METRIC} showed prompt tokens computed since the long request was sent",
            "baseline": "the same kind of short request on the idle server, just before each trial",
            "prompts": "seeded random token ids, fresh for every request (cached_tokens confirms no prefix-cache hit)",
            "order": "for each repeat, for each length, one trial per configuration in turn",
        },
        "summary": summary,
        "trials": [asdict(t) for t in trials],
    }
    path = common.write_results(args.name, payload)
    lengths = args.lengths

    def line(config: str, key: str) -> tuple[list[int], list[float | None]]:
        return lengths, [summary[config][str(n)][key]["median"] for n in lengths]

    series = {}
    for config in configs:
        series[f"short request during the long prefill ({config})"] = line(config, "short_latency_s")
        series[f"long request, total ({config})"] = line(config, "long_total_s")
    series["short request alone (baseline)"] = line(configs[0], "baseline_short_latency_s")
    png = common.plot_lines(args.name, series, "long prompt length (tokens)", "seconds (median, log scale)",
                            f"Short request ({args.short_tokens} tokens, max_tokens=1) during a long prefill, HTTP API")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    for config in configs:
        for n in lengths:
            s = summary[config][str(n)]
            print(f"{config}, {n}: short {s['short_latency_s']['median']:.3f} s, alone {s['baseline_short_latency_s']['median']:.3f} s, "
                  f"long {s['long_total_s']['median']:.1f} s, short first {s['short_finished_first']}/{s['trials']}")


if __name__ == "__main__":
    main()
