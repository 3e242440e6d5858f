"""Per-step cost against history length, in process.

One Kiln session per `--lengths` (1k, 6k, 13k tokens: BOS and seeded random ids, computed by generating
one greedy token). Then `--warmup-turns` (2) untimed and `--turns` (10) timed turns per session, each
"append 1 token id + generate 1 token": one engine step that computes 2 tokens (the appended id and the
previous turn's generated token) against the whole history. The sessions take turns round-robin, so
load from other processes on a shared machine falls on every length alike. A turn's latency is wall
time from the append to the result; the headline is its median per length and the ratio of the longest
to the shortest. A step whose cost grows with the history by more than the attention over it does
shows here.

Breakdown (timers wrapped around the engine's own methods, when it has them): `forward` is the model
runner's forward, split into `attention` (every layer's paged attention call, K/V writes included),
`lm_head` (the logits) and `layers_other` (projections, norms, MLPs), `sample` the sampler, `prepare` building the
step's inputs from the page tables, `step_other` the rest of the engine step (scheduling, committing
pages, emitting), `bookkeeping` the step less forward and sampling, `outside_step` the rest of the turn (session append, submit, the hand-off between
threads, the invariant check after the turn: `check` is that check alone).

Against the bandwidth limit: the history-dependent part of a turn at each length is its median latency
less the shortest length's; beside it, the time to read the K/V that extra history adds to a step once
(global groups every token, sliding-window groups up to their window; the pool's bytes per token) at the
machine's read bandwidth (bench/common.py read_bandwidth_gb_s). Their ratio is how far the step's growth
is from the limit (issue 28 goal 3: within 2x).
"""

from __future__ import annotations

import argparse
import importlib
import threading
import time
from collections import defaultdict
from dataclasses import asdict
from statistics import median
from typing import Any

import common

# What the breakdown times: label -> attribute paths from the LLM, the first one the engine has is
# wrapped (the second names are the engine before the scheduler restructuring, to measure it the same
# way); a label none of whose paths exists is left out.
PROBES = {
    "step": ("engine.step",),
    "prepare": ("engine._runner.prepare", "engine.runner.slice_for"),
    "forward": ("engine._runner.run", "engine.runner.run"),
    "attention": ("module:kiln.models.attention.AttentionBatch.attend",),
    "lm_head": ("engine.model.logits",),
    "sample": ("engine._step_sampler.sample", "engine._sample"),
    "check": ("engine.check_sequence",),
}


class Probe:
    """Wall time spent in some methods of one object graph, accumulated per label until `take()`.
    Instance attributes shadow the class's methods, so nothing outside this LLM is affected."""

    def __init__(self, root: Any) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.wrapped: list[str] = []
        self.missing: list[str] = []
        self._steps_open = 0
        self._idle = threading.Condition()
        for label, paths in PROBES.items():
            found = next(((owner, path) for path in paths if (owner := _owner(root, path)) is not None), None)
            if found is None:
                self.missing.append(label)
                continue
            owner, path = found
            name = path.rsplit(".", 1)[1]
            setattr(owner, name, self._timed(label, getattr(owner, name)))
            self.wrapped.append(path)

    def _timed(self, label: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if label == "step":
                with self._idle:
                    self._steps_open += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self._idle:
                    self.totals[label] += time.perf_counter() - start
                    if label == "step":
                        self._steps_open -= 1
                        self._idle.notify_all()

        return call

    def take(self) -> dict[str, float]:
        """Seconds per label since the last take, once no step is in flight: a step emits its result
        before it returns, so the caller may hold a result while its step's timer still runs."""
        with self._idle:
            self._idle.wait_for(lambda: self._steps_open == 0, timeout=10)
            totals, self.totals = dict(self.totals), defaultdict(float)
        return totals


def _owner(root: Any, path: str) -> Any:
    """The object holding the method `path` ("a.b.method", from the LLM; "module:pkg.mod.function" or
    "module:pkg.mod.Class.method", a module's global or a class's method, wrapped for the whole process)
    names, or None if there is no such method."""
    owner = root
    if path.startswith("module:"):
        path = path.removeprefix("module:")
        owner, path = _longest_module(path.split("."))
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part, None)
    return owner if owner is not None and callable(getattr(owner, name, None)) else None


def _longest_module(parts: list[str]) -> tuple[Any, str]:
    """The module the longest importable prefix of `parts` names, and the rest of the path within it."""
    for split in range(len(parts) - 1, 0, -1):
        try:
            return importlib.import_module(".".join(parts[:split])), ".".join(parts[split:])
        except ImportError:
            continue
    raise ImportError(f"no module in {'.'.join(parts)!r}")


