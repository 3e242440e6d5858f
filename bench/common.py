"""Shared plumbing of the benchmark scripts: system selection, the reference model, seeded token ids,
timing statistics, results JSON (with the machine it ran on) and plots.

Every number a script writes was measured in that run; what was not measured is recorded as null with
the reason, never filled in.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import median
from typing import Any

import kiln  # noqa: F401  # isort: skip  (before torch: Kiln's OpenMP wait policy, kiln/openmp.py)
import torch

from kiln import openmp

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
SYSTEMS = ("kiln", "kiln-nospec", "kiln-exact", "kiln-deterministic", "kiln-grpc", "kiln-http", "hf", "llamacpp")
LABELS = {
    "kiln": "Kiln (in process)",
    "kiln-nospec": "Kiln (in process, no speculation)",
    "kiln-exact": "Kiln (fp32 weights, quantization=None)",
    "kiln-deterministic": "Kiln (deterministic mode)",
    "kiln-grpc": "Kiln over gRPC (SDK session)",
    "kiln-http": "Kiln over OpenAI HTTP (prefix cache)",
    "hf": "HF transformers",
    "llamacpp": "llama.cpp (Q4_K_M)",
}
# The module each system needs and the package (from the `bench` extra) that provides it.
_REQUIREMENTS = {
    "kiln": ("kiln", "kiln"),
    "kiln-nospec": ("kiln", "kiln"),
    "kiln-exact": ("kiln", "kiln"),
    "kiln-deterministic": ("kiln", "kiln"),
    "kiln-grpc": ("grpc", "grpcio"),
    "kiln-http": ("openai", "openai"),
    "hf": ("transformers", "transformers"),
    "llamacpp": ("llama_cpp", "llama-cpp-python"),
}
# Random prompt ids come from this range: ordinary text pieces of the Gemma 3 vocabulary, clear of the
# control tokens at the bottom and the multimodal tokens at the top.
TEXT_ID_RANGE = (1000, 200_000)
THREADS = 2
BUSY_LOAD = 0.5  # 1-minute load average above which another process is probably using the CPU


def parse_systems(text: str) -> list[str]:
    """`--peers kiln,hf` -> ["kiln", "hf"], in the canonical order, unknown names rejected."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    return [name for name in SYSTEMS if name in names]


def ints(text: str) -> list[int]:
    """An argparse type: "512,2048" -> [512, 2048]."""
    return [int(part) for part in text.split(",") if part.strip()]


def parse_run_args(parser: argparse.ArgumentParser, name: str, quick_help: str,
                   quick: Callable[[argparse.Namespace], None]) -> argparse.Namespace:
    """Every script's last flags: --quick (a smoke test: `quick` shrinks the run) and --name (the results
    file stem, default `name` or `name`_quick)."""
    parser.add_argument("--quick", action="store_true", help=f"smoke test: {quick_help}")
    parser.add_argument("--name", help=f"results file stem under bench/results/ (default {name}, or {name}_quick)")
    args = parser.parse_args()
    args.name = args.name or (f"{name}_quick" if args.quick else name)
    if args.quick:
        quick(args)
    return args


def peer_environment() -> dict[str, str]:
    """The environment for a peer's process: this one's without the OpenMP wait policy `import kiln` set
    for itself (kiln/openmp.py). llama.cpp's OpenMP threads sleep at every barrier under it: on the
    embedded model its decode fell from 60 to 36 tokens/s, the 1.7B file's from 22 to 13."""
    env = dict(os.environ)
    if openmp.SET_BY_KILN:
        env.pop(openmp.WAIT_POLICY, None)
    return env


def warn_if_busy() -> None:
    """Say so when other processes already load the CPU: with two threads on two cores, every
    parallel op then waits for a preempted thread and the timings mostly measure the neighbours."""
    load = os.getloadavg()[0]
    if load > BUSY_LOAD:
        print(f"warning: 1-minute load average is {load:.2f} before starting; timings will be noisy", file=sys.stderr)


def missing_reason(system: str) -> str | None:
    """Why `system` cannot run here (its module is not installed), or None when it can."""
    module, package = _REQUIREMENTS[system]
    if importlib.util.find_spec(module) is None:
        return f"{package} is not installed (pip install -e '.[bench]')"
    return None


def set_threads() -> None:
    """Every system gets the same two threads: torch for Kiln and HF, n_threads for llama.cpp."""
    torch.set_num_threads(THREADS)


