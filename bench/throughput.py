"""Prefill and decode throughput: Kiln vs HF transformers vs llama.cpp, same model, same machine, one run.

- Prefill tokens/s at each `--lengths` value: one fresh prompt of that many ids computed to its first
  output token (Kiln and HF generate 1 token; llama.cpp evaluates the prompt), median of `--repeats`
  runs. Every run uses different seeded ids, so no system can serve it from a prefix cache.
- Decode tokens/s at each `--batches` value: `batch` prompts of `--prompt-len` ids generated together
  for `--decode-tokens` greedy tokens, minus the same with 1 token; decode tokens/s =
  batch x (decode_tokens - 1) / (median time(decode_tokens) - median time(1)). This isolates the decode
  steps in every system without reaching into its internals. llama.cpp runs batches through its own
  batched C API (llama-cpp-python's high-level API has no batched decode).
- llama.cpp runs in a process of its own (bench/llama_cpp_worker.py, under `--peer-python` or this Python)
  without the OpenMP wait policy `import kiln` sets for this one; its timings are taken here around each
  call, and its CPU seconds are the worker's.
- All systems are loaded together and every repeat of every measurement runs on each of them in turn
  with the same ids, so load from other processes falls on them alike.
- KV bytes per token: Kiln's from its engine; the peers' from their cache layout and dtype.

Targets: Kiln decode at batch 1 >= HF transformers; the ratio to llama.cpp (4-bit kernels) is reported
as measured.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any

import common
import peers
from llama_cpp_worker import LlamaProcess

_SEED_BASE = 1_000


class KilnSystem:
    """Kiln in process without speculation (decode speed as such); `options` pick a variant."""

    def __init__(self, loaded: Any, device: str, **options: Any) -> None:
        from kiln import LLM, SamplingParams

        self._params = SamplingParams
        self.llm = LLM(loaded=loaded, num_threads=common.THREADS, speculative=None, device=device, **options)

    def prefill(self, ids: list[int]) -> None:
        self.generate([ids], 1)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        params = self._params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return sum(len(out.token_ids) for out in self.llm.generate(prompts, params))

    def notes(self) -> dict[str, Any]:
        config = asdict(self.llm.config)
        config.pop("model")
        return {"kv_bytes_per_token": self.llm.engine.kv_bytes_per_token, "kv_bytes_how": "Engine.kv_bytes_per_token",
                "engine_config": config, "weight_bytes_per_token": common.weight_bytes_per_token(self.llm.engine.model)}

    def close(self) -> None:
        self.llm.close()


class HFSystem:
    def __init__(self, loaded: Any, device: str) -> None:
        self.model = peers.build_hf_model(loaded).to(device)

    def prefill(self, ids: list[int]) -> None:
        self.generate([ids], 1)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        tokens, _ = peers.hf_generate(self.model, prompts, max_tokens)
        return tokens.numel()

    def notes(self) -> dict[str, Any]:
        return {
            "kv_bytes_per_token": peers.hf_kv_bytes_per_token(self.model),
            "kv_bytes_how": "2 x layers x kv_heads x head_dim x 4 (DynamicCache in fp32), before sliding layers drop old positions",
            "attn_implementation": self.model.config._attn_implementation,
        }

    def close(self) -> None:
        del self.model


class LlamaCppSystem:
    """llama.cpp in its worker process: Llama.eval for prefill, its batched C API for decode."""

    def __init__(self, loaded: Any, max_batch: int, max_prompt: int, seq_len: int, python: str) -> None:
        self.config = loaded.config
        self.weight_bytes = peers.gguf_tensor_bytes(str(loaded.source))
        self.llama = LlamaProcess(python, common.peer_environment(), str(loaded.source), max_prompt + 8, max_batch, seq_len)

    def prefill(self, ids: list[int]) -> None:
        self.llama.prefill(ids)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        return sum(map(len, self.llama.generate(prompts, max_tokens)))

    def cpu_seconds(self) -> float:
        """The worker's CPU seconds: llama.cpp's threads run there, not in this process."""
        return self.llama.cpu_seconds()

    def notes(self) -> dict[str, Any]:
        return {
            "kv_bytes_per_token": self.llama.kv_bytes_per_token(self.config),
            "kv_bytes_how": "2 x layers x kv_heads x head_dim x bytes of the context's type_k/type_v (f16)",
            "weights": "Q4_K_M GGUF with llama.cpp's quantised kernels",
            "weight_bytes_per_token": self.weight_bytes,
            "weight_bytes_how": "every tensor byte of the GGUF: the output head is tied to the token embeddings, so a "
                                "decode step reads the whole table",
            "decode_api": "llama.cpp C API batched decode (one llama_decode per step for all sequences), greedy argmax",
            "prefill_api": "Llama.eval (n_batch 2048, n_ubatch 512)",
            "process": "bench/llama_cpp_worker.py, without Kiln's OpenMP wait policy",
        }

    def close(self) -> None:
        self.llama.close()


def make_system(name: str, loaded: Any, args: argparse.Namespace) -> Any:
    if name == "kiln":
        return KilnSystem(loaded, args.device)
    if name == "kiln-exact":
        return KilnSystem(loaded, args.device, quantization=None)
    if name == "kiln-deterministic":
        return KilnSystem(loaded, args.device, deterministic=True)
    if name == "kiln-int8":  # every layer re-quantised to int8: the default before the file's own blocks
        return KilnSystem(loaded, args.device, quantization="int8")
    if name == "hf":
        return HFSystem(loaded, args.device)
    return LlamaCppSystem(loaded, max(args.batches), max(args.lengths), args.prompt_len + args.decode_tokens + 8,
                          args.peer_python or sys.executable)


@dataclass
class Meter:
    """Wall and process-CPU seconds of one system's timed calls: CPU / (wall x threads) well below 1
    means the machine was shared while it ran. `cpu_clock`: the CPU seconds of the process the system
    computes in (this one's, or llama.cpp's worker's)."""

    cpu_clock: Callable[[], float] = time.process_time
    wall_s: float = 0.0
    cpu_s: float = 0.0

    def time(self, fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
        cpu = self.cpu_clock()
        seconds, result = common.timed(fn, *args)
        self.cpu_s += self.cpu_clock() - cpu
        self.wall_s += seconds
        return seconds, result

    @property
    def cpu_share(self) -> float | None:
        return common.ratio(self.cpu_s, self.wall_s * common.THREADS)


def measure_prefill(systems: dict[str, Any], meters: dict[str, Meter], length: int, repeats: int, bos: int) -> dict[str, Any]:
    """Each repeat gives every system the same fresh ids, systems interleaved so that a burst of load
    from elsewhere hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    for rep in range(repeats):
        ids = [bos, *common.random_ids(length - 1, seed=_SEED_BASE + 100 * length + rep)]
        for name, system in systems.items():
            times[name].append(meters[name].time(system.prefill, ids)[0])
    return {name: {"tokens": length, "seconds": t, "tokens_per_s": length / median(t)} for name, t in times.items()}


def measure_decode(systems: dict[str, Any], meters: dict[str, Meter], batch: int, args: argparse.Namespace, bos: int) -> dict[str, Any]:
    """Time `decode_tokens` and 1-token generations of fresh prompt batches, interleaved like prefill;
    decode rate from the difference of the medians (see module doc)."""
    runs: dict[str, dict[int, list[tuple[float, int]]]] = {name: {1: [], args.decode_tokens: []} for name in systems}
    for rep in range(args.repeats):
        for max_tokens in (1, args.decode_tokens):
            seed = _SEED_BASE * 7 + 1000 * batch + 10 * rep + max_tokens
            prompts = [[bos, *common.random_ids(args.prompt_len - 1, seed=seed * 64 + i)] for i in range(batch)]
            for name, system in systems.items():
                runs[name][max_tokens].append(meters[name].time(system.generate, prompts, max_tokens))
    return {name: _decode_rate(batch, r[args.decode_tokens], r[1]) for name, r in runs.items()}


def _decode_rate(batch: int, full: list[tuple[float, int]], one: list[tuple[float, int]]) -> dict[str, Any]:
    seconds = median(s for s, _ in full) - median(s for s, _ in one)
    tokens = full[0][1] - one[0][1]
    result: dict[str, Any] = {
        "batch": batch,
        "seconds_full": [s for s, _ in full],
        "seconds_one_token": [s for s, _ in one],
        "tokens_generated_full": full[0][1],
        "end_to_end_tokens_per_s": full[0][1] / median(s for s, _ in full),
    }
    if seconds <= 0:
        return result | {"tokens_per_s": None, "reason": "decode time not resolvable from the noise (difference <= 0)"}
    return result | {"tokens_per_s": tokens / seconds}


def run_all(names: list[str], loaded: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Build every system, warm each up once, then take each measurement on all of them in turn."""
    bos = loaded.config.bos_token_id
    systems = {name: make_system(name, loaded, args) for name in names}
    meters = {name: Meter(getattr(system, "cpu_seconds", time.process_time)) for name, system in systems.items()}
    try:
        for system in systems.values():
            system.prefill([bos, *common.random_ids(127, seed=_SEED_BASE - 1)])
            system.generate([[bos, *common.random_ids(31, seed=_SEED_BASE - 2)]], 4)
        prefill, decode = {}, {}
        for length in args.lengths:
            prefill[length] = measure_prefill(systems, meters, length, args.repeats, bos)
            _log(f"prefill {length}", prefill[length])
        for batch in args.batches:
            decode[batch] = measure_decode(systems, meters, batch, args, bos)
            _log(f"decode batch {batch}", decode[batch])
        notes = {name: system.notes() for name, system in systems.items()}
    finally:
        for system in systems.values():
            system.close()
        gc.collect()
    return {
        name: {
            "status": "ok",
            "prefill": {str(n): prefill[n][name] for n in args.lengths},
            "decode": {str(b): decode[b][name] for b in args.batches},
            "cpu_share_of_threads": meters[name].cpu_share,
            "notes": notes[name],
        }
        for name in names
    }


def _log(what: str, by_system: dict[str, Any]) -> None:
    rates = ", ".join(f"{name} {r['tokens_per_s'] and round(r['tokens_per_s'], 1)}" for name, r in by_system.items())
    print(f"{what}: tokens/s {rates}", file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=common.ints, default=[512, 2048, 8192], help="prefill lengths, e.g. 512,2048")
    parser.add_argument("--batches", type=common.ints, default=[1, 4, 16], help="decode batch sizes, e.g. 1,4")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt ids per sequence for decode")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per sequence for decode")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    parser.add_argument("--device", default="cpu", help="torch device of Kiln and HF (llama.cpp runs on the CPU)")
    parser.add_argument("--random-weights", metavar="ENTRY",
                        help="random weights shaped as this converted-weight cache entry describes, instead of the "
                             "embedded model (for machines the model file cannot reach; speed does not depend on values)")
    parser.add_argument("--peers", default="kiln,kiln-exact,kiln-deterministic,hf,llamacpp",
                        help="comma-separated subset of kiln,kiln-exact,kiln-deterministic,kiln-int8,hf,llamacpp")
    parser.add_argument("--peer-python", help="a Python with llama-cpp-python, when this one has none")
    args = common.parse_run_args(parser, "throughput", "lengths 128,256, batches 1,4, 16 tokens, 2 repeats", _quick)
    if args.decode_tokens < 2:
        parser.error("--decode-tokens must be at least 2")
    return args


def _quick(args: argparse.Namespace) -> None:
    args.lengths, args.batches, args.prompt_len, args.decode_tokens, args.repeats = [128, 256], [1, 4], 32, 16, 2


def main() -> None:
    args = parse_args()
    systems, machine, loaded = common.start(args.peers, args.random_weights)
    results: dict[str, Any] = {}
    for name in systems:
        reason = peers.missing_reason(name, args.peer_python)
        if reason:
            print(f"[{name}] skipped: {reason}", file=sys.stderr)
            results[name] = {"status": "skipped", "reason": reason}
    results |= run_all([name for name in systems if name not in results], loaded, args)
    report(args, machine, {name: results[name] for name in systems})


def _prefill_tps(results: dict[str, Any], system: str, length: int) -> float | None:
    return results.get(system, {}).get("prefill", {}).get(str(length), {}).get("tokens_per_s")


def _decode_tps(results: dict[str, Any], system: str, batch: int) -> float | None:
    return results.get(system, {}).get("decode", {}).get(str(batch), {}).get("tokens_per_s")


def bandwidth_use(results: dict[str, Any], bandwidth: float) -> dict[str, Any]:
    """Per system: weight bytes read per decoded token, and batch-1 decode as a fraction of the fastest
    the measured read bandwidth allows for those bytes."""
    out = {}
    for name, r in results.items():
        size = r.get("notes", {}).get("weight_bytes_per_token")
        tps = _decode_tps(results, name, 1)
        if size and tps:
            out[name] = {"weight_bytes_per_token": size, "bandwidth_limit_tokens_per_s": bandwidth * 1e9 / size,
                         "fraction_of_limit": tps * size / (bandwidth * 1e9)}
    return out


def report(args: argparse.Namespace, machine: dict[str, Any], results: dict[str, Any]) -> None:
    kiln_b1 = _decode_tps(results, "kiln", 1)
    vs_hf = common.ratio(kiln_b1, _decode_tps(results, "hf", 1))
    bandwidth = common.read_bandwidth_gb_s() if args.device == "cpu" else None  # CPU memory: a GPU's is another story
    payload = {
        "benchmark": "throughput",
        "machine": machine,
        "args": vars(args),
        "method": {
            "prefill": "tokens / median wall seconds to compute a fresh prompt to its first output token",
            "decode": "batch x (decode_tokens - 1) / (median time(decode_tokens) - median time(1 token)); fresh seeded prompts every run",
            "weights": "Kiln and HF: fp32 dequantised from the GGUF; llama.cpp: the Q4_K_M GGUF itself",
            "threads": common.THREADS,
        },
        "targets": {
            "kiln_over_hf_decode_batch1": vs_hf,
            "kiln_over_hf_decode_batch1_min": 1.0,
            "met": None if vs_hf is None else vs_hf >= 1.0,
            "kiln_over_llamacpp_decode_batch1": common.ratio(kiln_b1, _decode_tps(results, "llamacpp", 1)),
            "kiln_over_llamacpp_decode_batch1_min": 1.0,
            "deterministic_cost_decode_batch1": common.ratio(_decode_tps(results, "kiln-deterministic", 1), kiln_b1),
            "deterministic_cost_prefill": {str(n): common.ratio(_prefill_tps(results, "kiln-deterministic", n), _prefill_tps(results, "kiln", n))
                                           for n in args.lengths},
        },
        "read_bandwidth_gb_s": bandwidth,
        "bandwidth_use": bandwidth_use(results, bandwidth) if bandwidth else None,
        "systems": results,
    }
    path = common.write_results(args.name, payload)
    ran = {name: r for name, r in results.items() if r["status"] == "ok"}
    panels = [
        ("prefill tokens/s", [f"{n} tok" for n in args.lengths],
         {name: [r["prefill"][str(n)]["tokens_per_s"] for n in args.lengths] for name, r in ran.items()}),
        ("decode tokens/s", [f"batch {b}" for b in args.batches],
         {name: [r["decode"][str(b)]["tokens_per_s"] for b in args.batches] for name, r in ran.items()}),
    ]
    png = common.plot_bars(args.name, panels, "Gemma 3 270M on this CPU, 2 threads")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    for name, r in ran.items():
        print(name, {n: round(v["tokens_per_s"], 1) for n, v in r["prefill"].items()},
              {b: v["tokens_per_s"] and round(v["tokens_per_s"], 1) for b, v in r["decode"].items()})
    print("targets:", payload["targets"])


if __name__ == "__main__":
    main()
