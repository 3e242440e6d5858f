"""Many agents at once: N concurrent scripted agent sessions, per-turn latency and aggregate throughput.

Each agent holds one conversation: a first turn of `--first-tokens` ids (its instructions and task),
then `--turns` turns that each append `--new-tokens` ids (tool output, user text; long_session.py's
deterministic transcript, a different seed per agent) and generate `--gen-tokens` greedy tokens that join
its history. Latency is a turn's wall time from handing over the new ids to its last token; aggregate
throughput is all agents' generated tokens over the wall time of the whole run (first turns excluded:
they are timed apart as `first_turn_s`).

- kiln-grpc: a fresh `kiln serve` (default engine: int8 weights, n-gram speculation), N client threads,
  one gRPC session each (Python SDK: append, stream the generate); the engine batches whatever the
  agents have in flight.
- llamacpp: llama.cpp's own multi-sequence API (bench/llama_cpp_worker.py LlamaBatchDecoder): one context
  with a KV sequence per agent, every turn run in lockstep (all agents' new ids in shared llama_decode
  batches, then one llama_decode per generated token for all of them). This is llama.cpp's best case:
  no agent waits for another's think time, and batching is perfect. It runs in a process of its own
  (under `--peer-python` or this Python) without the OpenMP wait policy `import kiln` sets for this one;
  turns are timed here, around each call.
- llamacpp-server: `python -m llama_cpp.server` as a user runs it, N client threads posting the whole
  conversation as text (its server takes no token ids) to /v1/completions; it serves one request at a
  time and keeps one prompt cache. Its generated token count is its reply re-tokenized.

kiln-grpc and llamacpp run `--repeats` times each, taking turns run by run, and every figure is the median
over the runs (each run is in `runs`): a run at N = 8 lasts about ten seconds, and on this shared machine
one such window was seen to cost Kiln 30 % (99 against 134-141 tokens/s in the runs just after).
llamacpp-server runs once: at 200-400 s a run it is no contender, only what a user would start.

Goal (issue 7): Kiln's aggregate tokens/s at N = 8 >= 2x llama.cpp's. Writes bench/results/agents.json
and .png.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from statistics import median, quantiles
from typing import Any

import common
import peers
import servers
from llama_cpp_worker import LlamaProcess
from long_session import scripted_turns

SYSTEMS = ("kiln-grpc", "llamacpp", "llamacpp-server")


def agent_scripts(loaded: Any, agents: int, args: argparse.Namespace) -> list[list[list[int]]]:
    """Per agent: [first turn ids, turn 1 ids, ...]."""
    scripts = []
    for agent in range(agents):
        chunks = scripted_turns(loaded, args.turns + 1, args.new_tokens, seed=100 + agent)
        first = scripted_turns(loaded, 1, args.first_tokens, seed=200 + agent)[0]
        scripts.append([first, *chunks[1:]])
    return scripts


def stats(latencies: list[float], generated: int, wall: float) -> dict[str, Any]:
    p95 = quantiles(latencies, n=20)[-1] if len(latencies) >= 2 else latencies[0]
    return {"turn_latency_p50_s": median(latencies), "turn_latency_p95_s": p95, "turns": len(latencies),
            "generated_tokens": generated, "wall_s": wall, "aggregate_tokens_per_s": generated / wall}


def in_threads(count: int, work) -> None:  # noqa: ANN001 - a callable of the agent index
    """Run work(0) .. work(count - 1) on their own threads; the first error is raised here."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def run_threads(scripts: list[list[list[int]]], first_turn, turn) -> dict[str, Any]:  # noqa: ANN001 - callables
    """Every agent's first turn (concurrently, timed apart), then the timed turns, each agent on its own
    thread as fast as its replies come."""
    handles: list[Any] = [None] * len(scripts)
    start = time.perf_counter()
    in_threads(len(scripts), lambda i: handles.__setitem__(i, first_turn(i, scripts[i][0])))
    first_s = time.perf_counter() - start
    latencies: list[list[float]] = [[] for _ in scripts]
    generated = [0] * len(scripts)

    def agent(i: int) -> None:
        for ids in scripts[i][1:]:
            begin = time.perf_counter()
            generated[i] += len(turn(handles[i], ids))
            latencies[i].append(time.perf_counter() - begin)

    start = time.perf_counter()
    in_threads(len(scripts), agent)
    wall = time.perf_counter() - start
    return {**stats([x for per in latencies for x in per], sum(generated), wall), "first_turn_s": first_s}


def run_kiln(scripts: list[list[list[int]]], args: argparse.Namespace) -> dict[str, Any]:
    server = servers.start(extra_args=["--max-num-seqs", str(max(32, len(scripts)))])
    try:
        return kiln_agents(server, scripts, args.gen_tokens)
    finally:
        server.stop()


def kiln_agents(server: servers.Server, scripts: list[list[list[int]]], gen_tokens: int) -> dict[str, Any]:
    """The agents against a running `kiln serve`, one gRPC session each (dashboard_screenshot.py watches them)."""
    from kiln.client import Client

    clients = [Client(server.grpc_address) for _ in scripts]
    try:
        def first(i: int, ids: list[int]) -> Any:
            session = clients[i].create_session(ids)
            list(session.generate(gen_tokens, ignore_eos=True))
            return session

        def turn(session: Any, ids: list[int]) -> list[int]:
            session.append(ids)
            return list(session.generate(gen_tokens, ignore_eos=True))

        result = run_threads(scripts, first, turn)
        proposed, accepted = (server.metric(f"kiln_spec_{n}_tokens_total") for n in ("proposed", "accepted"))
        result["speculation"] = {"proposed_tokens": proposed, "accepted_tokens": accepted,
                                 "verify_steps": server.metric("kiln_spec_verify_steps_total")}
        return result
    finally:
        for client in clients:
            client.close()


