"""Bigger models: Kiln against llama.cpp on 1.7B- and 8B-shaped Q4_K_M GGUF files, where decode is bound by
reading the weights from memory.

The embedded models are small enough that per-step overhead dominates; a user's model is usually bigger. Two
llama-architecture files with seeded random weights (compute does not depend on the values), written as float16
GGUFs with gguf-py and quantised to Q4_K_M by llama.cpp's own llama_model_quantize (bench/models.py `big_file`),
kept in `--big-dir`:

- "1.7b": SmolLM2-1.7B's shape (hidden 2048, 24 layers, 32 heads, ffn 8192), its 49,152-token vocabulary, tied
  embeddings (bench/models.py BIG_SHAPE);
- "8b": Llama-3.1-8B's shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, ffn 14336, untied output, rope theta
  500000, context 8192; no llama3 rope scaling, which only matters past 8192), SmolLM2's vocabulary padded with
  unused placeholder tokens to Llama 3's 128,256 rows, so the embedding and output matrices have their real size.

Each system runs each file in a fresh process of its own (its memory is its own), with two threads, on the same
token ids (seeded, from SmolLM2's vocabulary):

- kiln: `kiln.LLM(model=path)` with the default options (`engine` in the JSON: what quantization and KV dtype
  "auto" chose) and speculative=None, after a first process has described the file into the weight cache
  (`--big-dir`/kiln-cache; `kiln_load` records that process);
- llamacpp: llama-cpp-python's `Llama.eval` on the file itself (Q4_K_M kernels, f16 KV cache,
  bench/llama_cpp_peer.py "speed"), in `--peer-python` or this Python.

Measured per system: batch-1 greedy decode tokens/s after the first token (`--decode-tokens` after a
`--prompt-tokens` prompt; one untimed warm-up, then `--repeats` runs), prefill tokens/s of a fresh prompt of
each `--prefill-lengths` to its first token (a new prompt every run, so no prefix cache serves it; one untimed
warm-up), the process's memory after (VmRSS) and its peak (VmHWM). Weight bytes per decoded token: for Kiln the
projections and LM head one step reads (common.weight_bytes_per_token), for llama.cpp every tensor of the file
but the token embeddings, which it looks one row up in (unless tied: then they are the output matrix). With the
machine's read bandwidth (common.read_bandwidth_gb_s, two threads) that gives each decode's fraction of what
memory allows: bytes per token x tokens/s / bandwidth. Ratios are Kiln over llama.cpp, of medians.

`--shapes gemma3-270m,smollm2-135m-instruct` runs the same on the embedded models' own files (their real
weights). Writes bench/results/gguf_sizes.json and .png. `--quick`: the 1.7B file only, 32 decode tokens, 2 decode runs,
1 prefill run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import common
import gguf
import llama_cpp_peer
import models
import numpy as np

SHAPES: dict[str, models.Shape | None] = {  # None: an embedded model's own file (not in the default run)
    "gemma3-270m": None,
    "smollm2-135m-instruct": None,
    "1.7b": models.BIG_SHAPE,
    "8b": models.Shape("Llama-3.1-8B", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, context=8192,
                       vocab=128_256, tied=False, rope_theta=500000.0),
}
SYSTEMS = ("kiln", "llamacpp")
# Prompt ids: ordinary pieces of SmolLM2's vocabulary, clear of its control tokens at the bottom (the 8B file's
# rows above 49,152 are placeholders).
PROMPT_ID_RANGE = (1000, 49_152)


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(*PROMPT_ID_RANGE, length).tolist()


def request(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The "speed" request both systems answer (llama_cpp_peer.speed, kiln_speed): the same ids for each."""
    return {"op": "speed", "model": str(path), "decode_prompt": prompt(args.prompt_tokens, 0),
            "decode_tokens": args.decode_tokens, "decode_repeats": args.repeats,
            "prefill_prompts": {str(n): [prompt(n, 1000 * n + run) for run in range(args.prefill_repeats + 1)]
                                for n in args.prefill_lengths}}


