"""Weight formats on the embedded Gemma 3 270M: decode speed, prefill speed, weight bytes, perplexity,
greedy agreement and a needle question, for `quantization` None ("exact"), "gguf" (the default: the file's
Q4_K/Q6_K/Q5_0/Q8_0 blocks as stored, kiln/models/gguf_blocks.py) and int8 (re-quantised, kiln/models/quant.py),
each with the KV pages its configuration ships with (`kv_dtype` "auto": float32 for exact, float16 for
the others), and int8 with float32 KV pages, which tells what each half of int8 costs.

- decode: one fresh session per run, a short prompt, `--decode-tokens` greedy tokens; tokens/s after the
  first token, median of `--repeats` runs after one untimed warm-up. The formats' engines all live at
  once and take turns run by run, so load from other processes on a shared machine hits each alike.
- prefill: `--prefill-tokens` over the time to first token of a session of that many seeded ids (new ids
  every run, so nothing comes from the prefix cache), median of the repeats.
- weight bytes: what one decode step reads from the projections and the LM head (the quantised sizes,
  or the fp32 matrices).
- perplexity: teacher-forced over the first `--ppl-tokens` tokens of bench/data/perplexity.txt (a fixed
  text: the Apache License 2.0, then CPython's textwrap.py), run through the engine's own pieces (KV
  cache, ModelRunner) in `--ppl-chunk`-token chunks, every position's logits kept.
- greedy agreement: tokens generated before the first that differs from the exact path's, on the
  embedded-model test prompts (tests/test_embedded.py), 32 tokens each.
- needle: a fact stated once in ~600 tokens of unrelated text, then asked for; answered when the
  greedy reply holds it.

Writes bench/results/weight_formats.json and .png. `--quick`: 2 repeats, 16 decode tokens, 512
perplexity tokens.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import common
import torch

from kiln import LLM
from kiln.config import EngineConfig
from kiln.engine.engine import build_engine_model
from kiln.engine.runner import Chunk, ModelRunner
from kiln.engine.sequence import Sequence
from kiln.kv.cache import KVCache
from kiln.kv.codec import KVCodec
from kiln.kv.format import KVFormat, dtype_name
from kiln.kv.layout import KVLayout
from kiln.kv.pages import PageTable

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"
PPL_TEXT = "bench/data/perplexity.txt"
FORMATS: dict[str, dict[str, Any]] = {  # label -> EngineConfig options
    "exact": {"quantization": None},
    "gguf": {"quantization": "gguf"},  # the CPU default: a GGUF file's blocks as stored, float16 KV pages
    "int8": {"quantization": "int8"},
    "int8-kv32": {"quantization": "int8", "kv_dtype": "float32"},
}
AGREEMENT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
]
NEEDLE = "The code for the blue locker is 4719."
NEEDLE_FILLER = "The weather report said light rain in the morning, clearing later, with a gentle wind from the west. "


def speed(llms: dict[str, LLM], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Decode and prefill rates of every format, the formats interleaved run by run, so that load from
    other processes falls on all of them alike."""
    decode_params = {"max_tokens": args.decode_tokens, "temperature": 0.0, "ignore_eos": True}
    decode: dict[str, list[float]] = {fmt: [] for fmt in llms}
    prefill: dict[str, list[float]] = {fmt: [] for fmt in llms}
    tokens: dict[str, list[int]] = {}
    for run in range(args.repeats + 1):  # run 0 is the warm-up
        for fmt, llm in llms.items():
            session = llm.create_session(llm.tokenizer.encode(PROMPT))
            result = session.generate(**decode_params).result()
            session.close()
            fresh = llm.create_session(common.random_ids(args.prefill_tokens, seed=run))  # no prefix-cache hit
            ttft = fresh.generate(max_tokens=1).result().time_to_first_token_s
            fresh.close()
            tokens[fmt] = result.token_ids
            if run:
                decode[fmt].append((len(result.token_ids) - 1) / (result.total_s - result.time_to_first_token_s))
                prefill[fmt].append(args.prefill_tokens / ttft)
    first = next(iter(llms))
    return {
        fmt: {
            "decode_tokens_per_s": common.summarize(decode[fmt]),
            "prefill_tokens_per_s": common.summarize(prefill[fmt]),
            "greedy_text": llms[fmt].tokenizer.decode(tokens[fmt]),
            "greedy_tokens_before_first_difference": next(
                (i for i, (a, b) in enumerate(zip(tokens[fmt], tokens[first], strict=True)) if a != b), len(tokens[first])
            ),
        }
        for fmt in llms
    }


