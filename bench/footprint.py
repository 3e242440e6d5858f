"""Footprint: the memory a real `kiln serve` holds and the disk its caches take (issue 29 § 4).

`kiln serve` on the embedded model with the default engine settings (int8 weights, float16 KV pages, the
default kv_budget, persistence on, to a fresh snapshot directory) and two threads, as bench/agents.py
starts it, over a fresh converted-weight cache (a temporary KILN_CACHE_DIR). A first server converts and
quantises the model into it: its resident set at ready and its peak are recorded (`first_start`), then it
stops. A second server, the one measured, starts from that cache. Its resident set (VmRSS from /proc,
split into anonymous memory and mapped file pages, plus the peak VmHWM) is read

- at ready (the model loaded, nothing served),
- after one request (a session: `--prompt-tokens` ids, `--gen-tokens` greedy tokens),
- after `--agents` agents (a session each, `--turns` turns of `--new-tokens` appended ids and
  `--gen-tokens` generated ones, all agents at once, as bench/agents.py runs them).

Disk: the converted-weight cache ($KILN_CACHE_DIR or ~/.cache/kiln, per file), the compiled kernels
($TORCH_EXTENSIONS_DIR/kiln) and the snapshot directory after the agents. Goal: RSS <= 1.5 GB after the
agents. Writes bench/results/footprint.json and .png.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import common
import servers
from agents import in_threads

GOAL_RSS_BYTES = int(1.5 * 10**9)


def memory(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and VmHWM of a process, in bytes."""
    wanted = {"VmRSS", "RssAnon", "RssFile", "VmHWM"}
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in wanted:
            values[key] = int(rest.split()[0]) * 1024
    return values


def disk_usage(path: Path) -> dict[str, Any]:
    """Total bytes under `path` and the ten largest files (relative paths): what a reader may delete."""
    if not path.exists():
        return {"path": str(path), "bytes": 0, "largest": {}}
    sizes = {str(file.relative_to(path)): file.stat().st_size for file in path.rglob("*") if file.is_file()}
    largest = dict(sorted(sizes.items(), key=lambda item: -item[1])[:10])
    return {"path": str(path), "bytes": sum(sizes.values()), "largest": largest}


def cache_dirs(snapshot_dir: Path) -> dict[str, Path]:
    from kiln.models.weight_cache import default_cache_dir

    extensions = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    return {"converted_weights": default_cache_dir(), "kernels": extensions / "kiln", "snapshots": snapshot_dir}


def run_agents(client_factory: Any, args: argparse.Namespace) -> int:
    """`args.agents` concurrent sessions of `args.turns` turns; returns the tokens generated."""
    generated = [0] * args.agents

    def agent(i: int) -> None:
        client = client_factory()
        try:
            session = client.create_session(common.random_ids(args.prompt_tokens, seed=300 + i))
            generated[i] += len(list(session.generate(args.gen_tokens, ignore_eos=True)))
            for turn in range(args.turns - 1):
                session.append(common.random_ids(args.new_tokens, seed=1000 * i + turn))
                generated[i] += len(list(session.generate(args.gen_tokens, ignore_eos=True)))
        finally:
            client.close()

    in_threads(args.agents, agent)
    return sum(generated)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from kiln.client import Client

    os.environ["KILN_CACHE_DIR"] = tempfile.mkdtemp(prefix="kiln-footprint-cache-")  # the servers inherit it
    snapshots = Path(tempfile.mkdtemp(prefix="kiln-footprint-"))
    first = servers.start(extra_args=list(args.serve_args))  # no persistence: only the cache is filled
    try:
        first_start = memory(first.process.pid)
    finally:
        first.stop()
    server = servers.start(extra_args=["--snapshot-dir", str(snapshots), *args.serve_args])
    try:
        pid = server.process.pid
        phases = {"first_start": first_start, "ready": memory(pid)}
        client = Client(server.grpc_address)
        try:
            session = client.create_session(common.random_ids(args.prompt_tokens, seed=1))
            list(session.generate(args.gen_tokens, ignore_eos=True))
        finally:
            client.close()
        phases["after_one_request"] = memory(pid)
        generated = run_agents(lambda: Client(server.grpc_address), args)
        phases[f"after_{args.agents}_agents"] = memory(pid)
        disk = {name: disk_usage(path) for name, path in cache_dirs(snapshots).items()}
    finally:
        server.stop()
        for temporary in (snapshots, Path(os.environ["KILN_CACHE_DIR"])):  # measured: nothing reads them again
            shutil.rmtree(temporary, ignore_errors=True)
    return {"rss": phases, "disk": disk, "agent_tokens_generated": generated}


def plot(name: str, result: dict[str, Any]) -> None:
    phases = list(result["rss"])
    kinds = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
    rss = {kind: [result["rss"][phase][kind] / 1e9 for phase in phases] for kind in kinds}
    disk = {"bytes": [entry["bytes"] / 1e9 for entry in result["disk"].values()]}
    common.plot_bars(name, [("GB resident (kiln serve)", phases, rss), ("GB on disk", list(result["disk"]), disk)],
                     f"kiln serve footprint (embedded model, defaults; goal RSS <= {GOAL_RSS_BYTES / 1e9} GB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                        help="more `kiln serve` flags, last on the line (e.g. --serve-args --kv-budget-mb 512)")

    def quick(args: argparse.Namespace) -> None:
        args.agents, args.turns, args.gen_tokens = 2, 2, 8

    args = common.parse_run_args(parser, "footprint", "2 agents of 2 turns, 8 generated tokens each", quick)
    common.warn_if_busy()
    result = measure(args)
    final = result["rss"][f"after_{args.agents}_agents"]["VmRSS"]
    payload = {
        "machine": common.machine_info(),
        "settings": {key: getattr(args, key) for key in ("agents", "turns", "prompt_tokens", "new_tokens", "gen_tokens",
                                                          "serve_args")},
        **result,
        "goal_rss_bytes": GOAL_RSS_BYTES,
        "meets_goal": final <= GOAL_RSS_BYTES,
    }
    print(common.write_results(args.name, payload))
    plot(args.name, result)
    for phase, values in result["rss"].items():
        print(f"{phase:>20}: RSS {values['VmRSS'] / 1e9:.3f} GB (anon {values['RssAnon'] / 1e9:.3f}, "
              f"file {values['RssFile'] / 1e9:.3f}, peak {values['VmHWM'] / 1e9:.3f})")
    for name, entry in result["disk"].items():
        print(f"{name:>20}: {entry['bytes'] / 1e9:.3f} GB in {entry['path']}")


if __name__ == "__main__":
    main()
