"""The persistent prefix store on the embedded model, in process: restoring a prompt's pages from the store
against recomputing them, per page and to the first token (kiln/engine/stored_prefixes.py decides with
these figures: FETCH_PAGE_S, COMPUTE_TOKEN_S, MIN_FETCH_PAGES).

For each `--lengths` (512, 2k, 8k tokens; seeded random ids): one engine writes `--repeats` prompts' pages
behind to a directory store (generating one greedy token each), and closes; a fresh engine over the same
store (a restart) then, for each prompt:
- fetches its pages straight from the prefix store (read, SHA-256 verified, as tensors): seconds per page
  (one KV group's) and per page position (every group's page of 16 tokens);
- fetches one page position alone: what a fetch costs beyond its pages (thread hand-off, a pack opened);
- generates one greedy token from it (the engine restores its full pages and computes the rest) against
  one from another prompt of the same length the store does not hold (recompute), first token's seconds.
The per page position comparison is the decision: fetch wins where a page position's fetch costs less
than computing its 16 tokens. The OS page cache holds the store (it was just written): a cold disk adds
its read time.

Timings are wall seconds on a shared 2-core machine: p50 and p99 (the max for fewer than 100 samples) of
`--repeats` samples; the JSON keeps every sample.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from statistics import median
from typing import Any

import common
from snapshot import percentiles

from kiln.kv.pages import chain_hashes
from kiln.llm import LLM

GREEDY = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
BUDGET_MB = 8192  # every prompt's pages, and the recomputed ones', stay in the store: none is evicted mid-run


def page_keys(llm: LLM, tokens: list[int]) -> list[list[tuple[int, bytes]]]:
    """Per full page of `tokens` (all but the last token's), every KV group's prefix-store key."""
    engine = llm.engine
    page_size = engine.kv_layout.page_size
    salt = engine.kv_format.fingerprint() + engine.policy().key
    hashes = chain_hashes(tokens, page_size, salt, end_page=(len(tokens) - 1) // page_size)
    return [[(group, h) for group in range(engine.kv_layout.num_groups)] for h in hashes]


def measure_length(loaded: Any, length: int, repeats: int, scratch: Path) -> dict[str, Any]:
    store = scratch / f"store-{length}"
    prompts = [common.random_ids(length, seed=length * 100 + r) for r in range(repeats)]
    others = [common.random_ids(length, seed=length * 100 + 50 + r) for r in range(repeats)]
    writer = LLM(loaded=loaded, snapshot_dir=str(store), prefix_store_mb=BUDGET_MB)
    for prompt in prompts:
        writer.generate(prompt, **GREEDY)
    writer.prefix_store.flush()
    writer.close()
    llm = LLM(loaded=loaded, snapshot_dir=str(store), prefix_store_mb=BUDGET_MB)
    fetch_page, fetch_one, restore, recompute, restored = [], [], [], [], []
    for prompt, other in zip(prompts, others, strict=True):
        keys = page_keys(llm, prompt)
        flat = [key for position in keys for key in position]
        seconds, pages = common.timed(llm.prefix_store.fetch, flat)
        assert len(pages) == len(flat), "the store lacks pages it was given"
        fetch_page.append(seconds / len(flat))
        fetch_one.append(common.timed(llm.prefix_store.fetch, keys[len(keys) // 2])[0])
        before = llm.engine.stats.restored_tokens
        restore.append(common.timed(llm.generate, prompt, **GREEDY)[0])
        restored.append(llm.engine.stats.restored_tokens - before)
        recompute.append(common.timed(llm.generate, other, **GREEDY)[0])
        llm.prefix_store.flush()  # the writer stores `other`'s pages between samples, not during one
    groups, page_size = llm.engine.kv_layout.num_groups, llm.engine.kv_layout.page_size
    positions = (length - 1) // page_size
    llm.close()
    fetch_position = [s * groups for s in fetch_page]
    compute_position = [s / length * page_size for s in recompute]
    return {
        "pages_per_position": groups,
        "restored_tokens": restored,
        "fetch_page_s": percentiles(fetch_page),
        "fetch_page_position_s": percentiles(fetch_position),
        "fetch_one_position_s": percentiles(fetch_one),
        "compute_page_position_s": percentiles(compute_position),
        "compute_token_s": percentiles([s / length for s in recompute]),
        "restore_first_token_s": percentiles(restore),
        "recompute_first_token_s": percentiles(recompute),
        "restore_speedup": common.ratio(median(recompute), median(restore)),
        "fetch_overhead_s": max(0.0, median(fetch_one) - median(fetch_position)),
        "full_positions": positions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=common.ints, default=[512, 2048, 8192], help="prompt lengths, tokens")
    parser.add_argument("--repeats", type=int, default=5, help="prompts (samples) per length")

    def quick(args: argparse.Namespace) -> None:
        args.lengths, args.repeats = [512], 2

    args = common.parse_run_args(parser, "prefix_store", "length 512, 2 repeats", quick)
    _, machine, loaded = common.start("kiln")
    lengths = {}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-prefix-store-") as tmp:
        for length in args.lengths:
            row = lengths[str(length)] = measure_length(loaded, length, args.repeats, Path(tmp))
            print(f"{length:>6} tokens: fetch {row['fetch_page_position_s']['p50'] * 1e3:.2f} ms vs compute "
                  f"{row['compute_page_position_s']['p50'] * 1e3:.2f} ms per page position "
                  f"(one position alone {row['fetch_one_position_s']['p50'] * 1e3:.2f} ms); first token "
                  f"{row['restore_first_token_s']['p50']:.3f} s restored vs {row['recompute_first_token_s']['p50']:.3f} s "
                  f"recomputed ({row['restore_speedup']:.1f}x)", flush=True)
    payload = {"benchmark": "prefix_store", "machine": machine, "args": vars(args), "lengths": lengths}
    print(f"wrote {common.write_results(args.name, payload)}")
    labels = list(lengths)
    common.plot_bars(args.name, [
        ("milliseconds per page position (16 tokens, every KV group; p50)", labels, {
            "fetch from the store": [lengths[k]["fetch_page_position_s"]["p50"] * 1e3 for k in labels],
            "recompute": [lengths[k]["compute_page_position_s"]["p50"] * 1e3 for k in labels],
        }),
        ("seconds to the first token (p50)", labels, {
            "pages restored from the store": [lengths[k]["restore_first_token_s"]["p50"] for k in labels],
            "recomputed": [lengths[k]["recompute_first_token_s"]["p50"] for k in labels],
        }),
    ], "Persistent prefix store on the embedded model, by prompt length (tokens), after a restart")


if __name__ == "__main__":
    main()
