"""Long agent session: per-turn latency against history length.

One scripted conversation (deterministic agent/tool text, tokenized once with Kiln's tokenizer into
`--new-tokens` ids per turn) runs through each system. Every turn appends the turn's ids and generates
`--gen-tokens` greedy tokens, which join that system's own history. Latency is wall time from handing
over the new ids to the last generated token.

- kiln: one session; each turn computes only the ids its pages do not hold yet (default engine: int8
  weights, n-gram speculative decoding).
- kiln-nospec: the same with speculative decoding off (EngineConfig.speculative=None).
- kiln-grpc: the same through `kiln serve` and the Python SDK (append ids, stream the generate), so the
  difference to `kiln` is the per-token cost of gRPC streaming.
- kiln-http: an OpenAI-style client against `kiln serve`: every turn re-sends the whole conversation as
  text to /v1/completions, and automatic prefix caching recomputes only from the first page that
  differs (usage.prompt_tokens_details.cached_tokens says how much was reused).
- hf: `generate` on the full history every turn (what a transformers user does by default). A turn
  near 15k tokens takes minutes, so HF is timed on every turn of the early window, every
  `--hf-late-stride`-th turn of the late window and every `--hf-stride`-th turn between. On the other
  turns HF's history takes Kiln's tokens for that turn without running: greedy on the same fp32
  weights, they are the tokens HF produces itself (every timed turn checks this; see the agreement).
- llamacpp: llama-cpp-python `generate` with the full history every turn; it reuses the longest
  common token prefix with its previous call, which the per-turn `prefill_tokens` confirms. It runs in a
  process of its own that keeps the history (bench/llama_cpp_worker.py, under `--peer-python` or this
  Python), without the OpenMP wait policy `import kiln` sets for this one; turns are timed here, around
  each call, and its `cpu_share_of_threads` is the worker's.

Target: Kiln's median latency over turns 190-200 <= 1.3 x its median over turns 5-15 (the late window
is the last 11 turns when --turns is smaller); the same ratio is reported for each peer.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any

import common
import peers
import servers
from llama_cpp_worker import LlamaProcess

EARLY_WINDOW = (5, 15)
LATE_WINDOW_TURNS = 11
TARGET_RATIO = 1.3
_SUBJECTS = ("the parser", "the cache layer", "the retry loop", "the CLI", "the config loader", "the scheduler")
_FILES = ("src/app.py", "lib/store.rs", "api/routes.ts", "core/engine.go", "tests/test_io.py", "docs/setup.md")
_ERRORS = ("KeyError: 'user_id'", "timeout after 30s", "assertion failed: len > 0", "permission denied", "null pointer")
_TEMPLATES = (
    "User: please look at {subject} in {file}; it fails with {error} when the input is empty.\n",
    "Tool(read_file {file}) -> {n} lines. Line {k}: `if not items: return {error!r}`\n",
    "Tool(run_tests) -> {n} passed, {k} failed. First failure in {file}: {error}.\n",
    "User: now refactor {subject} so the retry count comes from the config, and keep the old default.\n",
    "Tool(grep '{subject}') -> matches in {file} at lines {k} and {n}.\n",
    "User: summarise what changed in {file} and why {subject} needed it, in two sentences.\n",
)


@dataclass
class TurnResult:
    generated: list[int]
    latency_s: float | None  # None: this turn was not timed (HF between its sampled turns)
    prefill_tokens: int | None  # prompt tokens the system computed this turn


@dataclass
class Trace:
    """Per-turn columns of one system's run (columnar to keep the JSON small)."""

    turn: list[int] = field(default_factory=list)
    history_tokens: list[int] = field(default_factory=list)
    latency_s: list[float | None] = field(default_factory=list)
    prefill_tokens: list[int | None] = field(default_factory=list)

    def add(self, turn: int, history: int, result: TurnResult) -> None:
        self.turn.append(turn)
        self.history_tokens.append(history)
        self.latency_s.append(result.latency_s)
        self.prefill_tokens.append(result.prefill_tokens)

    def window(self, first: int, last: int) -> list[float]:
        """Measured latencies of turns first..last inclusive."""
        return [s for t, s in zip(self.turn, self.latency_s, strict=True) if first <= t <= last and s is not None]


