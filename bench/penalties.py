"""What the repetition, presence and frequency penalties and min-p cost (kiln/engine/penalties.py).

Decode: the embedded Gemma 3 270M continues a ~1,500-token history (a Q/A transcript of capitals)
greedily for `--gen-tokens` tokens, speculation off and on, penalties off and on (repetition 1.3,
presence 0.5, frequency 0.5, min-p 0.05). Each variant's reply is timed from its first token to its last
(the prefix cache holds the history, so prefill is out of it); the variants take turns, repeat by
repeat, so load from other processes falls on all alike. The fastest repeat is the headline (the same
work each time: what others' load adds only slows it), the median is recorded beside it. It also records
whether the penalised greedy reply is the same with and without speculation (it must be), and the
engine's sampling time per step (StepSampler.sample: mask, penalties, argmax), which the forward's noise
does not blur.

Per step: what penalising costs by itself, single-threaded, on Gemma's 262,144-token vocabulary, for a
sequence of `--distinct` distinct tokens: one row (a plain decode step) and a 5-token draft's 6 rows
(speculative verification).

Writes bench/results/penalties.json and .png.
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import common
import torch

from kiln import LLM, SamplingParams
from kiln.engine.penalties import Penalties
from kiln.engine.step_sampler import StepSampler
from kiln.engine.stream import GenerationStream

PENALTIES = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_p": 0.05}
COUNTRIES = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"), ("Japan", "Tokyo"),
             ("Egypt", "Cairo"), ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Canada", "Ottawa"), ("Chile", "Santiago")]
VOCAB = 262_144
DRAFT = [11, 12, 13, 14, 15]
KV_BUDGET = 256 << 20  # ample for one 1.6k-token sequence; two engines at the default budget need GBs


def history(llm: LLM, tokens: int) -> list[int]:
    """A Q/A transcript of capitals, repeated to about `tokens` tokens, ending on an open question."""
    turns = "".join(f"Q: What is the capital of {country}?\nA: {city}.\n" for country, city in COUNTRIES)
    ids = llm.tokenizer.encode(turns * (1 + tokens // len(llm.tokenizer.encode(turns))))[:tokens]
    return ids + llm.tokenizer.encode("Q: What is the capital of Norway?\nA:", add_special_tokens=False)


def decode(loaded: object, args: argparse.Namespace) -> dict[str, object]:
    small = {"num_threads": common.THREADS, "kv_budget_bytes": KV_BUDGET}
    llms = {"speculation off": LLM(loaded=loaded, speculative=None, **small), "speculation on": LLM(loaded=loaded, **small)}
    spent = timed_sampling()
    prompt = history(llms["speculation off"], args.history_tokens)
    variants = {(engine, penalised): SamplingParams(max_tokens=args.gen_tokens, ignore_eos=True,
                                                    **(PENALTIES if penalised else {}))
                for engine in llms for penalised in (False, True)}
    per_token: dict[tuple[str, bool], list[float]] = {variant: [] for variant in variants}
    sampling: dict[tuple[str, bool], list[float]] = {variant: [] for variant in variants}
    accepted: dict[tuple[str, bool], int] = {variant: 0 for variant in variants}  # draft tokens, timed repeats
    replies: dict[tuple[str, bool], list[int]] = {}
    for repeat in range(args.repeats + 1):  # the first is a warm-up (and fills the prefix cache)
        for (engine, penalised), params in variants.items():
            llm = llms[engine]
            spent[:] = [0.0, 0]
            before = llm.engine.stats.spec_accepted_tokens
            result = llm.start(prompt, params, GenerationStream(llm.engine.cancel)).result()
            replies[engine, penalised] = result.token_ids
            if repeat:
                per_token[engine, penalised].append((result.total_s - result.time_to_first_token_s) / (len(result.token_ids) - 1))
                sampling[engine, penalised].append(spent[0] / spent[1])
                accepted[engine, penalised] += llm.engine.stats.spec_accepted_tokens - before
    for llm in llms.values():
        llm.close()
    results = {f"{engine}, penalties {'on' if penalised else 'off'}": {
        "ms_per_token_fastest": 1000 * min(times), "ms_per_token_median": 1000 * median(times),
        "ms_per_token": [1000 * t for t in times], "sampling_ms_per_step_median": 1000 * median(sampling[engine, penalised]),
        "accepted_draft_tokens_per_reply": accepted[engine, penalised] / args.repeats}
        for (engine, penalised), times in per_token.items()}
    for engine in llms:
        results[f"{engine}, penalties on"]["over_penalties_off"] = min(per_token[engine, True]) / min(per_token[engine, False])
    return {"history_tokens": len(prompt), "variants": results,
            "penalised_same_with_and_without_speculation": replies["speculation on", True] == replies["speculation off", True],
            "penalties_changed_the_reply": replies["speculation off", True] != replies["speculation off", False]}


def timed_sampling() -> list[float]:
    """[seconds, calls] spent in StepSampler.sample, every engine's, from now on (the caller resets it
    before each generation; one runs at a time)."""
    spent = [0.0, 0]
    sample = StepSampler.sample

    def timed(self: StepSampler, *args: object) -> object:
        start = time.perf_counter()
        try:
            return sample(self, *args)
        finally:
            spent[0] += time.perf_counter() - start
            spent[1] += 1

    StepSampler.sample = timed
    return spent


def step_cost(distinct: list[int], repeats: int) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    params = SamplingParams(**PENALTIES)
    costs: dict[str, dict[str, float]] = {}
    for count in distinct:
        tokens = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(count))[:count].tolist()
        penalties = Penalties.empty(VOCAB, torch.device("cpu"))
        penalties.sync(tokens, tokens[-count // 10 :])
        row, rows = torch.randn(VOCAB), torch.randn(len(DRAFT) + 1, VOCAB)
        costs[str(count)] = {
            "plain_step_ms": 1000 * common.median_seconds(lambda: penalties.apply_(row, params), repeats),  # noqa: B023 - called in the loop
            "draft_step_ms": 1000 * common.median_seconds(lambda: penalties.apply_draft_(rows, DRAFT, params), repeats),  # noqa: B023
        }
        print(f"{count} distinct tokens: {costs[str(count)]}", flush=True)
    torch.set_num_threads(common.THREADS)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--history-tokens", type=int, default=1500)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--distinct", type=common.ints, default=[500, 2000, 8000, 32000])
    args = common.parse_run_args(parser, "penalties", "16 tokens, 1 repeat", _quick)
    _, machine, loaded = common.start("kiln")
    decoded = decode(loaded, args)
    print({key: value for key, value in decoded.items() if key != "variants"}, flush=True)
    for name, result in decoded["variants"].items():
        print(name, {key: value for key, value in result.items() if key != "ms_per_token"}, flush=True)
    steps = step_cost(args.distinct, repeats=50)
    payload = {"method": __doc__, "settings": vars(args), "machine": machine, "decode": decoded, "step_cost": steps}
    print("wrote", common.write_results(args.name, payload))
    variants = decoded["variants"]
    engines = ["speculation off", "speculation on"]
    common.plot_bars(args.name, [
        ("ms per generated token (fastest repeat)", engines,
         {f"penalties {state}": [variants[f"{engine}, penalties {state}"]["ms_per_token_fastest"] for engine in engines]
          for state in ("off", "on")}),
        ("penalising alone, ms per step (1 thread)", [f"{count} distinct" for count in args.distinct],
         {"plain step (1 row)": [steps[str(c)]["plain_step_ms"] for c in args.distinct],
          "5-token draft (6 rows)": [steps[str(c)]["draft_step_ms"] for c in args.distinct]}),
    ], "Penalties and min-p on the embedded Gemma 3 270M (2 threads), and their own cost per step")


def _quick(args: argparse.Namespace) -> None:
    args.gen_tokens, args.repeats, args.distinct = 16, 1, [500, 2000]


if __name__ == "__main__":
    main()
