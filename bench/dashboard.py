"""What the dashboard's JSON endpoint costs with many sessions, and what polling it costs the engine.

On the embedded model, in process: `--sessions` (10, 100, 1000) live sessions of 32 seeded ids each, every
one prefilled by a one-token greedy generate (so each holds pages), then per count:
- reading: one uncached reading (DashboardState with a zero refresh interval: SessionStore.survey of every
  session, engine counters, history point), `--repeats` times;
- JSON: the admin's view of that reading encoded as the endpoint encodes it (bytes and seconds);
- served: `GET /dashboard/state.json` through the real HTTP app (Starlette's TestClient, admin view of
  all sessions), `--repeats` polls back to back: the first rebuilds the reading, the rest share it.
With `--evicted N` persistence is on (a temporary snapshot directory) and N more sessions, made the same
way first, are evicted to snapshots (a 1 s TTL run out, their saves flushed): every reading also lists
them ("evicted to snapshot", from Persistence.saved's index; the default, 0, keeps persistence off as in
the recorded results). At the end, a second engine opens the same directory, as after a restart: its first
reading reads every manifest and blob size once to build the index, its second one does not.
Then, at the largest count, decode tokens/s of one session generating `--decode-tokens` greedy tokens:
alone, while a thread rebuilds readings back to back (the worst a flood of polls could do if the cache
did not exist), and while a thread polls the endpoint ten times a second (what open pages do).

Writes bench/results/dashboard.json and .png.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from statistics import median
from typing import Any

import common
from fastapi.testclient import TestClient

from kiln.engine.sampler import SamplingParams
from kiln.llm import LLM
from kiln.server.auth import ApiKeys
from kiln.server.dashboard_state import DashboardState
from kiln.server.http import build_http_app
from kiln.server.metrics import Metrics
from kiln.server.service import RuntimeService

GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
HISTORY_IDS = 32


def add_sessions(llm: LLM, count: int, start: int, ttl_s: float | None = None) -> None:
    """`count` more sessions, each prefilled (one greedy token), generated concurrently in batches."""
    for first in range(start, start + count, 64):
        streams = []
        for seed in range(first, min(first + 64, start + count)):
            session_id = llm.sessions.create(common.random_ids(HISTORY_IDS, seed=seed), ttl_s=ttl_s)
            streams.append(llm.sessions.generate(session_id, GREEDY))
        for stream in streams:
            stream.result()


def evict_sessions(llm: LLM, count: int) -> None:
    """`count` sessions evicted to snapshots: made with the shortest TTL, which runs out, then saved."""
    add_sessions(llm, count, start=1_000_000, ttl_s=1.0)
    time.sleep(1.5)
    llm.sessions.expire()  # those still in memory (making the later ones expired the first already)
    assert len(llm.sessions) == 0 and llm.persistence is not None and llm.persistence.flush(600)


def after_restart(snapshot_dir: str) -> dict[str, float]:
    """The first and second uncached reading of a fresh engine over the snapshots left behind."""
    with LLM(max_sessions=16, snapshot_dir=snapshot_dir) as again:
        state = DashboardState(again, health=dict, refresh_s=0.0)
        first, reading = common.timed(state.reading)
        second, _ = common.timed(state.reading)
        return {"first_reading_s": first, "second_reading_s": second, "listed": len(reading.evicted)}


def measure_count(llm: LLM, http: TestClient, repeats: int) -> dict[str, Any]:
    state = DashboardState(llm, health=dict, refresh_s=0.0)
    reading_s, json_s, size = [], [], 0
    for _ in range(repeats):
        seconds, reading = common.timed(state.reading)
        reading_s.append(seconds)
        seconds, body = common.timed(reading.encoded, None, True)
        json_s.append(seconds)
        size = len(body)
    served = []
    for _ in range(repeats):
        started = time.perf_counter()
        response = http.get("/dashboard/state.json")
        served.append(time.perf_counter() - started)
        assert response.status_code == 200, response.text
    return {"reading_s": common.summarize(reading_s), "json_s": common.summarize(json_s), "json_bytes": size,
            "served_first_s": served[0], "served_cached_s": common.summarize(served[1:]),
            "samples": {"reading_s": reading_s, "json_s": json_s, "served_s": served}}


def decode_tps(llm: LLM, tokens: int, seed: int) -> float:
    session_id = llm.sessions.create(common.random_ids(HISTORY_IDS, seed=seed))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.sessions.generate(session_id, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)).result()
    started = time.perf_counter()
    result = llm.sessions.generate(session_id, params).result()
    seconds = time.perf_counter() - started
    llm.sessions.close(session_id)
    return result.usage.generated_tokens / seconds


def decode_under(llm: LLM, http: TestClient, tokens: int, load: str, seed: int) -> dict[str, Any]:
    """Decode tokens/s while `load` runs on another thread: "none", "rebuild" (uncached readings back to
    back) or "poll" (the endpoint, ten times a second); and how many readings or polls it made."""
    stop, done = threading.Event(), [0]
    state = DashboardState(llm, health=dict, refresh_s=0.0)

    def rebuild() -> None:
        while not stop.is_set():
            state.reading()
            done[0] += 1

    def poll() -> None:
        while not stop.wait(0.1):
            http.get("/dashboard/state.json")
            done[0] += 1

    worker = {"none": None, "rebuild": rebuild, "poll": poll}[load]
    thread = threading.Thread(target=worker, daemon=True) if worker else None
    if thread:
        thread.start()
    try:
        tps = decode_tps(llm, tokens, seed)
    finally:
        stop.set()
        if thread:
            thread.join()
    return {"load": load, "decode_tokens_per_s": tps, "load_operations": done[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=common.ints, default=[10, 100, 1000])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--decode-repeats", type=int, default=3)
    parser.add_argument("--evicted", type=int, default=0, help="sessions evicted to snapshots (persistence on)")

    def quick(args: argparse.Namespace) -> None:
        args.sessions, args.repeats, args.decode_tokens, args.decode_repeats = [10, 50], 3, 16, 1

    args = common.parse_run_args(parser, "dashboard", "10 and 50 sessions, 3 repeats", quick)
    common.warn_if_busy()
    common.set_threads()
    snapshots = tempfile.TemporaryDirectory(prefix="kiln-bench-dashboard-") if args.evicted else None
    llm = LLM(max_sessions=max(args.sessions) + args.evicted + 16, session_ttl_s=86400.0,
              snapshot_dir=snapshots.name if snapshots else None)
    if args.evicted:
        evict_sessions(llm, args.evicted)
    http = TestClient(build_http_app(RuntimeService(llm, "kiln"), ApiKeys(), Metrics(llm)))
    http.get("/dashboard/state.json")  # untimed warm-up: the test client's event loop and thread pool
    counts: dict[str, Any] = {}
    made = 0
    for count in sorted(args.sessions):
        add_sessions(llm, count - made, made)
        made = count
        counts[str(count)] = measure_count(llm, http, args.repeats)
        row = counts[str(count)]
        print(f"{count} sessions (+{args.evicted} evicted): reading median {row['reading_s']['median'] * 1e3:.1f} ms, JSON {row['json_bytes']} B "
              f"in {row['json_s']['median'] * 1e3:.1f} ms, served cached median {row['served_cached_s']['median'] * 1e3:.1f} ms")
    decode = []
    for repeat in range(args.decode_repeats):
        for load in ("none", "rebuild", "poll"):
            decode.append(decode_under(llm, http, args.decode_tokens, load, seed=10_000 + repeat))
            print(f"decode with {load}: {decode[-1]['decode_tokens_per_s']:.1f} tok/s ({decode[-1]['load_operations']} ops)")
    by_load = {load: median(d["decode_tokens_per_s"] for d in decode if d["load"] == load)
               for load in ("none", "rebuild", "poll")}
    usage = vars(llm.engine.kv_usage())
    llm.close()
    restart = after_restart(snapshots.name) if snapshots is not None else None
    if restart is not None:
        print(f"after a restart: first reading {restart['first_reading_s'] * 1e3:.1f} ms (reads the store), "
              f"second {restart['second_reading_s'] * 1e3:.1f} ms, {restart['listed']} sessions listed")
    payload = {"machine": common.machine_info(), "args": vars(args), "history_ids": HISTORY_IDS, "after_restart": restart,
               "counts": counts, "decode_runs": decode, "decode_tokens_per_s_median": by_load,
               "kv_usage": usage}
    print(f"wrote {common.write_results(args.name, payload)}")
    groups = list(counts)
    common.plot_bars(args.name, [
        ("milliseconds (median)", groups, {
            "uncached reading": [counts[g]["reading_s"]["median"] * 1e3 for g in groups],
            "JSON encode": [counts[g]["json_s"]["median"] * 1e3 for g in groups],
            "served, cached": [counts[g]["served_cached_s"]["median"] * 1e3 for g in groups]}),
        ("KiB of JSON (admin view, all sessions)", groups, {"state.json": [counts[g]["json_bytes"] / 1024 for g in groups]}),
        (f"decode tokens/s at {groups[-1]} sessions", ["alone", "readings back to back", "polled 10/s"],
         {"decode": [by_load["none"], by_load["rebuild"], by_load["poll"]]}),
    ], "Dashboard: the JSON endpoint's cost against live sessions")
    if snapshots is not None:
        snapshots.cleanup()


if __name__ == "__main__":
    main()