def child(command: list[str], question: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """A fresh process's answer to `question` (JSON on stdin; the last line of its stdout)."""
    done = subprocess.run(command, input=json.dumps(question), stdout=subprocess.PIPE, text=True, check=True,
                          cwd=common.BENCH_DIR, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def kiln_child(question: dict[str, Any]) -> dict[str, Any]:
    """In the child: a default engine on the file; "load" stops once it is ready, "speed" measures it."""
    from kiln import LLM

    common.set_threads()
    start = time.perf_counter()
    llm = LLM(model=question["model"], num_threads=common.THREADS, speculative=None)
    ready = time.perf_counter() - start
    answer = {"seconds_to_ready": ready}
    if question["op"] == "speed":
        answer |= kiln_speed(llm, **{k: v for k, v in question.items() if k not in ("op", "model")})
    answer["memory"] = llama_cpp_peer.memory()
    llm.close()
    return answer


def kiln_speed(llm: Any, decode_prompt: list[int], decode_tokens: int, decode_repeats: int,
               prefill_prompts: dict[str, list[list[int]]]) -> dict[str, Any]:
    def generate(ids: list[int], max_tokens: int) -> Any:  # kiln.results.GenerationResult
        session = llm.create_session(ids)
        result = session.generate(max_tokens=max_tokens, temperature=0.0, ignore_eos=True).result()
        session.close()
        return result

    def decode_rate() -> float:
        result = generate(decode_prompt, decode_tokens)
        return (len(result.token_ids) - 1) / (result.total_s - result.time_to_first_token_s)

    decode = [decode_rate() for _ in range(decode_repeats + 1)][1:]
    prefill = {length: [len(p) / generate(p, 1).time_to_first_token_s for p in prompts][1:]
               for length, prompts in prefill_prompts.items()}
    engine = {key: getattr(llm.config, key) for key in ("quantization", "kv_dtype", "prefill_chunk_tokens", "kv_budget_bytes")}
    return {"decode_tokens_per_s": decode, "prefill_tokens_per_s": prefill, "engine": engine,
            "weight_bytes_per_token": common.weight_bytes_per_token(llm.engine.model)}


def llama_cpp_bytes_per_token(path: Path) -> int:
    tensors = gguf.GGUFReader(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")


def measure(name: str, args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    shape = SHAPES[name]
    path = models.embedded_model_path(name) if shape is None else models.big_file(args, shape)
    question = request(path, args)
    kiln = [sys.executable, __file__, "--kiln-child"]
    env = {**os.environ, "KILN_CACHE_DIR": str(Path(args.big_dir) / "kiln-cache")}
    result: dict[str, Any] = {"shape": asdict(shape) if shape else {"embedded": name}, "file": path.name, "file_bytes": path.stat().st_size,
                              "kiln_load": child(kiln, {"op": "load", "model": str(path)}, env)}
    answers = {"kiln": child(kiln, question, env),
               "llamacpp": child([args.peer_python or sys.executable, llama_cpp_peer.__file__], question,
                                 common.peer_environment())}
    answers["llamacpp"]["weight_bytes_per_token"] = llama_cpp_bytes_per_token(path)
    for system, answer in answers.items():
        decode = common.summarize(answer["decode_tokens_per_s"])
        result[system] = {**answer, "decode_tokens_per_s": decode,
                          "prefill_tokens_per_s": {n: common.summarize(v) for n, v in answer["prefill_tokens_per_s"].items()},
                          "fraction_of_bandwidth": answer["weight_bytes_per_token"] * decode["median"] / (bandwidth * 1e9)}
        print(name, system, json.dumps(result[system]), flush=True)
    kiln, peer = result["kiln"], result["llamacpp"]
    result["kiln_over_llamacpp"] = {
        "decode": common.ratio(kiln["decode_tokens_per_s"]["median"], peer["decode_tokens_per_s"]["median"]),
        "prefill": {n: common.ratio(kiln["prefill_tokens_per_s"][n]["median"], peer["prefill_tokens_per_s"][n]["median"])
                    for n in kiln["prefill_tokens_per_s"]},
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="1.7b,8b", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed decode runs")
    parser.add_argument("--prefill-lengths", type=common.ints, default=[512, 2048])
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--peer-python", help="a Python with llama-cpp-python, when this one has none")
    parser.add_argument("--big-dir", default=str(Path(tempfile.gettempdir()) / "kiln-bench-models"),
                        help="where the files (1 GB and 5 GB), their float16 sources while made (3.4 and 16 GB) and "
                             "Kiln's converted-weight cache go; never inside the repository")
    parser.add_argument("--kiln-child", action="store_true", help=argparse.SUPPRESS)
    args = common.parse_run_args(parser, "gguf_sizes", "the 1.7B file only, 32 decode tokens, 2 decode runs, 1 prefill run",
                                 _quick)
    if args.kiln_child:
        print(json.dumps(kiln_child(json.load(sys.stdin))))
        return
    common.set_threads()
    common.warn_if_busy()
    payload: dict[str, Any] = {"method": __doc__, "settings": vars(args), "machine": common.machine_info(),
                               "llama_cpp": models.peer({"op": "build"}, args.peer_python)}
    bandwidth = payload["read_bandwidth_gb_s"] = common.read_bandwidth_gb_s(repeats=9)
    print(f"read bandwidth {bandwidth:.1f} GB/s", flush=True)
    payload["shapes"] = {name: measure(name, args, bandwidth) for name in args.shapes.split(",")}
    print("wrote", common.write_results(args.name, payload))
    plot(args.name, payload)


def _quick(args: argparse.Namespace) -> None:
    args.shapes, args.decode_tokens, args.repeats, args.prefill_repeats = "1.7b", 32, 2, 1


def plot(name: str, payload: dict[str, Any]) -> None:
    shapes = payload["shapes"]
    labels = {"kiln": "Kiln (default engine)", "llamacpp": "llama.cpp (its own kernels)"}
    prefill = [(s, n) for s in shapes for n in shapes[s]["kiln"]["prefill_tokens_per_s"]]
    panels = [
        ("decode tokens/s (batch 1)", list(shapes),
         {labels[k]: [shapes[s][k]["decode_tokens_per_s"]["median"] for s in shapes] for k in SYSTEMS}),
        ("prefill tokens/s", [f"{s}, {n} tokens" for s, n in prefill],
         {labels[k]: [shapes[s][k]["prefill_tokens_per_s"][n]["median"] for s, n in prefill] for k in SYSTEMS}),
        ("peak RSS (GB)", list(shapes), {labels[k]: [shapes[s][k]["memory"]["VmHWM"] / 1e9 for s in shapes] for k in SYSTEMS}),
        (f"decode's fraction of {payload['read_bandwidth_gb_s']:.1f} GB/s", list(shapes),
         {labels[k]: [shapes[s][k]["fraction_of_bandwidth"] for s in shapes] for k in SYSTEMS}),
    ]
    files = ", ".join(f"{s}: {shapes[s]['file']}" for s in shapes)
    path = common.plot_bars(name, panels, f"Kiln against llama.cpp on the same GGUF files, 2 threads ({files})")
    if path:
        print("wrote", path)


if __name__ == "__main__":
    main()
