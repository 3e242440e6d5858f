"""Snapshot save and restore on the embedded model, in process, and what persistence costs a turn.

For each `--lengths` (512, 2k, 8k tokens: seeded random ids, prefilled by generating one greedy token):
- full save: the session's first snapshot into an empty store (every page copied out, hashed, packed
  into one file, synced), `--repeats` times, each into a fresh directory;
- incremental save: one more turn (append 32 ids, generate 16 greedy tokens), then a snapshot into the
  store that holds the previous one: only the turn's new pages and its partial last page are written;
- restore: read, verify (digests, shapes) and load the full snapshot into a new session, and the same
  plus its first generated token, against re-prefilling the same history in a fresh session (other
  seeded ids, so the prefix cache does not help) plus its first token;
- bytes: stored pack bytes per history token, stored over raw page bytes, and the codec the saves chose.
Then what zstd would save per KV codec (none = float16 pages here, int8, int4): a 512-token session's
pages compressed at blobs.LEVEL, compressed over raw bytes and milliseconds per MiB, the figures
blobs.choose_codec decides on.
Then the auto-snapshot overhead: two sessions of a 2k-token prompt, `--turns` turns each (append 32 ids,
generate 32 greedy tokens), one on an engine that persists every turn in the background and one that
does not, turns interleaved; the headline is the median turn latency with persistence over without.

Timings are wall seconds on a shared 2-core machine: p50 and p99 (the max for fewer than 100 samples)
of `--repeats` samples; the JSON keeps every sample.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from statistics import median
from typing import Any

import common

from kiln.llm import LLM
from kiln.snapshots import blobs
from kiln.snapshots.persistence import Persistence
from kiln.snapshots.store import open_store

TURN_APPEND, TURN_GENERATE = 32, 16
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def percentiles(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] if ordered else None
    return {"p50": median(ordered) if ordered else None, "p99": p99, "samples": values}


def directory_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "packs").glob("*.pack"))


def checkpoint(llm: LLM, persistence: Persistence, session_id: str) -> str:
    """A checkpoint into `persistence`'s store, copying only pages it has not saved before."""
    return persistence.checkpoint(llm.sessions.capture(session_id, None, persistence.known(session_id)))


def measure_length(llm: LLM, length: int, repeats: int, scratch: Path) -> dict[str, Any]:
    session = llm.create_session(common.random_ids(length, seed=length))
    session.generate(max_tokens=1, **GREEDY).result()
    full, restore, restore_first = [], [], []
    main = scratch / f"main-{length}"
    persistence = Persistence(open_store(main), llm.engine)
    snapshot_id = checkpoint(llm, persistence, session.id)
    stored = directory_bytes(main)
    manifest = persistence.store.require_manifest(snapshot_id)
    for repeat in range(repeats):
        fresh = Persistence(open_store(scratch / f"full-{length}-{repeat}"), llm.engine)
        seconds, _ = common.timed(checkpoint, llm, fresh, session.id)
        full.append(seconds)
        fresh.close()
        seconds, restored_id = common.timed(lambda: llm.sessions.adopt(persistence.open_checkpoint(snapshot_id, None)))
        restore.append(seconds)
        restored = llm.get_session(restored_id)
        first, _ = common.timed(lambda s=restored: s.generate(max_tokens=1, **GREEDY).result())
        restore_first.append(seconds + first)
        restored.close()
    prefill = []
    for repeat in range(repeats):
        other = llm.create_session(common.random_ids(length, seed=10_000 + 100 * length + repeat))
        seconds, _ = common.timed(lambda s=other: s.generate(max_tokens=2, **GREEDY).result())
        prefill.append(seconds)
        other.close()
    incremental, written = [], []
    for repeat in range(repeats):
        session.append(common.random_ids(TURN_APPEND, seed=repeat))
        session.generate(max_tokens=TURN_GENERATE, **GREEDY).result()
        before = persistence.stats.bytes_written
        seconds, _ = common.timed(checkpoint, llm, persistence, session.id)
        incremental.append(seconds)
        written.append(persistence.stats.bytes_written - before)
    persistence.close()
    session.close()
    history = len(manifest.token_ids)
    return {
        "history_tokens": history,
        "pages": manifest.page_count(),
        "save_full_s": percentiles(full),
        "save_incremental_s": percentiles(incremental),
        "incremental_bytes_written": written,
        "restore_s": percentiles(restore),
        "restore_and_first_token_s": percentiles(restore_first),
        "reprefill_and_first_token_s": percentiles(prefill),
        "restore_speedup": common.ratio(median(prefill), median(restore_first)),
        "stored_bytes_per_token": stored / history,
        "stored_over_raw": stored / (manifest.page_count() * llm.engine.kv_page_bytes),
        "codec": manifest.codec,
    }