def breakdown_ms(latency_s: float, totals: dict[str, float]) -> dict[str, float | None]:
    """One turn's milliseconds by part ("<part>_ms"); None for a part whose probe is missing."""
    step = totals.get("step")
    parts = {f"{label}_ms": 1000 * totals[label] if label in totals else None
             for label in ("prepare", "forward", "attention", "lm_head", "sample", "check")}
    # The forward less attention and the LM head: the layers' projections, norms and MLPs.
    parts["layers_other_ms"] = 1000 * (totals.get("forward", 0.0) - totals.get("attention", 0.0) - totals.get("lm_head", 0.0))
    inner = sum(totals.get(label, 0.0) for label in ("prepare", "forward", "sample"))
    parts["step_ms"] = None if step is None else 1000 * step
    parts["step_other_ms"] = None if step is None else 1000 * (step - inner)
    parts["bookkeeping_ms"] = None if step is None else 1000 * (step - totals.get("forward", 0.0) - totals.get("sample", 0.0))
    parts["outside_step_ms"] = None if step is None else 1000 * (latency_s - step)
    return parts


def one_turn(llm: Any, session: Any, probe: Probe, token_id: int) -> dict[str, Any]:
    """Append one id and generate one token; the turn's latency, TTFT, work done and breakdown."""
    history = len(session.tokens)
    steps = llm.engine.stats.steps
    probe.take()
    start = time.perf_counter()
    session.append([token_id])
    result = session.generate(max_tokens=1, temperature=0.0, ignore_eos=True).result()
    latency = time.perf_counter() - start
    ttft = result.time_to_first_token_s
    return {"history_tokens": history + 1, "latency_ms": 1000 * latency, "ttft_ms": None if ttft is None else 1000 * ttft,
            "prefilled_tokens": result.usage.prefilled_tokens, "engine_steps": llm.engine.stats.steps - steps,
            **(breakdown_ms(latency, probe.take()) if probe.wrapped else {})}