def load_reference():  # noqa: ANN201 - kiln.models.loader.LoadedModel, imported lazily
    """The embedded Gemma 3 270M, dequantised to fp32 under HF names; Kiln and HF both run these weights
    and llama.cpp runs the GGUF file they came from."""
    from kiln.models.loader import load_model

    return load_model()


def random_reference(entry: str):  # noqa: ANN201 - kiln.models.loader.LoadedModel, imported lazily
    """A model shaped as the converted-weight cache entry `entry` describes (its config.json and tokenizer
    files; the weights may be absent), with transformers' random initialisation. For speed measurements
    where the real weights cannot be had: compute does not depend on the weights' values."""
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    from kiln.models.hf_config import hf_config_dict
    from kiln.models.loader import LoadedModel
    from kiln.models.weight_cache import read_description

    config, tokenizer = read_description(Path(entry))
    settings = hf_config_dict(config)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(settings.pop("model_type"), **settings), dtype=torch.float32)
    tensors = {name: t for name, t in hf.state_dict().items() if name != "lm_head.weight" or not config.tie_word_embeddings}
    return LoadedModel(config, tensors, tokenizer, Path(entry), "random-weights")


def start(peers: str, random_weights: str | None = None) -> tuple[list[str], dict[str, Any], Any]:
    """What every benchmark does first: the same threads for every system, a warning when the machine is
    busy, then (systems to run, machine description, the embedded model's weights, or random weights of
    the shape a cache entry describes)."""
    set_threads()
    warn_if_busy()
    return parse_systems(peers), machine_info(), random_reference(random_weights) if random_weights else load_reference()