def measure_codecs(loaded: Any, length: int = 512) -> dict[str, Any]:
    """zstd over raw bytes, and its speed, on a session's pages under each KV codec."""
    found = {}
    for kv_codec in ("none", "int8", "int4"):
        llm = LLM(loaded=loaded, kv_codec=kv_codec)
        session = llm.create_session(common.random_ids(length, seed=length))
        session.generate(max_tokens=1, **GREEDY).result()
        pages = [block.numpy().tobytes() for block in llm.sessions.capture(session.id).image.blocks.values()]
        seconds, packed = common.timed(lambda pages=pages: [blobs.compress(page) for page in pages])
        raw = sum(len(page) for page in pages)
        found[kv_codec] = {"pages": len(pages), "page_bytes": len(pages[0]), "zstd_over_raw": sum(map(len, packed)) / raw,
                           "zstd_ms_per_mib": seconds * 1e3 / (raw / 2**20), "chosen": blobs.choose_codec(pages)}
        llm.close()
    return found


def measure_overhead(loaded: Any, turns: int, scratch: Path) -> dict[str, Any]:
    """Median turn latency of a persisting engine over one that does not, turns interleaved."""
    plain = LLM(loaded=loaded)
    persisting = LLM(loaded=loaded, snapshot_dir=str(scratch / "auto"))
    saves: list[float] = []
    persisting.snapshots.add_observer(lambda op, seconds: saves.append(seconds) if op == "save" else None)
    prompt = common.random_ids(2048, seed=7)
    sessions = {"off": plain.create_session(prompt), "on": persisting.create_session(prompt)}
    latencies: dict[str, list[float]] = {"off": [], "on": []}
    for turn in range(turns + 1):
        for name, session in sessions.items():
            if turn:
                session.append(common.random_ids(TURN_APPEND, seed=turn))
            seconds, _ = common.timed(lambda s=session: s.generate(max_tokens=32, **GREEDY).result())
            if turn:  # the first turn prefills the prompt: not a steady-state turn
                latencies[name].append(seconds)
    persisting.snapshots.flush()
    plain.close()
    persisting.close()
    on, off = median(latencies["on"]), median(latencies["off"])
    return {"turn_latency_s": {name: percentiles(values) for name, values in latencies.items()},
            "overhead": on / off - 1, "background_save_s": percentiles(saves)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=common.ints, default=[512, 2048, 8192], help="history lengths, tokens")
    parser.add_argument("--repeats", type=int, default=9, help="samples per timing")
    parser.add_argument("--turns", type=int, default=16, help="timed turns per system of the overhead session")

    def quick(args: argparse.Namespace) -> None:
        args.lengths, args.repeats, args.turns = [512, 2048], 3, 4

    args = common.parse_run_args(parser, "snapshot", "lengths 512,2048, 3 repeats, 4 turns", quick)
    _, machine, loaded = common.start("kiln")
    with tempfile.TemporaryDirectory(prefix="kiln-bench-snapshot-") as tmp:
        scratch = Path(tmp)
        llm = LLM(loaded=loaded)
        lengths = {}
        for length in args.lengths:
            lengths[str(length)] = measure_length(llm, length, args.repeats, scratch)
            row = lengths[str(length)]
            print(f"{length:>6} tokens: save full p50 {row['save_full_s']['p50'] * 1e3:.1f} ms, incremental "
                  f"{row['save_incremental_s']['p50'] * 1e3:.1f} ms, restore {row['restore_s']['p50'] * 1e3:.1f} ms, "
                  f"restore+token vs re-prefill {row['restore_speedup']:.1f}x, "
                  f"{row['stored_bytes_per_token'] / 1024:.1f} KiB/token stored ({row['codec']})", flush=True)
        llm.close()
        codecs = measure_codecs(loaded)
        for name, row in codecs.items():
            print(f"kv codec {name}: zstd keeps {row['zstd_over_raw'] * 100:.0f} % of {row['page_bytes'] // 1024} KiB pages at "
                  f"{row['zstd_ms_per_mib']:.2f} ms/MiB -> stored {row['chosen']}", flush=True)
        overhead = measure_overhead(loaded, args.turns, scratch)
        print(f"auto-snapshot overhead per turn: {overhead['overhead'] * 100:+.1f} % (median turn "
              f"{overhead['turn_latency_s']['on']['p50']:.3f} s vs {overhead['turn_latency_s']['off']['p50']:.3f} s)")
    payload = {"benchmark": "snapshot", "machine": machine, "args": vars(args), "lengths": lengths,
               "kv_codecs": codecs, "auto_snapshot": overhead}
    print(f"wrote {common.write_results(args.name, payload)}")
    labels = list(lengths)
    common.plot_bars(args.name, [
        ("milliseconds (p50)", labels, {
            "save (full)": [lengths[k]["save_full_s"]["p50"] * 1e3 for k in labels],
            "save (incremental)": [lengths[k]["save_incremental_s"]["p50"] * 1e3 for k in labels],
            "restore": [lengths[k]["restore_s"]["p50"] * 1e3 for k in labels],
        }),
        ("seconds to the first token (p50)", labels, {
            "restore + first token": [lengths[k]["restore_and_first_token_s"]["p50"] for k in labels],
            "re-prefill + first token": [lengths[k]["reprefill_and_first_token_s"]["p50"] for k in labels],
        }),
    ], "KV snapshots of the embedded model by history length (tokens)")


if __name__ == "__main__":
    main()
