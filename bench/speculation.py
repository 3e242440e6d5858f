"""What n-gram speculative decoding gains and what it can cost: the scripted agent session of
long_session.py, in process, per-turn latency with speculation off, on, and on with drafts that are
always wrong (the worst case: every draft verified and rejected, nothing accepted).

The always-wrong drafts replace each n-gram draft's tokens with an id the model never picks here (the
last of the vocabulary, a multimodal placeholder), so the proposer's own backoff still decides when a
draft is tried, exactly as it would for drafts that miss. Each variant is its own engine; the variants
take turns turn by turn, so load from other processes falls on all alike. Latency: wall time from
handing over a turn's ids to its last token. Headline: median over turns of each variant's latency
over the speculation-off latency of the same turn.

Writes bench/results/speculation.json and .png.
"""

from __future__ import annotations

import argparse
import time
from statistics import median
from typing import Any

import common
from long_session import scripted_turns

from kiln import LLM, SamplingParams
from kiln.engine.speculative import NgramProposer

VARIANTS = ("off", "ngram", "ngram, always wrong")


class WrongDrafts(NgramProposer):
    """The n-gram proposer's drafts (and backoff), every token replaced by one the model never picks."""

    def __init__(self, num_tokens: int, never: int) -> None:
        super().__init__(num_tokens)
        self.never = never

    def propose(self, request: Any, limit: int) -> list[int]:
        return [self.never] * len(super().propose(request, limit))


def engines(loaded: Any) -> dict[str, LLM]:
    made = {
        "off": LLM(loaded=loaded, num_threads=common.THREADS, speculative=None),
        "ngram": LLM(loaded=loaded, num_threads=common.THREADS),
        "ngram, always wrong": LLM(loaded=loaded, num_threads=common.THREADS),
    }
    wrong = made["ngram, always wrong"].engine
    wrong._proposer = WrongDrafts(wrong.config.num_speculative_tokens, loaded.config.vocab_size - 1)
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=60)
    parser.add_argument("--new-tokens", type=int, default=50)
    parser.add_argument("--gen-tokens", type=int, default=24)
    args = common.parse_run_args(parser, "speculation", "8 turns", _quick)
    _, machine, loaded = common.start("kiln")
    turns = scripted_turns(loaded, args.turns, args.new_tokens, seed=0)
    llms = engines(loaded)
    sessions = {name: llm.create_session() for name, llm in llms.items()}
    params = SamplingParams(max_tokens=args.gen_tokens, temperature=0.0, ignore_eos=True)
    latency: dict[str, list[float]] = {name: [] for name in llms}
    outputs: dict[str, list[list[int]]] = {name: [] for name in llms}
    for ids in turns:
        for name, session in sessions.items():
            start = time.perf_counter()
            session.append(ids)
            outputs[name].append(session.generate(params).result().token_ids)
            latency[name].append(time.perf_counter() - start)
    results = {}
    for name, llm in llms.items():
        stats = llm.engine.stats
        results[name] = {
            "turn_latency_median_s": median(latency[name]),
            "over_off_median": median(x / y for x, y in zip(latency[name], latency["off"], strict=True)),
            "same_tokens_as_off": outputs[name] == outputs["off"],
            "verify_steps": stats.spec_verify_steps,
            "proposed_tokens": stats.spec_proposed_tokens,
            "accepted_tokens": stats.spec_accepted_tokens,
            "per_turn_s": latency[name],
        }
        llm.close()
        print(name, {k: v for k, v in results[name].items() if k != "per_turn_s"}, flush=True)
    payload = {"method": __doc__, "settings": vars(args), "machine": machine, "results": results}
    print("wrote", common.write_results(args.name, payload))
    common.plot_lines(args.name, {name: (list(range(1, len(turns) + 1)), [1000 * x for x in r["per_turn_s"]])
                                  for name, r in results.items()},
                      "turn", "turn latency (ms)", "Speculative decoding on the scripted agent session (2 threads)")


def _quick(args: argparse.Namespace) -> None:
    args.turns = 8


if __name__ == "__main__":
    main()