def scripted_turns(loaded: Any, turns: int, new_tokens: int, seed: int) -> list[list[int]]:
    """`turns` chunks of exactly `new_tokens` ids cut from one deterministic transcript tokenized once;
    the first chunk starts with BOS. Every system receives these same ids."""
    rng = random.Random(seed)
    lines: list[str] = []
    ids: list[int] = []
    while len(ids) < turns * new_tokens:
        for _ in range(max(turns, 64)):
            fields = {"subject": rng.choice(_SUBJECTS), "file": rng.choice(_FILES), "error": rng.choice(_ERRORS)}
            lines.append(rng.choice(_TEMPLATES).format(n=rng.randint(2, 900), k=rng.randint(1, 80), **fields))
        ids = loaded.tokenizer.encode("".join(lines), add_special_tokens=False)
    chunks = [ids[i * new_tokens : (i + 1) * new_tokens] for i in range(turns)]
    chunks[0] = [loaded.config.bos_token_id, *chunks[0]]
    return chunks


class KilnRunner:
    """One Kiln session for the whole conversation."""

    def __init__(self, loaded: Any, gen_tokens: int, **options: Any) -> None:
        from kiln import LLM, SamplingParams

        self.llm = LLM(loaded=loaded, num_threads=common.THREADS, **options)
        self.params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
        self.session = self.llm.create_session()

    def warm_up(self, ids: list[int]) -> None:
        with self.llm.create_session(ids) as session:
            list(session.generate(self.params))

    def turn(self, index: int, new_ids: list[int]) -> TurnResult:
        start = time.perf_counter()
        self.session.append(new_ids)
        generated = list(self.session.generate(self.params))
        latency = time.perf_counter() - start
        return TurnResult(generated, latency, self.session.info().last_prefill_tokens)

    def notes(self) -> dict[str, Any]:
        info = self.session.info()
        return {
            "kv_bytes_per_token_all_layers": self.llm.engine.kv_bytes_per_token,
            "resident_kv_bytes_at_end": info.resident_kv_bytes,
            "resident_kv_bytes_per_history_token_at_end": info.resident_kv_bytes / max(info.history_tokens, 1),
            "engine_config": {k: v for k, v in asdict(self.llm.config).items() if k != "model"},
            "speculation": {name: getattr(self.llm.engine.stats, f"spec_{name}")
                            for name in ("verify_steps", "proposed_tokens", "accepted_tokens")},
        }

    def close(self) -> None:
        self.session.close()
        self.llm.close()


class HFRunner:
    """transformers `generate` on the full history, timed on a sparse schedule (see module doc)."""

    def __init__(self, loaded: Any, args: argparse.Namespace, reference: list[list[int]] | None) -> None:
        self.model = peers.build_hf_model(loaded)
        self.gen_tokens = args.gen_tokens
        self.args = args
        self.reference = reference
        self.history: list[int] = []
        self.cache: Any = None

    def warm_up(self, ids: list[int]) -> None:
        peers.hf_generate(self.model, [ids], self.gen_tokens)

    def _timed_turn(self, index: int) -> bool:
        turns = self.args.turns
        late = index > turns - LATE_WINDOW_TURNS and (turns - index) % self.args.hf_late_stride == 0
        return index <= EARLY_WINDOW[1] or late or index % self.args.hf_stride == 0

    def turn(self, index: int, new_ids: list[int]) -> TurnResult:
        self.history += new_ids
        if not self._timed_turn(index):
            if self.reference is not None:
                return self._commit(self.reference[index - 1], None, None)
            generated, self.cache = peers.hf_generate(self.model, [self.history], self.gen_tokens, self.cache)
            return self._commit(generated[0].tolist(), None, None)
        self.cache = None  # every timed turn starts from nothing, as a plain `generate` call does
        start = time.perf_counter()
        generated, self.cache = peers.hf_generate(self.model, [self.history], self.gen_tokens)
        latency = time.perf_counter() - start
        if self.reference is not None:
            self.cache = None  # untimed turns take Kiln's tokens; the cache would only hold memory
        return self._commit(generated[0].tolist(), latency, len(self.history))

    def _commit(self, generated: list[int], latency: float | None, prefill: int | None) -> TurnResult:
        self.history += generated
        return TurnResult(generated, latency, prefill)

    def notes(self) -> dict[str, Any]:
        return {
            "schedule": {
                "early_window": "every turn",
                "late_stride": self.args.hf_late_stride,
                "stride_between": self.args.hf_stride,
                "untimed_turns": "take Kiln's tokens for the turn" if self.reference is not None
                else "continue HF's own generate from its KV cache",
            },
            "attn_implementation": self.model.config._attn_implementation,
            "kv_bytes_per_token_all_layers": peers.hf_kv_bytes_per_token(self.model),
        }

    def close(self) -> None:
        self.cache = None


