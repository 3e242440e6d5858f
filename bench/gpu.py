"""Kiln on a GPU against HF transformers and a plain PyTorch CUDA-graph decoder (issue 36 § 6), one command that
runs on a bare GPU machine in a few minutes (bench/README.md § gpu.py):

1. The CUDA tests: tests/models/test_parity.py under KILN_TEST_DEVICE=cuda, tests/kernels/test_triton_attention.py
   where it exists, and `pytest -m cuda tests` where pyproject.toml registers a `cuda` marker.
2. Per model shape (the embedded Gemma 3 270M's, a Llama-3.2-1B-like one), random weights (the model files do
   not reach a GPU machine; speed does not depend on the values) written once as an HF directory (config.json,
   model.safetensors, a byte-level tokenizer.json) that Kiln and transformers both load; the CUDA-graph decoder
   (bench/cuda_graph_decoder.py) takes the same tensors. Every system computes in bfloat16 (float32 on a CPU).
3. Each system in turn, alone on the device, warmed up: prefill tokens/s (`--lengths`: one fresh prompt to its
   first token), decode tokens/s at `--batches` after a `--prompt-len` prompt, and decode at batch 1 after a
   `--long-context` prompt. Decode tokens/s = batch x (decode_tokens - 1) / (median t(decode_tokens) - median
   t(1 token)), fresh seeded prompts every run (bench/throughput.py's method: prefill cancels out, and Kiln's
   prefix cache never hits). Batch 1's weight bandwidth = bytes of the projections and LM head one decode step
   reads x steps per second.

Kiln runs as EngineConfig(device, dtype "auto", decode_graphs None, quantization None, speculative None): on a GPU
bfloat16 with its decode steps captured as CUDA graphs where the engine does so. Writes <out>/<name>.json (every
measurement, the tests' outcome, GPU, torch and Kiln's commit) and <out>/<name>_<shape>.png.
`--device cpu --quick` runs the same plumbing on tiny shapes (the graph decoder eager) and checks the decoder's
math against transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from statistics import median
from typing import Any

import common
import peers
import torch
from cuda_graph_decoder import Cache, Decoder, Shape

from kiln.models.config import ModelConfig
from kiln.models.hf_config import hf_config_dict

REPO = common.BENCH_DIR.parent
PARITY_TESTS = "tests/models/test_parity.py"
OPTIONAL_TESTS = ("tests/kernels/test_triton_attention.py",)
CUDA_MARK = "@pytest.mark.cuda"  # the files holding such tests run under `-m cuda` (not the whole tree: some of
                                 # its files import packages the GPU machine lacks)
COMMIT_FILE = REPO / ".whl" / "kiln_commit.txt"  # written by bench/gpu_wheels.sh where the checkout has no .git
_SLIDING, _FULL = "sliding_attention", "full_attention"
# The embedded model's config as its GGUF's metadata gives it (kiln.models.loader.load_model().config), written
# out so the benchmark needs neither the model's package nor the file.
GEMMA3_270M = ModelConfig(
    "gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18, num_heads=4, num_kv_heads=1,
    head_dim=256, rms_norm_eps=1e-6, rope_theta=1e6, rope_local_theta=1e4, max_position_embeddings=32768,
    sliding_window=512, layer_types=((_SLIDING,) * 5 + (_FULL,)) * 3, qk_norm=True, tie_word_embeddings=True,
    hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=256.0, bos_token_id=2, eos_token_ids=(1, 106),
    name="gemma3-270m")
# Llama 3.2 1B's shapes; its llama3 RoPE scaling is left out (a table's values, no cost).
LLAMA_1B = ModelConfig(
    "llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
    head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
    bos_token_id=128000, eos_token_ids=(128001,), name="llama-3.2-1b-like")
_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
             max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,))
QUICK_SHAPES = {  # --quick: the same architectures, tiny
    "gemma3-tiny": ModelConfig("gemma3", num_layers=6, sliding_window=16, layer_types=(_SLIDING,) * 5 + (_FULL,),
                               qk_norm=True, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh",
                               query_pre_attn_scalar=16.0, rope_theta=1e6, rope_local_theta=1e4, name="gemma3-tiny",
                               **_TINY),
    "llama-tiny": ModelConfig("llama", num_layers=2, rope_theta=500000.0, tie_word_embeddings=True, name="llama-tiny",
                              **_TINY),
}
SHAPES = {"gemma3-270m": GEMMA3_270M, "llama-3.2-1b": LLAMA_1B}
SYSTEMS = ("kiln", "hf", "graph")
LONG_TARGET = 0.8  # Kiln's batch-1 decode after --long-context tokens over after --prompt-len (issue 36)


# ---- the three systems: generate(prompts, n) runs n greedy tokens for each prompt and returns when done ----

class KilnSystem:
    def __init__(self, model_dir: Path, args: argparse.Namespace) -> None:
        from kiln import LLM, SamplingParams

        self._params = SamplingParams
        self.llm = LLM(str(model_dir), device=args.device, speculative=None, quantization=None,
                       max_model_len=args.max_model_len, cache_dir=str(args.work / "kiln-cache"),
                       num_threads=common.THREADS if args.device == "cpu" else None)

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        params = self._params(max_tokens=n, temperature=0.0, ignore_eos=True)
        return [list(out.token_ids) for out in self.llm.generate(prompts, params)]

    def notes(self) -> dict[str, Any]:
        import kiln.kernels

        config = asdict(self.llm.config)
        config.pop("model")
        return {"engine_config": config, "kv_bytes_per_token": self.llm.engine.kv_bytes_per_token,
                "weight_bytes_per_token": common.weight_bytes_per_token(self.llm.engine.model),
                # How many decode steps replayed a captured graph, and how many of those ran ahead.
                "steps": self.llm.engine.stats.steps, "static_decode_steps": self.llm.engine.stats.static_decode_steps,
                "ahead_steps": self.llm.engine.stats.ahead_steps,
                "graphs_capture_s": None if self.llm.engine.decode_graphs is None else self.llm.engine.decode_graphs.capture_s,
                # On a GPU nothing should have built or loaded the CPU kernels (kiln/kernels).
                "cpu_kernels_loaded": kiln.kernels._library._outcome is not None}

    def close(self) -> None:
        self.llm.close()


class HFSystem:
    def __init__(self, model_dir: Path, args: argparse.Namespace) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=args.dtype,
                                                          attn_implementation=args.hf_attn).to(args.device).eval()
        self.model.generation_config.eos_token_id = None  # exactly n tokens, as Kiln's ignore_eos
        self.model.generation_config.pad_token_id = 0

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        return peers.hf_generate(self.model, prompts, n)[0].tolist()

    def notes(self) -> dict[str, Any]:
        return {"attn_implementation": self.model.config._attn_implementation, "api": "model.generate, greedy, default cache",
                "kv_bytes_per_token": peers.hf_kv_bytes_per_token(self.model)}

    def close(self) -> None:
        del self.model


class GraphSystem:
    """bench/cuda_graph_decoder.py: one static cache (and graph) per (batch, positions), built before timing."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], args: argparse.Namespace) -> None:
        self.decoder = Decoder(decoder_shape(config), tensors, args.device, args.dtype)
        self.graph = args.device.startswith("cuda") and not args.no_graph
        self.caches: dict[tuple[int, int], Cache] = {}
        self.extra = args.decode_tokens

    def prepare(self, batch: int, prompt_len: int) -> Cache:
        positions = -(-(prompt_len + self.extra) // 16) * 16  # a multiple of 16: SDPA's mask alignment
        key = (batch, positions)
        if key not in self.caches:
            self.caches[key] = Cache(self.decoder, batch, positions, self.graph)
        return self.caches[key]

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        cache = self.prepare(len(prompts), len(prompts[0]))
        return cache.generate(torch.tensor(prompts, device=self.decoder.device), n).tolist()

    def notes(self) -> dict[str, Any]:
        return {"cuda_graphs": self.graph, "weight_bytes_per_token": self.decoder.weight_bytes(),
                "caches": [list(key) for key in self.caches]}

    def close(self) -> None:
        self.caches.clear()


def decoder_shape(config: ModelConfig) -> Shape:
    local = tuple(i for i, kind in enumerate(config.layer_types) if kind == _SLIDING)
    scale = config.query_pre_attn_scalar ** -0.5 if config.query_pre_attn_scalar else None
    return Shape(config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads,
                 config.num_kv_heads, config.head_dim, config.vocab_size, config.rope_theta, config.rms_norm_eps,
                 config.architecture == "gemma3", config.sliding_window, local, config.rope_local_theta, scale)


# ---- weights ----

def random_tensors(config: ModelConfig, device: str, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor the HF model of `config` has (a tied head not repeated), drawn on `device`: norms near their
    identity (1 for w * x, 0 for Gemma's (1 + w) * x), projections N(0, 1 / fan_in), embeddings N(0, 1 / hidden):
    activations stay O(1) in bfloat16. (Greedy decoding of such weights soon repeats one token; speed does not care.)"""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = hf_config_dict(config)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.for_model(**settings))
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, param in meta.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        noise = torch.randn(param.shape, generator=generator, device=device)
        if "norm" in name:
            value = 0.1 * noise + (0.0 if config.architecture == "gemma3" else 1.0)
        else:
            value = noise * (config.hidden_size if "embed_tokens" in name else param.shape[-1]) ** -0.5
        tensors[name] = value.to(dtype)
    return tensors


def write_model_dir(config: ModelConfig, tensors: dict[str, torch.Tensor], path: Path, dtype: torch.dtype) -> Path:
    """An HF model directory both Kiln (kiln/models/loader.py) and transformers load: config.json, one
    model.safetensors and a byte-level tokenizer.json (the benchmark feeds ids; any tokenizer that loads will do)."""
    import tokenizers
    from safetensors.torch import save_file
    from tokenizers import decoders, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    settings = hf_config_dict(config) | {"dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(settings, indent=1))
    save_file({name: t.contiguous().cpu() for name, t in tensors.items()}, str(path / "model.safetensors"))
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.save(str(path / "tokenizer.json"))
    return path


def weight_bytes_per_step(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the projections and the LM head (the whole table when tied) one decode step reads in `dtype`;
    norms and the embedding rows looked up are left out (well under 0.1%)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    layer = config.hidden_size * (2 * q + 2 * kv) + 3 * config.hidden_size * config.intermediate_size
    elements = config.num_layers * layer + config.vocab_size * config.hidden_size
    return elements * torch.empty(0, dtype=dtype).element_size()


# ---- measurements ----

def prompt_ids(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    low = min(1000, vocab // 8)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (count, length), generator=generator).tolist()


class Timer:
    """Wall seconds of synchronous calls, the device drained before the clock starts."""

    def __init__(self, device: str) -> None:
        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def __call__(self, fn: Callable[[], object]) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start


class Run:
    """One system's measurements, in the order taken; each fresh prompt batch comes from a new seed."""

    def __init__(self, system: Any, vocab: int, args: argparse.Namespace) -> None:
        self.system, self.vocab, self.args, self.timer, self.seed = system, vocab, args, Timer(args.device), 0

    def _time(self, batch: int, length: int, n: int) -> float:
        self.seed += 1
        prompts = prompt_ids(batch, length, self.vocab, seed=10_000 * batch + self.seed)
        return self.timer(lambda: self.system.generate(prompts, n))

    def _ready(self, batch: int, length: int) -> None:
        if hasattr(self.system, "prepare"):
            self.system.prepare(batch, length)  # graph capture, before any timing
        self._time(batch, length, 2)  # warm-up

    def prefill(self, length: int) -> dict[str, Any]:
        self._ready(1, length)
        seconds = [self._time(1, length, 1) for _ in range(self.args.repeats)]
        return {"tokens": length, "seconds": seconds, "tokens_per_s": length / median(seconds)}

    def decode(self, batch: int, prompt_len: int) -> dict[str, Any]:
        self._ready(batch, prompt_len)
        n = self.args.decode_tokens
        one, full = [], []
        for _ in range(self.args.repeats):
            one.append(self._time(batch, prompt_len, 1))
            full.append(self._time(batch, prompt_len, n))
        seconds = median(full) - median(one)
        result = {"batch": batch, "prompt_len": prompt_len, "decode_tokens": n, "seconds_full": full, "seconds_one_token": one}
        if seconds <= 0:
            return result | {"tokens_per_s": None, "reason": "decode time not resolvable (difference <= 0)"}
        return result | {"tokens_per_s": batch * (n - 1) / seconds, "step_ms": 1000 * seconds / (n - 1)}


def measure(name: str, system: Any, config: ModelConfig, args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    """Prefill at --lengths, decode at --batches, batch 1 at --long-context; a part the time budget no longer
    allows is recorded as skipped."""
    run = Run(system, config.vocab_size, args)
    out: dict[str, Any] = {"status": "ok", "prefill": {}, "decode": {}}
    parts = [("prefill", str(n), lambda n=n: run.prefill(n)) for n in args.lengths]
    parts += [("decode", str(b), lambda b=b: run.decode(b, args.prompt_len)) for b in args.batches]
    if args.long_context:
        parts.append(("decode", f"1@{args.long_context}", lambda: run.decode(1, args.long_context)))
    for kind, key, part in parts:
        if not budget.left():
            out[kind][key] = {"tokens_per_s": None, "status": "skipped", "reason": "time budget (--budget-s) spent"}
            continue
        out[kind][key] = part()
        print(f"  {name} {kind} {key}: {_rate(out[kind][key])} tokens/s", flush=True)
    step = out["decode"].get("1", {}).get("step_ms")
    out["batch1_weight_gb_s"] = weight_bytes_per_step(config, args.dtype) / step / 1e6 if step else None
    long_rate = out["decode"].get(f"1@{args.long_context}", {}).get("tokens_per_s")
    out["long_over_short_decode_b1"] = common.ratio(long_rate, out["decode"].get("1", {}).get("tokens_per_s"))
    return out


def _rate(result: dict[str, Any]) -> str:
    rate = result.get("tokens_per_s")
    return "n/a" if rate is None else f"{rate:,.1f}"


class Budget:
    """Seconds left of --budget-s since the start (the command must end inside the device's limit)."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


# ---- checks ----

def run_tests(args: argparse.Namespace) -> dict[str, Any]:
    """pytest in a child process under KILN_TEST_DEVICE=<device type>: the parity tests, the optional CUDA test
    files that exist, and the `cuda` marker's tests where pyproject.toml registers one."""
    device = torch.device(args.device).type
    present = [p for p in OPTIONAL_TESTS if (REPO / p).is_file()]
    commands = {"parity": [PARITY_TESTS, *present]}
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"].get("markers", [])
    marked = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if CUDA_MARK in p.read_text())
    if any(m.split(":")[0].strip() == "cuda" for m in markers) and device == "cuda" and marked:
        commands["marker_cuda"] = ["-m", "cuda", *marked]
    env = os.environ | {"KILN_TEST_DEVICE": device}
    results: dict[str, Any] = {"device": device, "missing_optional": sorted(set(OPTIONAL_TESTS) - set(present))}
    for key, targets in commands.items():
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets]
        start = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.tests_timeout_s)
            output, code = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as error:
            output, code = f"{error.stdout or ''}\ntimed out after {args.tests_timeout_s} s", None
        lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", line)]
        results[key] = {"command": " ".join(command[1:]), "returncode": code, "summary": lines[-1] if lines else None,
                        "seconds": time.perf_counter() - start, "output_tail": output[-3000:]}
        print(f"tests {key}: {results[key]['summary'] or output[-500:]} ({results[key]['seconds']:.0f} s)", flush=True)
    return results


@torch.inference_mode()
def check_decoder(config: ModelConfig, tensors: dict[str, torch.Tensor], model_dir: Path, args: argparse.Namespace,
                  steps: int = 24) -> dict[str, Any]:
    """The graph decoder's logits against transformers' on the same weights: a prompt, then `steps` tokens fed one
    at a time through the decode step as captured (past a tiny shape's sliding window). Relative to the largest
    logit; float32 agrees to rounding, bfloat16 to its precision."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=args.dtype, attn_implementation="eager").to(args.device)
    decoder = Decoder(decoder_shape(config), tensors, args.device, args.dtype)
    prompt_len = 2 * (config.sliding_window or 16)
    ids = torch.tensor(prompt_ids(2, prompt_len + steps, config.vocab_size, seed=7), device=args.device)
    reference = hf(input_ids=ids).logits.float()
    cache = Cache(decoder, 2, -(-(prompt_len + steps) // 16) * 16, graph=False)
    ours = [decoder.forward(cache, ids[:, :prompt_len], torch.arange(prompt_len, device=args.device), prompt_len)]
    for i in range(prompt_len, prompt_len + steps):
        ours.append(decoder.forward(cache, ids[:, i : i + 1], torch.tensor([i], device=args.device), cache.length))
    ours = torch.stack(ours[:-1], dim=1).float()  # logits after position prompt_len - 1 ... prompt_len + steps - 2
    expected = reference[:, prompt_len - 1 : prompt_len + steps - 1]
    error = ((ours - expected).abs().max() / expected.abs().max()).item()
    same = (ours.argmax(-1) == expected.argmax(-1)).float().mean().item()
    del hf
    return {"max_abs_error_over_max_logit": error, "argmax_agreement": same, "positions": prompt_len + steps,
            "ok": error < (1e-4 if args.dtype == torch.float32 else 5e-2)}


# ---- the run ----

def run_shape(shape: str, config: ModelConfig, args: argparse.Namespace, budget: Budget, shapes_left: int) -> dict[str, Any]:
    """One shape's weights, the decoder's check, then each system in turn, each allowed at most 1.5x its even
    share of the time left, so that a slow system cannot starve the ones after it."""
    start = time.perf_counter()
    tensors = random_tensors(config, args.device, args.dtype)
    model_dir = write_model_dir(config, tensors, args.work / shape, args.dtype)
    result: dict[str, Any] = {"config": hf_config_dict(config), "weight_bytes_per_decode_step": weight_bytes_per_step(config, args.dtype),
                              "weights_written_s": time.perf_counter() - start, "systems": {}, "greedy_tokens": {}}
    result["decoder_check"] = _guarded(lambda: check_decoder(config, tensors, model_dir, args))
    print(f"{shape}: decoder check {result['decoder_check']}", flush=True)
    probe = prompt_ids(1, args.prompt_len, config.vocab_size, seed=3)
    for i, name in enumerate(args.systems):
        pairs_left = (shapes_left - 1) * len(args.systems) + len(args.systems) - i
        share = Budget(min(budget.left(), 1.5 * budget.left() / pairs_left))
        if not share.left():
            result["systems"][name] = {"status": "skipped", "reason": "time budget (--budget-s) spent"}
            continue
        result["systems"][name] = _guarded(lambda name=name, share=share: _one_system(
            name, config, tensors, model_dir, args, share, probe, result["greedy_tokens"]))
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return result


def _one_system(name: str, config: ModelConfig, tensors: dict[str, torch.Tensor], model_dir: Path,
                args: argparse.Namespace, budget: Budget, probe: list[list[int]], greedy: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    system = (KilnSystem(model_dir, args) if name == "kiln" else HFSystem(model_dir, args) if name == "hf"
              else GraphSystem(config, tensors, args))
    try:
        built = time.perf_counter() - start
        greedy[name] = system.generate(probe, 16)[0]  # the systems' greedy tokens on one prompt, side by side
        out = measure(name, system, config, args, budget)
        return out | {"build_s": built, "seconds": time.perf_counter() - start, "notes": system.notes()}
    finally:
        system.close()


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """fn()'s result, or its failure as a result: one broken system must not cost the others' numbers."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - recorded, the run goes on
        traceback.print_exc()
        return {"status": "error", "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}


def machine(args: argparse.Namespace) -> dict[str, Any]:
    info = common.machine_info()
    if info.get("git_commit") is None and COMMIT_FILE.is_file():  # "<sha> clean" or "<sha> dirty"
        commit, state = [*COMMIT_FILE.read_text().split(), "unknown"][:2]
        info |= {"git_commit": commit, "git_dirty": state == "dirty", "git_commit_from": str(COMMIT_FILE.relative_to(REPO))}
    info["device"] = args.device
    if args.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(args.device))
        info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                 "gpu_multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda,
                 "capability": list(torch.cuda.get_device_capability(torch.device(args.device)))}
    return info