def run_llamacpp(loaded: Any, scripts: list[list[list[int]]], args: argparse.Namespace) -> dict[str, Any]:
    length = args.first_tokens + args.turns * (args.new_tokens + args.gen_tokens) + 64
    with LlamaProcess(args.peer_python or sys.executable, common.peer_environment(), str(loaded.source), 64,
                      len(scripts), length) as llama:
        llama.start_sessions()
        start = time.perf_counter()
        llama.turn([s[0] for s in scripts], args.gen_tokens)
        first_s = time.perf_counter() - start
        latencies, generated = [], 0
        start = time.perf_counter()
        for turn in range(1, args.turns + 1):
            begin = time.perf_counter()
            outputs = llama.turn([s[turn] for s in scripts], args.gen_tokens)
            latencies += [time.perf_counter() - begin] * len(scripts)  # every agent waits for the whole turn
            generated += sum(map(len, outputs))
        return {**stats(latencies, generated, time.perf_counter() - start), "first_turn_s": first_s}


def run_llamacpp_server(loaded: Any, scripts: list[list[list[int]]], args: argparse.Namespace) -> dict[str, Any]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    length = args.first_tokens + args.turns * (args.new_tokens + args.gen_tokens) + 64
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(loaded.source), "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", str(length), "--n_threads", str(common.THREADS),
               "--n_threads_batch", str(common.THREADS)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=common.peer_environment())
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("llama_cpp.server did not start") from None
                time.sleep(0.5)

        def complete(history: list[str]) -> list[int]:
            """Its server takes prompts as text only: the whole conversation so far, every turn."""
            body = json.dumps({"prompt": "".join(history), "max_tokens": args.gen_tokens, "temperature": 0.0}).encode()
            request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=3600) as reply:
                text = json.loads(reply.read())["choices"][0]["text"]
            history.append(text)
            return loaded.tokenizer.encode(text, add_special_tokens=False)

        def first(i: int, ids: list[int]) -> list[str]:
            history = [loaded.tokenizer.decode(ids)]
            complete(history)
            return history

        def turn(history: list[str], ids: list[int]) -> list[int]:
            history.append(loaded.tokenizer.decode(ids))
            return complete(history)

        return run_threads(scripts, first, turn)
    finally:
        process.terminate()
        process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", default=",".join(SYSTEMS))
    parser.add_argument("--agents", type=common.ints, default=[1, 4, 8, 16])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first-tokens", type=int, default=400)
    parser.add_argument("--new-tokens", type=int, default=50)
    parser.add_argument("--gen-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3, help="runs of kiln-grpc and llamacpp per N")
    parser.add_argument("--peer-python", help="a Python with llama-cpp-python for llamacpp, when this one has none "
                                              "(llamacpp-server runs under this Python)")
    args = common.parse_run_args(parser, "agents", "agents 1 and 2, 2 turns", _quick)
    systems = [s for s in args.peers.split(",") if s]
    _, machine, loaded = common.start("kiln")
    results: dict[str, Any] = {s: {} for s in systems}
    runners = {"kiln-grpc": lambda scripts: run_kiln(scripts, args),
               "llamacpp": lambda scripts: run_llamacpp(loaded, scripts, args),
               "llamacpp-server": lambda scripts: run_llamacpp_server(loaded, scripts, args)}
    for n in args.agents:
        scripts = agent_scripts(loaded, n, args)
        runs: dict[str, list[dict[str, Any]]] = {system: [] for system in systems}
        for repeat in range(args.repeats):
            for system in systems:
                if system == "llamacpp-server" and repeat:
                    continue
                peer_python = args.peer_python if system == "llamacpp" else None
                missing = peers.missing_reason("llamacpp" if system.startswith("llamacpp") else "kiln-grpc", peer_python)
                if missing:
                    results[system][str(n)] = {"skipped": missing}
                    continue
                runs[system].append(runners[system](scripts))
                print(system, n, runs[system][-1], flush=True)
        for system, done in runs.items():
            if done:
                results[system][str(n)] = {**medians(done), "runs": done}
    ratios = {str(n): common.ratio(_tps(results, "kiln-grpc", n), _tps(results, "llamacpp", n)) for n in args.agents}
    payload = {"method": __doc__, "settings": vars(args), "machine": machine, "results": results,
               "kiln_vs_llamacpp_aggregate_tokens_per_s": ratios}
    print("wrote", common.write_results(args.name, payload))
    plot(args.name, results, args.agents)


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the runs (nested ones too: the speculation counters)."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = medians([run[key] for run in runs])
        else:
            out[key] = median(run[key] for run in runs)
    return out


def _tps(results: dict[str, Any], system: str, n: int) -> float | None:
    return results.get(system, {}).get(str(n), {}).get("aggregate_tokens_per_s")


def _quick(args: argparse.Namespace) -> None:
    args.agents, args.turns, args.repeats = [1, 2], 2, 1


def plot(name: str, results: dict[str, Any], agents: list[int]) -> None:
    groups = [f"N={n}" for n in agents]
    common.plot_bars(name, [
        ("aggregate generated tokens/s", groups, {s: [_tps(results, s, n) for n in agents] for s in results}),
        ("turn latency p50 (s)", groups, {s: [results[s].get(str(n), {}).get("turn_latency_p50_s") for n in agents] for s in results}),
        ("turn latency p95 (s)", groups, {s: [results[s].get(str(n), {}).get("turn_latency_p95_s") for n in agents] for s in results}),
    ], "Concurrent agent sessions on the embedded Gemma 3 270M (2 threads)")


if __name__ == "__main__":
    main()
