"""Bounded KV memory against intelligence loss on the embedded Gemma 3 270M: for each KV policy x codec,
needle recall per context length, perplexity delta, sustained and per-step peak memory, decode tokens/s.

- configurations: `full`; `sink_window` and `restore` with `--sink` + `--window` tokens resident in the
  global layers; each with every KV codec, which stores the pages in the pool and in the tiers alike.
- needle ladder: for each rung (context tokens), `--samples` prompts of generated filler sentences
  (seeded, in this file: no download) with one sentence "The secret number of <name> is <5 digits>."
  at depths spread evenly from 5 % to 95 %, ending in a question about it. One fresh session per prompt
  under the policy; recall = the greedy 8-token reply holds the number. Samples of a rung share the
  filler, so the prefix cache (same policy) spares part of their prefill; decode speed is measured
  after the first token, which the cache does not touch.
- memory, per sample: sustained = the session's resident KV bytes (every layer; pages held between
  steps) after the reply; tier = its pages in the host / disk tiers; per-step peak = the largest
  transient attention buffers any step of the sample accounted (gathered or streamed K/V, scores,
  online-softmax state; kiln/models/streamed_attention.py and attention.py), a separate claim.
- a long session: `--session-tokens` of filler appended in 1024-token turns (one generated token
  each), resident KV bytes after every turn, for the `--sessions` policy/codec pairs.
- perplexity: teacher-forced over the first `--ppl-tokens` tokens of bench/data/perplexity.txt through
  the engine's pieces (KV cache with tiers, ModelRunner) in `--ppl-chunk`-token steps.

Writes bench/results/fidelity.json and .png and prints the trade-off table. `--quick`: rungs 512,1024,
3 samples, 2048-token session, 512 perplexity tokens.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import torch

from kiln import LLM
from kiln.engine.runner import ModelRunner
from kiln.engine.sequence import Sequence
from kiln.kv.cache import KVCache
from kiln.kv.codec import CODECS, KVCodec
from kiln.kv.format import KVFormat, dtype_name
from kiln.kv.layout import KVLayout
from kiln.kv.pages import PageTable
from kiln.kv.policy import POLICIES, KVPolicy
from kiln.kv.tiers import PageTiers

ROOT = Path(__file__).resolve().parent.parent
PPL_TEXT = "bench/data/perplexity.txt"
NAMES = ["Ada", "Borislav", "Chiamaka", "Dmitri", "Esperanza", "Farrukh", "Gwendolyn", "Hiroshi", "Ingrid", "Jomo",
         "Kalinda", "Leopold", "Marisol", "Nikolai", "Oluwaseun", "Priyanka"]
SUBJECTS = ["The old mill", "A quiet river", "The market square", "An iron bridge", "The northern forest",
            "A narrow street", "The lighthouse", "The orchard", "A stone chapel", "The harbour"]
VERBS = ["stood beside", "looked over", "was built near", "slowly faded behind", "echoed across", "stretched toward"]
OBJECTS = ["the hills", "the sleeping town", "a field of barley", "the grey sea", "the railway line",
           "an abandoned farm", "the winter road", "the valley"]
CODAS = ["as the seasons turned.", "while travellers passed by.", "long after the fair had ended.",
         "in the pale morning light.", "without anyone taking notice.", "as it had for a hundred years."]


def filler(tokenizer, num_tokens: int, seed: int) -> list[str]:  # noqa: ANN001 - kiln Tokenizer
    """Seeded sentences, enough for `num_tokens` tokens."""
    draw = random.Random(seed)
    sentences: list[str] = []
    while len(tokenizer.encode(" ".join(sentences), add_special_tokens=False)) < num_tokens:
        sentences += [f"{draw.choice(SUBJECTS)} {draw.choice(VERBS)} {draw.choice(OBJECTS)} {draw.choice(CODAS)}"
                      for _ in range(max(8, (num_tokens - len(sentences) * 14) // 14))]
    return sentences


def needle_prompt(tokenizer, sentences: list[str], context: int, depth: float, sample: int) -> tuple[list[int], str]:  # noqa: ANN001
    """A prompt of about `context` tokens with the needle at `depth` of it; returns (ids, the answer)."""
    name, number = NAMES[sample % len(NAMES)], str(10000 + (sample * 7919) % 90000)
    question = f"\nQuestion: What is the secret number of {name}?\nAnswer: The secret number of {name} is"
    budget = context - len(tokenizer.encode(question, add_special_tokens=False)) - 16
    body: list[str] = []
    for sentence in sentences:  # a sentence's tokens after a space: joined text tokenises the same way
        budget -= len(tokenizer.encode(" " + sentence, add_special_tokens=False))
        if budget < 0:
            break
        body.append(sentence)
    body.insert(round(depth * len(body)), f"The secret number of {name} is {number}.")
    return tokenizer.encode(" ".join(body) + question), number


def ladder(llm: LLM, policy: str, args: argparse.Namespace) -> dict[str, Any]:
    """Recall, memory and decode speed per rung for one policy on `llm` (whose codec is fixed)."""
    tokenizer, results = llm.tokenizer, {}
    for context in args.rungs:
        sentences = filler(tokenizer, context, seed=context)
        rows = []
        for sample in range(args.samples):
            depth = 0.05 + 0.9 * sample / max(1, args.samples - 1)
            ids, answer = needle_prompt(tokenizer, sentences, context, depth, sample)
            llm.engine.stats.max_step_attention_bytes = 0
            session = llm.create_session(ids, kv_policy=policy, kv_sink_tokens=args.sink, kv_window_tokens=args.window)
            result = session.generate(max_tokens=8, temperature=0.0, ignore_eos=True).result()
            info = session.info()
            decode_s = result.total_s - (result.time_to_first_token_s or 0.0)
            rows.append({
                "depth": depth, "tokens": len(ids), "recalled": answer in tokenizer.decode(result.token_ids),
                "reply": tokenizer.decode(result.token_ids), "sustained_kv_bytes": info.resident_kv_bytes,
                "sustained_global_kv_bytes": info.global_kv_bytes,
                "tier_bytes": info.host_tier_bytes + info.disk_tier_bytes,
                "step_peak_attention_bytes": llm.engine.stats.max_step_attention_bytes,
                "decode_tokens_per_s": (len(result.token_ids) - 1) / decode_s if decode_s > 0 else None,
                "prefill_s": result.time_to_first_token_s,
            })
            session.close()
        results[str(context)] = {
            "recall": sum(r["recalled"] for r in rows) / len(rows),
            "sustained_kv_bytes": max(r["sustained_kv_bytes"] for r in rows),
            "sustained_global_kv_bytes": max(r["sustained_global_kv_bytes"] for r in rows),
            "tier_bytes": max(r["tier_bytes"] for r in rows),
            "step_peak_attention_bytes": max(r["step_peak_attention_bytes"] for r in rows),
            "decode_tokens_per_s": common.summarize([r["decode_tokens_per_s"] for r in rows if r["decode_tokens_per_s"]]),
            "samples": rows,
        }
        print(policy, llm.config.kv_codec, context, {k: v for k, v in results[str(context)].items() if k != "samples"},
              flush=True)
    return results


def long_session(llm: LLM, policy: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Resident and tier bytes after each 1024-token turn of one growing session."""
    tokenizer = llm.tokenizer
    text = " ".join(filler(tokenizer, args.session_tokens, seed=1))
    ids = tokenizer.encode(text, add_special_tokens=False)[: args.session_tokens]
    session = llm.create_session([], kv_policy=policy, kv_sink_tokens=args.sink, kv_window_tokens=args.window)
    points = []
    for start in range(0, len(ids), 1024):
        session.append(ids[start : start + 1024])
        session.generate(max_tokens=1, temperature=0.0, ignore_eos=True).result()
        info = session.info()
        points.append({"history_tokens": info.history_tokens, "resident_kv_bytes": info.resident_kv_bytes,
                       "global_kv_bytes": info.global_kv_bytes,
                       "tier_bytes": info.host_tier_bytes + info.disk_tier_bytes})
    session.close()
    print(policy, llm.config.kv_codec, "long session", points[-1], flush=True)
    return points