def write(args: argparse.Namespace, payload: dict[str, Any]) -> Path:
    payload["targets"] = {
        "kiln_long_over_short_decode_b1": {shape: r["systems"].get("kiln", {}).get("long_over_short_decode_b1")
                                          for shape, r in payload["shapes"].items()},
        "min": LONG_TARGET,
    }
    ratios = [v for v in payload["targets"]["kiln_long_over_short_decode_b1"].values() if v is not None]
    payload["targets"]["met"] = all(v >= LONG_TARGET for v in ratios) if ratios else None
    return common.write_results(args.name, payload)


def plot(args: argparse.Namespace, shapes: dict[str, Any]) -> list[Path]:
    common.LABELS.update({"kiln": f"Kiln ({args.dtype_name}, decode_graphs auto)",
                          "hf": f"HF transformers ({args.dtype_name}, generate)",
                          "graph": "PyTorch + CUDA graphs" if args.device.startswith("cuda") and not args.no_graph
                          else "PyTorch static-cache decoder (eager)"})
    paths = []
    for shape, result in shapes.items():
        ran = {n: r for n, r in result["systems"].items() if r.get("status") == "ok"}
        decode_keys = [str(b) for b in args.batches] + ([f"1@{args.long_context}"] if args.long_context else [])
        panels = [
            ("prefill tokens/s", [f"{n} tok" for n in args.lengths],
             {n: [r["prefill"][str(x)]["tokens_per_s"] for x in args.lengths] for n, r in ran.items()}),
            (f"decode tokens/s (prompt {args.prompt_len})", [f"batch {k}".replace("@", " @ ctx ") for k in decode_keys],
             {n: [r["decode"][k]["tokens_per_s"] for k in decode_keys] for n, r in ran.items()}),
        ]
        path = common.plot_bars(f"{args.name}_{shape}", panels, f"{shape}, random weights, {machine_label(args)}")
        if path:
            paths.append(path)
    return paths


