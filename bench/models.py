"""Models people run: Kiln's weight paths against llama.cpp on the same GGUF files, and what loading a
1.7B-shaped file costs.

- quality, for each embedded model (Gemma 3 270M Q4_K_M, SmolLM2-135M-Instruct Q4_1): perplexity
  teacher-forced over the first `--ppl-tokens` tokens of bench/data/perplexity.txt (the Apache License 2.0,
  then CPython's textwrap.py), for Kiln's default weights (EngineConfig's defaults: the file's blocks as
  stored, kiln/models/gguf_blocks.py, float16 KV pages), Kiln int8 (`quantization="int8"`: projections and
  head re-quantised from the file's dequantised weights, the default before), Kiln exact
  (`quantization=None`: the file's weights dequantised to float32) and llama.cpp on the same file (its own kernels, f16 KV
  cache, bench/llama_cpp_peer.py); every system gets the same token ids (Kiln's tokenizer) in
  `--chunk`-token steps. Greedy agreement: each prompt of PROMPTS (text, code, a story) continued by
  `--greedy-tokens` greedy tokens; the fraction of positions where a Kiln path's token equals llama.cpp's,
  and the tokens before the first difference.
- loading, on a 1.7B-shaped Q4_K_M file (SmolLM2-1.7B's shape and vocabulary, random weights: a float16
  GGUF written here with gguf-py, quantised by llama.cpp's own llama_model_quantize, kept in `--big-dir`):
  a fresh process builds a default engine (kiln.LLM) on it and generates 4 tokens, first with an empty
  weight cache (describing the file into the cache; the default converts no weight of such a file) and then
  again (reading the cache): seconds to a ready engine, peak RSS (the process's VmHWM), RSS after the 4
  tokens, and the cache's size on disk.

llama.cpp runs in this process when llama_cpp is importable, else under `--peer-python` (a venv with
llama-cpp-python built for the host). Writes bench/results/models.json and .png. `--quick`: 512
perplexity tokens, 16 greedy tokens, no 1.7B file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import common
import gguf
import llama_cpp_peer
import numpy as np
from weight_formats import perplexity

from kiln import LLM
from kiln.models.embedded import EMBEDDED_MODELS, embedded_model_path
from kiln.models.loader import load_model

ROOT = Path(__file__).resolve().parent.parent
PPL_TEXT = "bench/data/perplexity.txt"
PATHS = {"default": {}, "int8": {"quantization": "int8"}, "exact": {"quantization": None}}  # EngineConfig options
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import json\n\ndef load_config(path):\n",
    "Once upon a time, in a small village by the sea, there lived",
]
BIG_SOURCE_MODEL = "smollm2-135m-instruct"  # whose vocabulary the big files take


@dataclass(frozen=True)
class Shape:
    """A llama-architecture model's shape, for a file of random weights. `vocab`: embedding (and output) rows;
    past the source vocabulary's 49,152 tokens the vocabulary is padded with unused placeholder tokens."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    context: int
    vocab: int
    tied: bool
    rope_theta: float

    @property
    def file(self) -> str:
        return f"{self.name.lower()}-shape-random-q4_k_m.gguf"


# SmolLM2-1.7B's shape; its vocabulary is SmolLM2-135M-Instruct's (the same 49,152 tokens).
BIG_SHAPE = Shape("SmolLM2-1.7B", hidden=2048, layers=24, heads=32, kv_heads=32, ffn=8192, context=8192, vocab=49_152,
                  tied=True, rope_theta=130000.0)