class GrpcRunner:
    """One session of a fresh `kiln serve`, driven through the Python SDK."""

    def __init__(self, gen_tokens: int) -> None:
        from kiln.client import Client

        self.server = servers.start()
        self.client = Client(self.server.grpc_address)
        self.gen_tokens = gen_tokens
        self.session = self.client.create_session()

    def warm_up(self, ids: list[int]) -> None:
        with self.client.create_session(ids) as session:
            list(session.generate(self.gen_tokens, ignore_eos=True))

    def turn(self, index: int, new_ids: list[int]) -> TurnResult:
        start = time.perf_counter()
        self.session.append(new_ids)
        generation = self.session.generate(self.gen_tokens, ignore_eos=True)
        generated = list(generation)
        latency = time.perf_counter() - start
        return TurnResult(generated, latency, generation.result().usage.prefilled_tokens)

    def notes(self) -> dict[str, Any]:
        return {"transport": "gRPC server-streaming Generate, Python SDK (kiln.client.Client)"}

    def close(self) -> None:
        self.client.close()
        self.server.stop()


class OpenAIRunner:
    """An OpenAI client that keeps its conversation as text and re-sends all of it every turn."""

    def __init__(self, loaded: Any, gen_tokens: int) -> None:
        import openai

        self.server = servers.start()
        self.client = openai.OpenAI(base_url=self.server.http_url + "/v1", api_key="none", timeout=600)
        self.tokenizer = loaded.tokenizer
        self.gen_tokens = gen_tokens
        self.text = ""
        self.cached_tokens: list[int] = []

    def _complete(self, prompt: str) -> Any:
        return self.client.completions.create(model="kiln", prompt=prompt, max_tokens=self.gen_tokens,
                                              temperature=0.0, extra_body={"ignore_eos": True})

    def warm_up(self, ids: list[int]) -> None:
        self._complete(self.tokenizer.decode(ids))

    def turn(self, index: int, new_ids: list[int]) -> TurnResult:
        self.text += self.tokenizer.decode(new_ids)
        start = time.perf_counter()
        reply = self._complete(self.text)
        latency = time.perf_counter() - start
        self.text += reply.choices[0].text
        usage = reply.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        self.cached_tokens.append(cached)
        generated = self.tokenizer.encode(reply.choices[0].text, add_special_tokens=False)
        return TurnResult(generated, latency, usage.prompt_tokens - cached)

    def notes(self) -> dict[str, Any]:
        return {
            "transport": "POST /v1/completions (openai package), whole conversation as text every turn",
            "cached_tokens_per_turn": self.cached_tokens,
        }

    def close(self) -> None:
        self.client.close()
        self.server.stop()


class LlamaCppRunner:
    """llama-cpp-python `generate` over the full history, in llama.cpp's worker process (which keeps the
    history); counts the tokens it really evaluates."""

    def __init__(self, loaded: Any, gen_tokens: int, max_tokens: int, python: str) -> None:
        self.llama = LlamaProcess(python, common.peer_environment(), str(loaded.source), max_tokens)
        self.config = loaded.config
        self.gen_tokens = gen_tokens

    def warm_up(self, ids: list[int]) -> None:
        self.llama.history_turn(ids, self.gen_tokens, fresh=True)

    def turn(self, index: int, new_ids: list[int]) -> TurnResult:
        start = time.perf_counter()
        generated, evaluated = self.llama.history_turn(new_ids, self.gen_tokens, fresh=index == 1)
        latency = time.perf_counter() - start
        prefill = evaluated - (len(generated) - 1)  # the rest were the generated tokens' decode steps
        return TurnResult(generated, latency, prefill)

    def cpu_seconds(self) -> float:
        """The worker's CPU seconds: llama.cpp's threads run there, not in this process."""
        return self.llama.cpu_seconds()

    def notes(self) -> dict[str, Any]:
        return {
            "n_ctx": self.llama.n_ctx,
            "prefix_reuse": "llama-cpp-python Llama.generate(reset=True) keeps the longest common prefix with its previous call",
            "kv_bytes_per_token_all_layers": self.llama.kv_bytes_per_token(self.config),
            "process": "bench/llama_cpp_worker.py, without Kiln's OpenMP wait policy",
        }

    def close(self) -> None:
        self.llama.close()


def make_runner(system: str, loaded: Any, args: argparse.Namespace, max_tokens: int,
                kiln_outputs: list[list[int]] | None) -> Any:
    if system == "kiln":
        return KilnRunner(loaded, args.gen_tokens)
    if system == "kiln-nospec":
        return KilnRunner(loaded, args.gen_tokens, speculative=None)
    if system == "kiln-grpc":
        return GrpcRunner(args.gen_tokens)
    if system == "kiln-http":
        return OpenAIRunner(loaded, args.gen_tokens)
    if system == "hf":
        return HFRunner(loaded, args, kiln_outputs)
    return LlamaCppRunner(loaded, args.gen_tokens, max_tokens, args.peer_python or sys.executable)