@torch.inference_mode()
def perplexity(loaded, options: dict[str, Any], tokens: list[int], chunk: int) -> float:  # noqa: ANN001 - LoadedModel
    """exp(mean negative log-likelihood) of tokens[1:] given their prefixes, one chunk per forward, with the
    weights and KV pages EngineConfig(**options) picks."""
    config = EngineConfig(**options)
    model, _ = build_engine_model(config, loaded)  # the weights and kernels an engine of `options` computes with
    layout = KVLayout.for_model(loaded.config, 16)
    pages = layout.num_groups * (len(tokens) // 16 + 2)
    kv_dtype = config.torch_kv_dtype
    kv_format = KVFormat("bench", dtype_name(torch.float32), dtype_name(kv_dtype), "raw", 16)
    cache = KVCache(layout, pages, KVCodec("none", layout, kv_dtype), "cpu", kv_format)
    runner = ModelRunner(model, cache.storage)
    seq = Sequence(tokens, PageTable.empty(layout.num_groups))
    nll, count = 0.0, 0
    while seq.num_computed < len(tokens):
        n = min(chunk, len(tokens) - seq.num_computed)
        assert cache.ensure(seq.table, seq.num_computed + n)
        logits = runner.run(runner.prepare([Chunk(seq, n, logit_rows=n)]))
        start = seq.num_computed
        seq.num_computed += n
        cache.commit(seq.table, seq.tokens, seq.num_computed)
        targets = torch.tensor(tokens[start + 1 : start + n + 1])
        logprobs = torch.log_softmax(logits[: len(targets)], dim=-1)
        nll -= logprobs.gather(1, targets[:, None]).sum().item()
        count += len(targets)
    return math.exp(nll / count)


def greedy(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(AGREEMENT_PROMPTS, max_tokens=32, temperature=0.0, ignore_eos=True)]


def agreement(ours: list[int], reference: list[int]) -> int:
    """Tokens before the first that differs from the reference's."""
    return next((i for i, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b), len(reference))


def needle(llm: LLM) -> tuple[bool, str]:
    filler = NEEDLE_FILLER * 12
    prompt = f"{filler}{NEEDLE} {filler}Question: what is the code for the blue locker?\nAnswer: The code for the blue locker is"
    reply = llm.generate(prompt, max_tokens=8, temperature=0.0)[0].text
    return "4719" in reply, reply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--ppl-tokens", type=int, default=4096)
    parser.add_argument("--ppl-chunk", type=int, default=256)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.decode_tokens, args.ppl_tokens = 2, 16, 512
    _, machine, loaded = common.start("kiln")
    ppl_tokens = loaded.tokenizer.encode((ROOT / PPL_TEXT).read_text())[: args.ppl_tokens]
    formats = args.formats.split(",")
    llms = {
        fmt: LLM(loaded=loaded, **FORMATS[fmt], speculative=None, kv_budget_bytes=256 * 1024**2,
                 num_threads=common.THREADS)
        for fmt in formats
    }
    results = speed(llms, args)
    reference = greedy(llms["exact"]) if "exact" in llms else None
    for fmt, llm in llms.items():
        results[fmt]["weight_bytes_per_decode_step"] = common.weight_bytes_per_token(llm.engine.model)
        outputs = greedy(llm)
        if reference is not None:
            results[fmt]["greedy_agreement_tokens"] = [agreement(o, r) for o, r in zip(outputs, reference, strict=True)]
        results[fmt]["needle_answered"], results[fmt]["needle_reply"] = needle(llm)
        llm.close()
    del llms
    for fmt in formats:
        results[fmt]["kv_dtype"] = dtype_name(EngineConfig(**FORMATS[fmt]).torch_kv_dtype)
        results[fmt]["perplexity"] = perplexity(loaded, FORMATS[fmt], ppl_tokens, args.ppl_chunk)
    if "exact" in results:
        for fmt in formats:
            results[fmt]["perplexity_vs_exact"] = results[fmt]["perplexity"] / results["exact"]["perplexity"] - 1
    for fmt in formats:
        print(fmt, results[fmt], flush=True)
    name = "weight_formats_quick" if args.quick else "weight_formats"
    payload = {
        "method": __doc__,
        "settings": {**vars(args), "ppl_text": PPL_TEXT, "ppl_tokens_used": len(ppl_tokens), "prompt": PROMPT},
        "machine": machine,
        "results": results,
    }
    print("wrote", common.write_results(name, payload))
    plot(name, results)


def plot(name: str, results: dict[str, Any]) -> None:
    plt = common._pyplot()
    if plt is None:
        return
    formats = list(results)
    panels = [
        ("decode tokens/s (batch 1)", [results[f]["decode_tokens_per_s"]["median"] for f in formats]),
        ("prefill tokens/s", [results[f]["prefill_tokens_per_s"]["median"] for f in formats]),
        ("weight MB read per decode step", [results[f]["weight_bytes_per_decode_step"] / 1e6 for f in formats]),
        ("perplexity (bench/data/perplexity.txt)", [results[f]["perplexity"] for f in formats]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.5))
    for ax, (label, values) in zip(axes, panels, strict=True):
        bars = ax.bar(formats, values, color=["tab:gray", "tab:blue", "tab:cyan"][: len(formats)])
        ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=8)
        ax.set(title=label)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Embedded Gemma 3 270M by weight format (2 threads, median of repeats)")
    print("wrote", common._save(fig, plt, name))


if __name__ == "__main__":
    main()
