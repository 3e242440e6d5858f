"""Decode speed of `kv_policy="restore"` against `"full"` on the embedded Gemma 3 270M: greedy decodes of
`--tokens` tokens after a history of `--history` tokens (seeded filler from bench/fidelity.py), with and
without speculative decoding, the two policies' samples interleaved (which goes first alternates) so that
both see the same machine load.

Why: `restore` keeps a bounded resident set (sink + window) and reads the rest of a global layer's keys
from the host or disk tier, exactly. Its decode should cost what `full`'s does (issue 28, goal 2: at
least 0.9x at 8k and 16k tokens). Each sample: a fresh session of the history (prefill, not timed), then
one generation of `--tokens` tokens; tokens/s counts the tokens after the first over the time after the
first. Also checks the two policies' greedy replies are the same tokens.

Writes bench/results/restore_speed.{json,png} and prints a table: per history and speculation, tok/s of each
policy (median of `--repeats`) and their ratio. `--quick`: a 2048-token history, 16 tokens, 1 repeat.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import common
from fidelity import filler

from kiln import LLM


def decode(llm: LLM, ids: list[int], policy: str, args: argparse.Namespace) -> tuple[float, list[int]]:
    """(tokens/s after the first, the reply's tokens) of one fresh session under `policy`."""
    session = llm.create_session(ids, kv_policy=policy, kv_sink_tokens=args.sink, kv_window_tokens=args.window)
    result = session.generate(max_tokens=args.tokens, temperature=0.0, ignore_eos=True).result()
    session.close()
    decode_s = result.total_s - (result.time_to_first_token_s or 0.0)
    return (len(result.token_ids) - 1) / decode_s, list(result.token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--histories", type=common.ints, default=[8192, 16384], help="history tokens before the decode")
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens decoded per sample")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sink", type=int, default=64, help="kv_sink_tokens")
    parser.add_argument("--window", type=int, default=512, help="kv_window_tokens")
    args = common.parse_run_args(parser, "restore_speed", "a 2048-token history, 16 tokens, 1 repeat",
                                 lambda a: vars(a).update(histories=[2048], tokens=16, repeats=1))
    _, machine, loaded = common.start("kiln")
    results: dict[str, Any] = {}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as disk:
        for speculative in ("ngram", None):
            with LLM(loaded=loaded, speculative=speculative, kv_budget_bytes=1024**3, kv_disk_dir=disk, kv_host_budget_mb=512,
                     prefill_chunk_tokens=1024, num_threads=common.THREADS) as llm:
                for history in args.histories:
                    text = " ".join(filler(llm.tokenizer, history, seed=history))
                    ids = llm.tokenizer.encode(text)[:history]
                    speeds: dict[str, list[float]] = {"full": [], "restore": []}
                    replies: set[tuple[int, ...]] = set()
                    for repeat in range(args.repeats):
                        for policy in ("full", "restore") if repeat % 2 == 0 else ("restore", "full"):
                            speed, reply = decode(llm, ids, policy, args)
                            speeds[policy].append(speed)
                            replies.add(tuple(reply))
                    entry = {policy: common.summarize(values) for policy, values in speeds.items()}
                    entry["ratio"] = common.ratio(entry["restore"]["median"], entry["full"]["median"])
                    entry["same_reply"] = len(replies) == 1
                    results[f"{history}/{speculative or 'off'}"] = entry
                    print(history, speculative, {k: v for k, v in entry.items()}, flush=True)
    payload = {"method": __doc__, "settings": {**vars(args), "wall_s": time.perf_counter() - began}, "machine": machine,
               "results": results}
    print("wrote", common.write_results(args.name, payload))
    plot(args.name, results)
    print("| history | speculation | full tok/s | restore tok/s | restore / full | same reply |")
    print("|---|---|---|---|---|---|")
    for key, entry in results.items():
        history, speculative = key.split("/")
        print(f"| {history} | {speculative} | {entry['full']['median']:.1f} | {entry['restore']['median']:.1f} | "
              f"{entry['ratio']:.2f}x | {entry['same_reply']} |")


def plot(name: str, results: dict[str, Any]) -> None:
    """Tokens/s of each policy per (history, speculation), one panel per speculation setting."""
    panels = []
    for speculative in dict.fromkeys(key.split("/")[1] for key in results):
        keys = [key for key in results if key.endswith("/" + speculative)]
        panels.append((f"decode tokens/s, speculation {speculative}", [f"{key.split('/')[0]} tokens" for key in keys],
                       {policy: [results[key][policy]["median"] for key in keys] for policy in ("full", "restore")}))
    common.plot_bars(name, panels, 'kv_policy "restore" against "full" after a long history (embedded model)')


if __name__ == "__main__":
    main()