def machine_label(args: argparse.Namespace) -> str:
    return torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "CPU"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="torch device: cuda (default) or cpu (with --quick, a check)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {', '.join(SHAPES)}")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    parser.add_argument("--lengths", type=common.ints, default=[512, 2048], help="prefill lengths")
    parser.add_argument("--batches", type=common.ints, default=[1, 8, 32], help="decode batch sizes")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt ids per sequence before decode")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per sequence for decode")
    parser.add_argument("--long-context", type=int, default=8192, help="batch-1 decode after this many ids (0: off)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    parser.add_argument("--max-model-len", type=int, default=16384, help="Kiln's max_model_len")
    parser.add_argument("--hf-attn", default="sdpa", help="transformers attn_implementation (its default: sdpa)")
    parser.add_argument("--no-graph", action="store_true", help="run the PyTorch decoder eagerly even on a GPU")
    parser.add_argument("--no-tests", action="store_true", help="skip the pytest step")
    parser.add_argument("--tests-timeout-s", type=int, default=150)
    parser.add_argument("--budget-s", type=float, default=320,
                        help="seconds from the start after which no measurement starts (the tests count)")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="where the JSON and PNGs go")
    args = common.parse_run_args(parser, "gpu", "tiny shapes, lengths 64,128, batches 1,4, 8 tokens, 2 repeats", _quick)
    args.shapes = [s for s in args.shapes.split(",") if s] if not args.quick else list(QUICK_SHAPES)
    args.systems = [s for s in args.systems.split(",") if s in SYSTEMS]
    args.dtype = torch.float32 if args.device == "cpu" else torch.bfloat16  # EngineConfig's dtype "auto"
    args.dtype_name = str(args.dtype).removeprefix("torch.")
    if args.decode_tokens < 2:
        parser.error("--decode-tokens must be at least 2")
    return args