@torch.inference_mode()
def perplexity(llm: LLM, policy: KVPolicy, codec: str, tokens: list[int], chunk: int) -> float:
    """exp(mean negative log-likelihood) of tokens[1:] given their prefixes, under `policy` with `codec` pages."""
    config = llm.engine.model_config
    layout = KVLayout.for_model(config, llm.config.page_size)
    pages = layout.num_groups * (len(tokens) // layout.page_size + 2)
    kv_dtype = llm.config.torch_kv_dtype  # the engine's own page dtype, as its ladder and sessions use
    kv_codec = KVCodec(codec, layout, kv_dtype)
    tiers = PageTiers(kv_codec, pages * kv_codec.page_nbytes)
    kv_format = KVFormat("bench", dtype_name(torch.float32), dtype_name(kv_dtype), codec, layout.page_size)
    cache = KVCache(layout, pages, kv_codec, "cpu", kv_format, tiers)
    runner = ModelRunner(llm.engine.model, cache.storage, tiers=tiers, stream_pages=64)
    return common.teacher_forced_perplexity(cache, runner, Sequence(tokens, PageTable.empty(layout.num_groups, policy)), chunk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rungs", type=common.ints, default=[1024, 2048, 4096], help="context tokens per rung")
    parser.add_argument("--samples", type=int, default=10, help="needle prompts per rung")
    parser.add_argument("--sink", type=int, default=64, help="kv_sink_tokens")
    parser.add_argument("--window", type=int, default=512, help="kv_window_tokens")
    parser.add_argument("--session-tokens", type=int, default=16384)
    parser.add_argument("--ppl-tokens", type=int, default=2048)
    parser.add_argument("--ppl-chunk", type=int, default=256)
    parser.add_argument("--configs", type=lambda text: text.split(","), default=[f"{p}/{c}" for c in CODECS for p in POLICIES],
                        help="policy/codec pairs to measure (default: all); the others are recorded as not run")
    parser.add_argument("--sessions", type=lambda text: text.split(","),
                        default=["full/none", "sink_window/none", "restore/none", "full/int8", "restore/int8"],
                        help="policy/codec pairs whose long session is measured")
    args = common.parse_run_args(parser, "fidelity", "rungs 512,1024, 3 samples, 2048-token session, 512 perplexity tokens",
                                 lambda a: vars(a).update(rungs=[512, 1024], samples=3, session_tokens=2048, ppl_tokens=512))
    _, machine, loaded = common.start("kiln")
    ppl_tokens = loaded.tokenizer.encode((ROOT / PPL_TEXT).read_text())[: args.ppl_tokens]
    results: dict[str, Any] = {}
    sessions: dict[str, Any] = {}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as disk:
        for codec in CODECS:
            with LLM(loaded=loaded, kv_codec=codec, speculative=None, kv_budget_bytes=1024**3, kv_disk_dir=disk,
                     kv_host_budget_mb=256, prefill_chunk_tokens=1024, num_threads=common.THREADS) as llm:
                for policy in POLICIES:
                    key = f"{policy}/{codec}"
                    if key not in args.configs:
                        results[key] = {"not_run": "left out of --configs (for time)"}
                        continue
                    bounded = KVPolicy.create(policy, args.sink, args.window, llm.config.page_size, llm.engine.max_model_len)
                    results[key] = {"ladder": ladder(llm, policy, args),
                                    "perplexity": perplexity(llm, bounded, codec, ppl_tokens, args.ppl_chunk)}
                    if key in args.sessions:
                        sessions[key] = long_session(llm, policy, args)
    reference = results["full/none"]["perplexity"]
    for key, entry in results.items():
        if "perplexity" in entry:
            entry["perplexity_vs_full"] = entry["perplexity"] / reference - 1
            print(key, "perplexity", entry["perplexity"], "delta", entry["perplexity_vs_full"])
    payload = {
        "method": __doc__,
        "settings": {**vars(args), "ppl_text": PPL_TEXT, "ppl_tokens_used": len(ppl_tokens),
                     "wall_s": time.perf_counter() - began},
        "machine": machine,
        "results": results,
        "long_session": sessions,
    }
    print("wrote", common.write_results(args.name, payload))
    print(table(results, [str(r) for r in args.rungs]))
    plot(args.name, results, sessions, args)


def table(results: dict[str, Any], rungs: list[str]) -> str:
    """The trade-off table (markdown): recall and decode tokens/s per rung, perplexity against full, and
    at the last rung the resident, tier and per-step peak bytes."""
    last, reference = rungs[-1], results["full/none"]["ladder"][rungs[-1]]["decode_tokens_per_s"]["median"]
    lines = [f"| policy / codec | recall {' / '.join(rungs)} | perplexity vs full | global KV resident | every layer | "
             f"tier bytes | decode tok/s {' / '.join(rungs)} | vs full | per-step peak |", "|---|---|---|---|---|---|---|---|---|"]
    for key, entry in results.items():
        if "ladder" not in entry:
            lines.append(f"| {key} | not run: {entry['not_run']} |")
            continue
        rung = entry["ladder"]
        speed = [rung[r]["decode_tokens_per_s"]["median"] for r in rungs]
        recall = " / ".join(f"{rung[r]['recall']:.1f}" for r in rungs)
        lines.append(
            f"| {key} | {recall} | {entry['perplexity_vs_full']:+.2%} | "
            f"{rung[last]['sustained_global_kv_bytes'] / 1e6:.2f} MB | {rung[last]['sustained_kv_bytes'] / 1e6:.1f} MB | "
            f"{rung[last]['tier_bytes'] / 1e6:.1f} MB | {' / '.join(f'{v:.1f}' for v in speed)} | {speed[-1] / reference:.2f}x | "
            f"{rung[last]['step_peak_attention_bytes'] / 1e6:.0f} MB |"
        )
    return "\n".join([f"at {last} context tokens:", *lines])


def plot(name: str, results: dict[str, Any], sessions: dict[str, Any], args: argparse.Namespace) -> None:
    plt = common._pyplot()
    if plt is None:
        return
    measured = {key: entry for key, entry in results.items() if "ladder" in entry}
    rungs = [str(r) for r in args.rungs]
    fig, axes = plt.subplots(1, 4, figsize=(22, 5))
    for key, entry in measured.items():
        ladder_ = entry["ladder"]
        axes[0].plot(args.rungs, [ladder_[r]["recall"] for r in rungs], marker="o", label=key)
        axes[1].plot(args.rungs, [ladder_[r]["decode_tokens_per_s"]["median"] for r in rungs], marker="o", label=key)
        axes[2].plot(args.rungs, [ladder_[r]["step_peak_attention_bytes"] / 1e6 for r in rungs], marker="o", label=key)
    for policy, points in sessions.items():
        tokens = [p["history_tokens"] for p in points]
        line = axes[3].plot(tokens, [p["global_kv_bytes"] / 1e6 for p in points], label=f"{policy}: global layers")[0]
        axes[3].plot(tokens, [p["resident_kv_bytes"] / 1e6 for p in points], linestyle="--", color=line.get_color(),
                     label=f"{policy}: every layer")
    titles = [("needle recall", "context tokens"), ("decode tokens/s (median)", "context tokens"),
              ("per-step peak attention MB (accounted)", "context tokens"), ("sustained resident KV MB", "session tokens")]
    axes[3].set_yscale("log")
    for ax, (title, xlabel) in zip(axes, titles, strict=True):
        ax.set(title=title, xlabel=xlabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Embedded Gemma 3 270M: KV policy x codec (sink {args.sink}, window {args.window} tokens)")
    print("wrote", common._save(fig, plt, name))


if __name__ == "__main__":
    main()