def run_system(runner: Any, name: str, turns: list[list[int]], warm_ids: list[int]) -> tuple[Trace, list[list[int]]]:
    """Warm up once, then play every turn; returns the trace and each turn's generated tokens."""
    runner.warm_up(warm_ids)
    trace, outputs, history = Trace(), [], 0
    for index, new_ids in enumerate(turns, start=1):
        history += len(new_ids)
        result = runner.turn(index, new_ids)
        trace.add(index, history, result)
        outputs.append(result.generated)
        history += len(result.generated)
        if index % 10 == 0 or index == len(turns):
            shown = "untimed" if result.latency_s is None else f"{result.latency_s:.3f} s"
            print(f"[{name}] turn {index}/{len(turns)}, history {trace.history_tokens[-1]} tokens: {shown}", file=sys.stderr, flush=True)
    return trace, outputs


def summarize(trace: Trace, turns: int) -> dict[str, Any]:
    """Median latency of the early and late windows and their ratio (the issue's target metric)."""
    early = (EARLY_WINDOW[0], min(EARLY_WINDOW[1], turns))
    late = (max(turns - LATE_WINDOW_TURNS + 1, 1), turns)
    early_stats, late_stats = common.summarize(trace.window(*early)), common.summarize(trace.window(*late))
    timed = [s for s in trace.latency_s if s is not None]
    return {
        "early_turns": list(early),
        "late_turns": list(late),
        "early_latency_s": early_stats,
        "late_latency_s": late_stats,
        "late_over_early": common.ratio(late_stats["median"], early_stats["median"]),
        "timed_turns": len(timed),
        "total_timed_s": sum(timed),
    }


def agreement(system: str, outputs: list[list[int]], kiln_outputs: list[list[int]] | None) -> dict[str, Any]:
    """For a peer run after Kiln: the first turn whose greedy tokens differ from Kiln's (null: none did).
    HF runs the same fp32 weights, so it should match for many turns; llama.cpp's 4-bit weights soon
    differ, and from then on each system continues its own history."""
    if system == "kiln" or kiln_outputs is None:
        return {}
    pairs = enumerate(zip(outputs, kiln_outputs, strict=True), start=1)
    return {"first_turn_differing_from_kiln": next((turn for turn, (a, b) in pairs if a != b), None)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=50, help="scripted ids appended per turn")
    parser.add_argument("--gen-tokens", type=int, default=24, help="greedy tokens generated per turn")
    parser.add_argument("--peers", default="kiln,kiln-nospec,kiln-grpc,kiln-http,hf,llamacpp",
                        help="comma-separated subset of kiln,kiln-nospec,kiln-grpc,kiln-http,hf,llamacpp")
    parser.add_argument("--hf-stride", type=int, default=50, help="HF: time every k-th turn between the windows")
    parser.add_argument("--hf-late-stride", type=int, default=5, help="HF: time every k-th turn of the late window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peer-python", help="a Python with llama-cpp-python, when this one has none")
    return common.parse_run_args(parser, "long_session", "12 turns", _quick)


def _quick(args: argparse.Namespace) -> None:
    args.turns, args.hf_stride = 12, 3


def main() -> None:
    args = parse_args()
    systems, machine, loaded = common.start(args.peers)
    turns = scripted_turns(loaded, args.turns, args.new_tokens, args.seed)
    warm_ids = [loaded.config.bos_token_id, *common.random_ids(64, seed=args.seed + 1)]
    max_tokens = sum(map(len, turns)) + args.turns * args.gen_tokens + 64
    results: dict[str, Any] = {}
    kiln_outputs = kiln_latencies = None
    for system in systems:
        reason = peers.missing_reason(system, args.peer_python)
        if reason:
            print(f"[{system}] skipped: {reason}", file=sys.stderr)
            results[system] = {"status": "skipped", "reason": reason}
            continue
        runner = make_runner(system, loaded, args, max_tokens, kiln_outputs)
        cpu_clock = getattr(runner, "cpu_seconds", time.process_time)  # llama.cpp computes in its worker
        cpu_start, wall_start = cpu_clock(), time.perf_counter()
        try:
            trace, outputs = run_system(runner, system, turns, warm_ids)
            notes = runner.notes()
        finally:
            runner.close()
        cpu_share = (cpu_clock() - cpu_start) / ((time.perf_counter() - wall_start) * common.THREADS)
        if system == "kiln":
            kiln_outputs = outputs
            kiln_latencies = trace.latency_s
        results[system] = {
            "status": "ok",
            "summary": summarize(trace, args.turns),
            **agreement(system, outputs, kiln_outputs),
            "cpu_share_of_threads": cpu_share,
            "notes": notes,
            "per_turn": vars(trace),
        }
        if system == "kiln-grpc" and kiln_latencies:
            results[system]["overhead_vs_in_process"] = wire_overhead(trace.latency_s, kiln_latencies, args.gen_tokens)
    report(args, machine, results)