def medians(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """The median of every "*_ms" column over the rows that have it."""
    keys = [key for key in rows[0] if key.endswith("_ms")]
    return {key: median(values) if (values := [r[key] for r in rows if r[key] is not None]) else None for key in keys}


def build(llm: Any, bos: int, length: int, seed: int) -> tuple[Any, float]:
    """A session of `length` tokens (BOS, seeded ids, one generated token that computes them all) and the
    seconds that took."""
    start = time.perf_counter()
    session = llm.create_session([bos, *common.random_ids(length - 2, seed)])
    session.generate(max_tokens=1, temperature=0.0, ignore_eos=True).result()
    return session, time.perf_counter() - start


def kv_bytes_read(llm: Any, history: int) -> int:
    """Bytes of K/V one step at `history` tokens reads once: every group's pages its keys lie in (global
    groups the whole history, sliding-window groups their window), in the pool's encoding."""
    layout = llm.engine.kv_layout
    per_group = llm.engine.kv_bytes_per_token / layout.num_groups
    return int(sum(per_group * (history if group.window is None else min(history, group.window)) for group in layout.groups))


def history_dependence(results: dict[str, Any], notes: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per length past the first: the turn's median less the first length's, and the time to read the
    K/V the extra history adds once at the measured bandwidth (ms), and their ratio."""
    lengths = list(results)
    first, bandwidth = lengths[0], notes["read_bandwidth_gb_s"] * 1e9
    out = {}
    for length in lengths[1:]:
        extra_ms = results[length]["median_ms"]["latency_ms"] - results[first]["median_ms"]["latency_ms"]
        read_ms = 1000 * (notes["kv_bytes_read"][length] - notes["kv_bytes_read"][first]) / bandwidth
        out[length] = {"history_dependent_ms": extra_ms, "kv_read_ms": read_ms, "ratio": common.ratio(extra_ms, read_ms)}
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=common.ints, default=[1000, 6000, 13000], help="history lengths, tokens")
    parser.add_argument("--turns", type=int, default=10, help="timed turns per length")
    parser.add_argument("--warmup-turns", type=int, default=2, help="untimed turns per length first")
    parser.add_argument("--kv-budget-mb", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = common.parse_run_args(parser, "step_cost", "lengths 500,2000, 5 turns", _quick)
    return args


def _quick(args: argparse.Namespace) -> None:
    args.lengths, args.turns = [500, 2000], 5


def main() -> None:
    args = parse_args()
    _, machine, loaded = common.start("kiln")
    from kiln import LLM

    llm = LLM(loaded=loaded, num_threads=common.THREADS, kv_budget_bytes=args.kv_budget_mb * 1024**2)
    probe = Probe(llm)
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    try:
        built = {length: build(llm, loaded.config.bos_token_id, length, args.seed + length) for length in args.lengths}
        turn_ids = iter(common.random_ids(len(args.lengths) * (args.warmup_turns + args.turns), args.seed + 1))
        rows: dict[int, list[dict[str, Any]]] = {length: [] for length in args.lengths}
        for round_ in range(args.warmup_turns + args.turns):  # round-robin: load from others falls on every length
            for length, (session, _) in built.items():
                row = one_turn(llm, session, probe, next(turn_ids))
                if round_ >= args.warmup_turns:
                    rows[length].append(row)
        cpu_share = (time.process_time() - cpu_start) / ((time.perf_counter() - wall_start) * common.THREADS)
        notes = {"cpu_share_of_threads": cpu_share, "engine_config": asdict(llm.config),
                 "probes_wrapped": probe.wrapped, "probes_missing": probe.missing,
                 "read_bandwidth_gb_s": common.read_bandwidth_gb_s(),
                 "kv_bytes_read": {str(length): kv_bytes_read(llm, length) for length in args.lengths}}
    finally:
        llm.close()
    results = {str(length): {"build_s": built[length][1], "median_ms": medians(rows[length]), "turns": rows[length]}
               for length in args.lengths}
    report(args, machine, results, notes)


def report(args: argparse.Namespace, machine: dict[str, Any], results: dict[str, Any], notes: dict[str, Any]) -> None:
    first, last = str(args.lengths[0]), str(args.lengths[-1])
    payload = {
        "benchmark": "step_cost",
        "machine": machine,
        "args": vars(args),
        "method": {
            "turn": "session.append([one id]) then session.generate(max_tokens=1, temperature=0, ignore_eos=True).result(); "
                    "perf_counter around both; one engine step computing 2 tokens",
            "history": "one session per length (BOS + seeded random ids, computed by one generated token); "
                       f"{args.warmup_turns} untimed then {args.turns} timed turns per session, the sessions round-robin",
            "breakdown_ms": "wall time in wrapped engine methods (notes.probes_wrapped): forward = the model runner's run, "
                            "prepare = building its inputs, sample = Engine._sample, step_other = Engine.step - those three, "
                            "bookkeeping = Engine.step - forward - sample, outside_step = turn - Engine.step, "
                            "check = Engine.check_sequence (the session's invariant check, outside the step)",
            "cpu_share_of_threads": "process CPU time / (wall time x threads) over the run; well below 1 means the CPU was shared",
        },
        "summary": {
            "median_turn_ms": {length: r["median_ms"]["latency_ms"] for length, r in results.items()},
            "median_forward_ms": {length: r["median_ms"].get("forward_ms") for length, r in results.items()},
            "last_over_first": common.ratio(results[last]["median_ms"]["latency_ms"], results[first]["median_ms"]["latency_ms"]),
            "last_over_first_forward": common.ratio(results[last]["median_ms"].get("forward_ms"),
                                                    results[first]["median_ms"].get("forward_ms")),
            "history_dependence": history_dependence(results, notes),
        },
        "notes": notes,
        "lengths": results,
    }
    path = common.write_results(args.name, payload)
    xs = [r["turns"][0]["history_tokens"] for r in results.values()]
    parts = {"turn (append 1 + generate 1)": "latency_ms", "forward": "forward_ms", "sampling": "sample_ms",
             "engine bookkeeping (step - forward - sampling)": "bookkeeping_ms", "outside the engine step": "outside_step_ms"}
    series = {label: (xs, [r["median_ms"].get(key) for r in results.values()]) for label, key in parts.items()
              if all(r["median_ms"].get(key) is not None for r in results.values())}
    png = common.plot_lines(args.name, series, "history length (tokens)", "milliseconds per turn (median, log scale)",
                            "One-token turn on a long session: where the time goes")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    print(f"median turn ms {payload['summary']['median_turn_ms']}, {last}/{first} = {payload['summary']['last_over_first']:.3f}")
    print(f"history-dependent part of a turn (its median less the {first}-token one's) against reading that history's K/V "
          f"once at {notes['read_bandwidth_gb_s']:.1f} GB/s:")
    for length, entry in payload["summary"]["history_dependence"].items():
        ratio = "n/a" if entry["ratio"] is None else f"{entry['ratio']:.2f}x"
        print(f"  {length} tokens: {entry['history_dependent_ms']:.2f} ms against {entry['kv_read_ms']:.2f} ms ({ratio})")


if __name__ == "__main__":
    main()