def random_ids(count: int, seed: int) -> list[int]:
    """`count` seeded token ids from TEXT_ID_RANGE, as Python ints (Kiln validates the type)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(*TEXT_ID_RANGE, (count,), generator=generator).tolist()


def timed(fn, *args: Any, **kwargs: Any) -> tuple[float, Any]:  # noqa: ANN001 - any callable
    """(wall seconds, result) of one call, with time.perf_counter."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    """The median wall seconds of `repeats` calls of `call`, after one untimed warm-up call."""
    call()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return median(seconds)


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """Median, min, max and count; the median is the headline figure because the machine is shared."""
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": median(values), "min": min(values), "max": max(values), "n": len(values)}


def read_bandwidth_gb_s(repeats: int = 5) -> float:
    """Memory read bandwidth with the benchmark's threads: the median rate of summing a 1 GiB float32
    tensor (far larger than any cache), in GB/s. Decode reads every weight once per token, so weight
    bytes per token over this is the fastest decode the memory allows."""
    data = torch.ones(2**28)
    data.sum()
    rates = []
    for _ in range(repeats):
        seconds, _ = timed(data.sum)
        rates.append(data.nbytes / seconds / 1e9)
    return median(rates)


def weight_bytes_per_token(model: Any) -> int:
    """Bytes of the projections and the LM head one decode step reads (a kiln CausalLM): a kernel layer's own
    `nbytes` (an int8 copy, a GGUF file's blocks), an nn.Linear's parameters and buffers (float32); a tied float
    head reads the whole embedding table. Embedding lookups read one row a token and are not counted."""
    from torch import nn

    total = 0
    for module in model.modules():
        if isinstance(getattr(module, "nbytes", None), int):
            total += module.nbytes
        elif isinstance(module, nn.Linear):
            total += sum(t.nbytes for t in (*module.parameters(), *module.buffers()))
    if model.lm_head is None:
        total += model.model.embed_tokens.weight.nbytes
    return total


@torch.inference_mode()
def teacher_forced_perplexity(cache: Any, runner: Any, seq: Any, chunk: int) -> float:
    """exp(mean negative log-likelihood) of seq.tokens[1:] given their prefixes, computed through the
    engine's own pieces (a kiln KVCache, a ModelRunner over it, an empty Sequence), one `chunk`-token
    step at a time with every position's logits kept."""
    from kiln.engine.runner import Chunk

    tokens = seq.tokens
    nll, count = 0.0, 0
    while seq.num_computed < len(tokens):
        n = min(chunk, len(tokens) - seq.num_computed)
        if not cache.ensure(seq.table, seq.num_computed + n):
            raise RuntimeError("the KV cache is too small for the perplexity text")
        logits = runner.run(runner.prepare([Chunk(seq, n, logit_rows=n)]))
        start = seq.num_computed
        seq.num_computed += n
        cache.commit(seq.table, seq.tokens, seq.num_computed)
        targets = torch.tensor(tokens[start + 1 : start + n + 1])
        nll -= torch.log_softmax(logits[: len(targets)], dim=-1).gather(1, targets[:, None]).sum().item()
        count += len(targets)
    return math.exp(nll / count)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def machine_info() -> dict[str, Any]:
    """What a reader needs to reproduce or discount the numbers: hardware, versions, commit, load."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "threads_used": THREADS,
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "llama_cpp_python": _version("llama-cpp-python"),
        "kiln_package": _kiln_package(),
        "git_commit": _git("rev-parse", "HEAD"),
        # Results written by an earlier bench of the same sequence do not change the code measured.
        "git_dirty": bool(_git("status", "--porcelain", "--", ":(top)", ":(top,exclude)bench/results")),
        "load_average_at_start": list(os.getloadavg()),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _kiln_package() -> str | None:
    """Where `import kiln` (and a `kiln serve` started from here) finds the package: the checkout, or
    another tree put first on PYTHONPATH to measure it."""
    spec = importlib.util.find_spec("kiln")
    return str(Path(spec.origin).parent) if spec and spec.origin else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=BENCH_DIR, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def write_results(name: str, payload: dict[str, Any]) -> Path:
    """bench/results/<name>.json; the load average at the end tells whether others shared the CPU."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    payload["machine"]["load_average_at_end"] = list(os.getloadavg())
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def _pyplot():  # noqa: ANN202 - matplotlib.pyplot, or None when the bench extra is missing
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot written", file=sys.stderr)
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_lines(name: str, series: dict[str, tuple[list[float], list[float]]], xlabel: str, ylabel: str, title: str,
               yscale: str = "log") -> Path | None:
    """One line per series (x, y), labelled with LABELS for a system's name and the key otherwise; a log
    y axis by default, since the full-history baseline grows by orders of magnitude past the others.
    Returns the PNG path, or None without matplotlib."""
    return plot_line_panels(name, [(ylabel, series)], xlabel, title, yscale)


def plot_line_panels(name: str, panels: list[tuple[str, dict[str, tuple[list[float], list[float]]]]], xlabel: str,
                     title: str, yscale: str = "log", marks: Sequence[tuple[float, str]] = ()) -> Path | None:
    """plot_lines with several panels stacked over one x axis, one per (ylabel, series); `marks`: (x, label)
    vertical lines drawn on every panel (an event the lines should be read against, such as a restart)."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2 + 3.5 * len(panels)), sharex=True, squeeze=False)
    for ax, (ylabel, series) in zip(axes[:, 0], panels, strict=True):
        for key, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="." if len(xs) < 60 else None, label=LABELS.get(key, key))
        for x, label in marks:
            ax.axvline(x, color="grey", linestyle="--", linewidth=1, label=label)
        ax.set(ylabel=ylabel, yscale=yscale)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8 if len(panels) > 1 else None)
    axes[0, 0].set(title=title)
    axes[-1, 0].set(xlabel=xlabel)
    return _save(fig, plt, name)


def plot_bars(name: str, panels: list[tuple[str, list[str], dict[str, list[float | None]]]], title: str) -> Path | None:
    """Grouped bars on a linear axis (bar lengths compare honestly), one panel per (ylabel, group labels,
    {system: values}); a missing value (None) leaves a gap labelled "n/a" rather than a zero-height bar
    that reads as a measurement."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5.5), squeeze=False)
    for ax, (ylabel, groups, values) in zip(axes[0], panels, strict=True):
        width = 0.8 / max(len(values), 1)
        for k, (system, ys) in enumerate(values.items()):
            xs = [g + (k - (len(values) - 1) / 2) * width for g in range(len(groups))]
            bars = ax.bar(xs, [float("nan") if y is None else y for y in ys], width, label=LABELS.get(system, system))
            ax.bar_label(bars, labels=[f"{y:.3g}" if y is not None else "n/a" for y in ys], fontsize=7)
        ax.set_xticks(range(len(groups)), groups)
        ax.set(ylabel=ylabel)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, plt, name)


def _save(fig, plt, name: str) -> Path:  # noqa: ANN001 - matplotlib objects
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