def _quick(args: argparse.Namespace) -> None:
    args.lengths, args.batches, args.prompt_len, args.decode_tokens, args.repeats = [64, 128], [1, 4], 32, 8, 2
    args.long_context, args.max_model_len = 512, 1024


def main() -> None:
    args = parse_args()
    budget = Budget(args.budget_s)
    common.RESULTS_DIR = args.out  # common.write_results and the plots write there
    if args.device == "cpu":
        common.set_threads()
    plain = (int, float, str, bool, list, type(None))
    payload: dict[str, Any] = {"benchmark": "gpu", "machine": machine(args), "method": __doc__, "shapes": {},
                               "args": {k: v if isinstance(v, plain) else str(v) for k, v in vars(args).items()}}
    payload["tests"] = {"status": "skipped"} if args.no_tests else run_tests(args)
    path = write(args, payload)
    with tempfile.TemporaryDirectory(prefix="kiln-gpu-") as work:
        args.work = Path(work)
        for done, shape in enumerate(args.shapes):
            config = QUICK_SHAPES[shape] if args.quick else SHAPES[shape]
            payload["shapes"][shape] = run_shape(shape, config, args, budget, len(args.shapes) - done)
            path = write(args, payload)  # after every shape: a run cut short keeps what it measured
    for shape, result in payload["shapes"].items():
        for name, r in result["systems"].items():
            decode = {k: _rate(v) for k, v in r.get("decode", {}).items()}
            prefill = {k: _rate(v) for k, v in r.get("prefill", {}).items()}
            bandwidth = r.get("batch1_weight_gb_s")
            shown = "n/a" if bandwidth is None else f"{bandwidth:,.1f}"
            print(f"{shape} {name}: {r.get('status')} prefill {prefill} decode {decode} batch-1 weights {shown} GB/s "
                  f"{r.get('error', '')}")
    with contextlib.suppress(Exception):
        print("plots:", *plot(args, payload["shapes"]))
    print(f"wrote {path}; targets {payload['targets']}")


if __name__ == "__main__":
    main()