def wire_overhead(wire: list[float | None], local: list[float | None], gen_tokens: int) -> dict[str, Any]:
    """Median over turns of (wire latency - in-process latency) per generated token: what gRPC
    streaming adds to each token, measured on the same turns of the same conversation."""
    pairs = zip(wire, local, strict=True)
    extra = [(w - here) / gen_tokens for w, here in pairs if w is not None and here is not None]
    return {"ms_per_token_median": 1000 * median(extra) if extra else None, "turns": len(extra)}


# The performance goal: a Kiln turn costs at most these multiples of llama.cpp's (window medians).
GOAL_OVER_LLAMACPP = {"early": 1.0, "late": 0.6}


def versus_llamacpp(results: dict[str, Any]) -> dict[str, Any]:
    """Each in-process Kiln system's early and late window medians over llama.cpp's, with the goal."""
    peer = results.get("llamacpp", {})
    if peer.get("status") != "ok":
        return {}
    out: dict[str, Any] = {}
    for name in ("kiln", "kiln-nospec"):
        if results.get(name, {}).get("status") != "ok":
            continue
        ratios = {
            window: common.ratio(results[name]["summary"][f"{window}_latency_s"]["median"], peer["summary"][f"{window}_latency_s"]["median"])
            for window in GOAL_OVER_LLAMACPP
        }
        out[name] = {
            **{f"{window}_over_llamacpp": r for window, r in ratios.items()},
            "goal": GOAL_OVER_LLAMACPP,
            "met": all(r is not None and r <= GOAL_OVER_LLAMACPP[w] for w, r in ratios.items()),
        }
    return out


def report(args: argparse.Namespace, machine: dict[str, Any], results: dict[str, Any]) -> None:
    kiln = results.get("kiln", {})
    kiln_ratio = kiln.get("summary", {}).get("late_over_early")
    payload = {
        "benchmark": "long_session",
        "machine": machine,
        "args": vars(args),
        "method": {
            "conversation": "deterministic agent/tool transcript tokenized once with Kiln's tokenizer; identical ids for every system",
            "latency": "perf_counter from handing over the turn's new ids to the last generated token; greedy; warm-up once per system",
            "history_tokens": "history length when the turn's generation starts (new ids included)",
            "prefill_tokens": "prompt tokens the system computed that turn (Kiln: session info; llama.cpp: tokens passed to eval; HF: whole history)",
            "weights": "Kiln and HF: fp32 dequantised from the GGUF; llama.cpp: the GGUF itself (Q4_K_M kernels)",
            "cpu_share_of_threads": "process CPU time / (wall time x threads) over a system's run; well below 1 means the CPU was shared or idle-waiting",
        },
        "target": {
            "kiln_late_over_early_max": TARGET_RATIO,
            "kiln_late_over_early": kiln_ratio,
            "met": None if kiln_ratio is None else kiln_ratio <= TARGET_RATIO,
        },
        "versus_llamacpp": versus_llamacpp(results),
        "systems": results,
    }
    path = common.write_results(args.name, payload)
    series = {
        name: ([h for h, s in zip(r["per_turn"]["history_tokens"], r["per_turn"]["latency_s"], strict=True) if s is not None],
               [s for s in r["per_turn"]["latency_s"] if s is not None])
        for name, r in results.items()
        if r["status"] == "ok"
    }
    png = common.plot_lines(
        args.name, series, "history length (tokens)", "turn latency (s, log scale)",
        f"Per-turn latency, {args.new_tokens} new + {args.gen_tokens} generated tokens per turn",
    )
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    for name, r in results.items():
        if r["status"] == "ok":
            s = r["summary"]
            print(f"{name}: early median {s['early_latency_s']['median']}, late median {s['late_latency_s']['median']}, ratio {s['late_over_early']}")
    for name, versus in payload["versus_llamacpp"].items():
        print(f"{name} over llamacpp: {versus}")


if __name__ == "__main__":
    main()