def peer(request: dict[str, Any], peer_python: str | None) -> dict[str, Any]:
    """bench/llama_cpp_peer.py's answer: in process when llama_cpp is importable here, else under `peer_python`."""
    if importlib.util.find_spec("llama_cpp") is not None:
        return llama_cpp_peer.answer(dict(request))
    if peer_python is None:
        raise SystemExit("llama_cpp is not importable here: pass --peer-python (a Python with llama-cpp-python)")
    done = subprocess.run([peer_python, str(Path(llama_cpp_peer.__file__))], input=json.dumps(request), env=common.peer_environment(),
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def quality(name: str, args: argparse.Namespace) -> dict[str, Any]:
    loaded = load_model(name)
    ppl_tokens = loaded.tokenizer.encode((ROOT / PPL_TEXT).read_text())[: args.ppl_tokens]
    prompts = [loaded.tokenizer.encode(prompt) for prompt in PROMPTS]
    reference = peer({"op": "score", "model": str(loaded.source), "ppl_tokens": ppl_tokens, "chunk": args.chunk,
                      "prompts": prompts, "max_tokens": args.greedy_tokens}, args.peer_python)
    results: dict[str, Any] = {"file": loaded.source.name, "ppl_tokens": len(ppl_tokens),
                               "llama.cpp": {"perplexity": reference["perplexity"]}}
    for label, options in PATHS.items():
        llm = LLM(loaded=loaded, **options, speculative=None, kv_budget_bytes=256 * 2**20, num_threads=common.THREADS)
        outputs = [o.token_ids for o in llm.generate(prompts, max_tokens=args.greedy_tokens, temperature=0.0, ignore_eos=True)]
        llm.close()
        results[label] = {"perplexity": perplexity(loaded, options, ppl_tokens, args.chunk),
                          **agreement(outputs, reference["greedy"])}
        print(name, label, results[label], flush=True)
    exact = results["exact"]["perplexity"]
    for label in ("default", "int8", "llama.cpp"):
        results[label]["perplexity_vs_exact"] = results[label]["perplexity"] / exact - 1
    return results


def agreement(ours: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """Greedy agreement with llama.cpp: the share of positions holding the same token, over all prompts,
    and per prompt the tokens before the first difference."""
    same = sum(a == b for out, ref in zip(ours, reference, strict=True) for a, b in zip(out, ref, strict=True))
    first = [next((i for i, (a, b) in enumerate(zip(out, ref, strict=True)) if a != b), len(ref))
             for out, ref in zip(ours, reference, strict=True)]
    return {"greedy_agreement": same / sum(map(len, reference)), "tokens_before_first_difference": first}


def write_random_f16(path: Path, vocabulary: Path, shape: Shape) -> None:
    """A llama GGUF of `shape` with seeded random float16 weights (written tensor by tensor) and the tokenizer of
    the GGUF file `vocabulary` (padded to shape.vocab tokens), as SmolLM2's converter writes them."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"{shape.name}-shaped random weights")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, field in gguf.GGUFReader(vocabulary).fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            writer.add_key_value(key, _padded(key, field.contents(), shape.vocab), kind,
                                 sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    hidden, ffn = shape.hidden, shape.ffn
    kv = shape.kv_heads * hidden // shape.heads
    tensors = {"token_embd.weight": (shape.vocab, hidden), "output_norm.weight": (hidden,)}
    if not shape.tied:
        tensors["output.weight"] = (shape.vocab, hidden)
    for layer in range(shape.layers):
        tensors |= {f"blk.{layer}.{name}.weight": dims for name, dims in {
            "attn_norm": (hidden,), "attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
            "attn_output": (hidden, hidden), "ffn_norm": (hidden,), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
            "ffn_down": (hidden, ffn)}.items()}
    dtypes = {name: np.float32 if len(dims) == 1 else np.float16 for name, dims in tensors.items()}  # norms stay F32
    for name, dims in tensors.items():
        writer.add_tensor_info(name, dims, np.dtype(dtypes[name]), int(np.prod(dims)) * np.dtype(dtypes[name]).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    generator = np.random.default_rng(0)
    for name, dims in tensors.items():
        values = np.ones(dims, np.float32) if len(dims) == 1 else generator.standard_normal(dims, np.float32) * 0.02
        writer.write_tensor_data(values.astype(dtypes[name]))
    writer.close()


# Placeholders that pad a vocabulary's per-token arrays: unused tokens, as a vocabulary's spare rows are.
_PADDING = {"tokenizer.ggml.tokens": lambda i: f"<|pad_{i}|>",
            "tokenizer.ggml.token_type": lambda i: int(gguf.TokenType.UNUSED),
            "tokenizer.ggml.scores": lambda i: 0.0}


def _padded(key: str, value: Any, rows: int) -> Any:
    """A per-token tokenizer array padded with placeholders to `rows` entries; any other value as it is."""
    if key not in _PADDING:
        return value
    if len(value) > rows:
        raise ValueError(f"{key} has {len(value)} entries, more than the shape's {rows} rows")
    return value + [_PADDING[key](i) for i in range(len(value), rows)]


def big_file(args: argparse.Namespace, shape: Shape = BIG_SHAPE) -> Path:
    """`shape`'s Q4_K_M file, made once into `--big-dir` (its float16 source is deleted after)."""
    target = Path(args.big_dir) / shape.file
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        source = target.with_suffix(".f16.gguf")
        write_random_f16(source, embedded_model_path(BIG_SOURCE_MODEL), shape)
        partial = target.with_suffix(".partial")
        peer({"op": "quantize", "source": str(source), "target": str(partial), "ftype": "Q4_K_M"}, args.peer_python)
        partial.rename(target)
        source.unlink()
    return target


def loading(args: argparse.Namespace) -> dict[str, Any]:
    """First and cached loads of the big file, each in a fresh process with its own empty cache at first."""
    path = big_file(args)
    results: dict[str, Any] = {"file": path.name, "file_bytes": path.stat().st_size, "shape": asdict(BIG_SHAPE)}
    with tempfile.TemporaryDirectory(dir=args.big_dir) as cache:
        for phase in ("first", "cached"):
            command = [sys.executable, __file__, "--load-child", str(path)]
            out = subprocess.run(command, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent, check=True,
                                 env={**os.environ, "KILN_CACHE_DIR": cache}).stdout
            report = json.loads(out.strip().splitlines()[-1])
            results[phase] = {**report, "peak_rss_over_file": report["peak_rss_bytes"] / results["file_bytes"],
                              "cache_bytes": sum(f.stat().st_size for f in Path(cache).rglob("*") if f.is_file())}
            print(phase, results[phase], flush=True)
    return results


def load_child(path: str) -> None:
    """In the child: a default engine on `path`, 4 greedy tokens, then seconds and RSS (llama_cpp_peer.memory)
    as one JSON line."""
    common.set_threads()
    start = time.perf_counter()
    llm = LLM(model=path, kv_budget_bytes=64 * 2**20, num_threads=common.THREADS)
    ready = time.perf_counter() - start
    llm.generate("The capital of France is", max_tokens=4, temperature=0.0)
    memory = llama_cpp_peer.memory()
    print(json.dumps({"seconds_to_ready": ready, "rss_after_bytes": memory["VmRSS"], "peak_rss_bytes": memory["VmHWM"]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(EMBEDDED_MODELS))
    parser.add_argument("--ppl-tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--peer-python", help="a Python with llama-cpp-python, when this one has none")
    parser.add_argument("--big-dir", default=str(Path(tempfile.gettempdir()) / "kiln-bench-models"),
                        help="where the 1.7B-shaped file (1 GB) and its cache go; never inside the repository")
    parser.add_argument("--no-big", action="store_true", help="skip the 1.7B-shaped file")
    parser.add_argument("--load-child", help=argparse.SUPPRESS)
    args = common.parse_run_args(parser, "models", "512 perplexity tokens, 16 greedy tokens, no 1.7B file", _quick)
    if args.load_child:
        load_child(args.load_child)
        return
    common.set_threads()
    common.warn_if_busy()
    machine = common.machine_info()
    payload = {
        "method": __doc__,
        "settings": {**vars(args), "ppl_text": PPL_TEXT, "prompts": PROMPTS},
        "machine": machine,
        "llama_cpp": peer({"op": "build"}, args.peer_python),
        "quality": {name: quality(name, args) for name in args.models.split(",")},
        "loading": None if args.no_big else loading(args),
    }
    print("wrote", common.write_results(args.name, payload))
    plot(args.name, payload)


def _quick(args: argparse.Namespace) -> None:
    args.ppl_tokens, args.greedy_tokens, args.no_big = 512, 16, True


def plot(name: str, payload: dict[str, Any]) -> None:
    models = list(payload["quality"])
    systems = ("exact", "default", "int8", "llama.cpp")
    panels = [
        ("perplexity (bench/data/perplexity.txt)", models,
         {s: [payload["quality"][m][s]["perplexity"] for m in models] for s in systems}),
        ("greedy agreement with llama.cpp", models,
         {s: [payload["quality"][m][s]["greedy_agreement"] for m in models] for s in ("exact", "default", "int8")}),
    ]
    loading_result = payload["loading"]
    if loading_result:
        panels.append(("1.7B-shaped Q4_K_M: GB (file, peak RSS, cache)", ["first load", "cached load"],
                       {"file": [loading_result["file_bytes"] / 1e9] * 2,
                        "peak RSS": [loading_result[p]["peak_rss_bytes"] / 1e9 for p in ("first", "cached")],
                        "cache": [loading_result[p]["cache_bytes"] / 1e9 for p in ("first", "cached")]}))
    path = common.plot_bars(name, panels, "Kiln's weight paths against llama.cpp on the same GGUF files")
    if path:
        print("wrote", path)


if __name__ == "__main__":
    main()
