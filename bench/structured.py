"""Structured output on the embedded Gemma 3 270M: what grammar-constrained decoding costs.

- library: the two libraries made for this, on the 262,144-token vocabulary (llguidance, which Kiln
  uses, and xgrammar when it is installed: `pip install xgrammar`, which pulls in triton): seconds to
  index the tokenizer, milliseconds to compile each schema of SCHEMAS (cold, then again), and
  microseconds to compute one token mask while walking a valid document of each schema token by token
  (median over the tokens).
- compile: Kiln's ConstraintCompiler on a fresh vocabulary index: per schema the first compile and a
  cached one (the content-keyed cache), median over `--repeats` fresh compilers.
- decode: tokens/s of one greedy generation constrained to a realistic tool's arguments schema
  (TOOL_SCHEMA) against the same prompt unconstrained, generating exactly as many tokens (ignore_eos),
  at batch 1 and `--batch`; tokens/s = batch x (tokens - 1) / (total - time to first token), median of
  `--repeats` runs after an untimed warm-up, the two taking turns run by run. Two engines: speculative
  decoding off (what the grammar itself costs) and the default configuration (n-gram speculation on,
  which constrained requests do not get drafts from yet).

Target: constrained decode >= 90 % of unconstrained. Writes bench/results/structured.json and .png.
`--quick`: 2 repeats.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import time
from statistics import median
from typing import Any

import common
import llguidance
import numpy as np

from kiln import LLM, SamplingParams
from kiln.engine.constraints import JSON_LAYOUT, Constraint, ConstraintCompiler
from kiln.engine.stream import GenerationStream

TOOL_SCHEMA = {  # the arguments of a flight-search tool, as an agent framework would declare them
    "type": "object",
    "properties": {
        "origin": {"type": "string", "description": "IATA code", "pattern": "^[A-Z]{3}$"},
        "destination": {"type": "string", "description": "IATA code", "pattern": "^[A-Z]{3}$"},
        "date": {"type": "string", "format": "date"},
        "passengers": {"type": "object", "properties": {"adults": {"type": "integer", "minimum": 1, "maximum": 9},
                                                        "children": {"type": "integer", "minimum": 0, "maximum": 9}},
                       "required": ["adults", "children"], "additionalProperties": False},
        "cabin": {"enum": ["economy", "premium", "business", "first"]},
        "max_price": {"type": "integer", "minimum": 0, "maximum": 20000},
        "airlines": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
        "notes": {"type": "string", "maxLength": 60},
    },
    "required": ["origin", "destination", "date", "passengers", "cabin", "max_price", "airlines", "notes"],
    "additionalProperties": False,
}
SCHEMAS = {  # name -> (schema, a valid document: the walk that times the masks)
    "flight_tool": (TOOL_SCHEMA, {"origin": "CDG", "destination": "JFK", "date": "2026-05-01",
                                  "passengers": {"adults": 2, "children": 1}, "cabin": "economy", "max_price": 1250,
                                  "airlines": ["Air France", "Delta"], "notes": "aisle seats if possible"}),
    "weather_tool": ({"type": "object", "properties": {"city": {"type": "string"},
                                                       "unit": {"enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"], "additionalProperties": False},
                     {"city": "Paris", "unit": "celsius"}),
    "nested": ({"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "address": {"type": "object", "properties": {"street": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"]}}, "required": ["name", "age", "address"]},
        "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["user", "tags"]},
        {"user": {"name": "Ada", "age": 36, "address": {"street": "12 St James's Square", "zip": "12345"}},
         "tags": ["math", "poetry"]}),
    "numbers_array": ({"type": "array", "items": {"type": "object", "properties": {
        "x": {"type": "number"}, "y": {"type": "number"}, "label": {"enum": ["a", "b", "c"]}},
        "required": ["x", "y", "label"]}, "minItems": 1}, [{"x": 1.5, "y": -2, "label": "a"}, {"x": 3.25, "y": 4000, "label": "c"}]),
    "any_of": ({"type": "object", "properties": {"result": {"anyOf": [{"type": "string"}, {"type": "integer"},
                                                                       {"type": "null"}]}, "ok": {"type": "boolean"}},
                "required": ["result", "ok"]}, {"result": None, "ok": True}),
}
PROMPT = ("<start_of_turn>user\nFind me a flight from Paris to New York on May 1st for two adults and a child, "
          "economy, under 1300 dollars. Reply with the search tool's arguments as JSON.<end_of_turn>\n"
          "<start_of_turn>model\n")


def walk_ids(tokenizer, document: object) -> list[int]:  # noqa: ANN001 - kiln Tokenizer
    """A valid document's tokens, in the layout every JSON is generated in."""
    return tokenizer.encode(json.dumps(document), add_special_tokens=False)


def library_llguidance(tokenizer, vocab: int) -> dict[str, Any]:  # noqa: ANN001
    started = time.perf_counter()
    index = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=list(tokenizer.eos_token_ids))
    result: dict[str, Any] = {"status": "ok", "version": importlib.metadata.version("llguidance"),
                              "tokenizer_index_s": time.perf_counter() - started, "schemas": {}}
    mask = np.zeros((vocab + 31) // 32, dtype=np.int32)
    for name, (schema, document) in SCHEMAS.items():
        times = []
        for _ in range(2):  # llguidance keeps no cache: both are cold compiles
            started = time.perf_counter()
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)
            matcher = llguidance.LLMatcher(index, grammar)
            times.append(time.perf_counter() - started)
        masks = []
        for token in walk_ids(tokenizer, document):
            started = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            masks.append(time.perf_counter() - started)
            assert mask[token // 32] >> (token % 32) & 1 and matcher.consume_token(token), (name, token)
        result["schemas"][name] = {"compile_ms": times[0] * 1e3, "compile_again_ms": times[1] * 1e3,
                                   "mask_us_median": median(masks) * 1e6, "mask_us_max": max(masks) * 1e6,
                                   "tokens": len(masks)}
    return result


def library_xgrammar(tokenizer, vocab: int) -> dict[str, Any]:  # noqa: ANN001
    if importlib.util.find_spec("xgrammar") is None:
        return {"status": "skipped", "reason": "xgrammar is not installed (pip install xgrammar; it pulls in triton)"}
    import xgrammar

    started = time.perf_counter()
    pieces = [tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
    info = xgrammar.TokenizerInfo(pieces, xgrammar.VocabType.BYTE_FALLBACK, vocab_size=vocab,
                                  stop_token_ids=list(tokenizer.eos_token_ids))
    compiler = xgrammar.GrammarCompiler(info, max_threads=common.THREADS)
    result: dict[str, Any] = {"status": "ok", "version": importlib.metadata.version("xgrammar"),
                              "tokenizer_index_s": time.perf_counter() - started, "schemas": {}}
    mask = xgrammar.allocate_token_bitmask(1, vocab)
    for name, (schema, document) in SCHEMAS.items():
        times = []
        for _ in range(2):  # the second hits xgrammar's own compile cache
            started = time.perf_counter()
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
            times.append(time.perf_counter() - started)
        matcher, masks = xgrammar.GrammarMatcher(compiled), []
        for token in walk_ids(tokenizer, document):
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            masks.append(time.perf_counter() - started)
            assert int(mask[0, token // 32]) >> (token % 32) & 1 and matcher.accept_token(token), (name, token)
        result["schemas"][name] = {"compile_ms": times[0] * 1e3, "compile_again_ms": times[1] * 1e3,
                                   "mask_us_median": median(masks) * 1e6, "mask_us_max": max(masks) * 1e6,
                                   "tokens": len(masks)}
    return result


def compile_times(llm: LLM, repeats: int) -> dict[str, Any]:
    """Kiln's compile path (validation, compile, cache) per schema: first and cached, on fresh compilers
    whose tokenizer index is built beforehand (it is built once per process and warmed by `kiln serve`)."""
    first: dict[str, list[float]] = {name: [] for name in SCHEMAS}
    cached: dict[str, list[float]] = {name: [] for name in SCHEMAS}
    for _ in range(repeats):
        compiler = ConstraintCompiler(llm.tokenizer, llm.engine.model_config.vocab_size)
        compiler.warm()
        for name, (schema, _) in SCHEMAS.items():
            constraint = Constraint.json_schema(schema)
            first[name].append(common.timed(compiler.compile, constraint)[0] * 1e3)
            cached[name].append(common.timed(compiler.compile, Constraint.json_schema(schema))[0] * 1e3)
    return {"first_ms": {name: median(v) for name, v in first.items()},
            "cached_ms": {name: median(v) for name, v in cached.items()},
            "first_ms_p50_over_schemas": median(median(v) for v in first.values()),
            "cached_ms_p50_over_schemas": median(median(v) for v in cached.values())}


def decode_run(llm: LLM, prompt: list[int], batch: int, tokens: int | None) -> tuple[float, int, str]:
    """(decode tokens/s, tokens per generation, first reply's text): constrained when `tokens` is None
    (the schema ends it), else unconstrained for exactly `tokens` tokens."""
    params = (SamplingParams(max_tokens=400, constraint=Constraint.json_schema(TOOL_SCHEMA))
              if tokens is None else SamplingParams(max_tokens=tokens, ignore_eos=True))
    streams = [llm.start(prompt, params, GenerationStream(llm.engine.cancel)) for _ in range(batch)]
    results = [stream.result() for stream in streams]
    generated = len(results[0].token_ids)
    decode_s = max(r.total_s for r in results) - min(r.time_to_first_token_s for r in results)
    return batch * (generated - 1) / decode_s, generated, llm.tokenizer.decode(results[0].token_ids)


def decode(llm: LLM, batches: list[int], repeats: int) -> dict[str, Any]:
    prompt = llm.tokenizer.encode(PROMPT)
    decode_run(llm, prompt, 1, None)  # warm-up: compile, caches
    out: dict[str, Any] = {}
    for batch in batches:
        constrained, free, lengths, text = [], [], [], ""
        for _ in range(repeats):
            rate, generated, text = decode_run(llm, prompt, batch, None)
            constrained.append(rate)
            lengths.append(generated)
            free.append(decode_run(llm, prompt, batch, generated)[0])
        out[str(batch)] = {"constrained_tokens_per_s": common.summarize(constrained),
                           "unconstrained_tokens_per_s": common.summarize(free),
                           "tokens_per_generation": lengths, "constrained_reply": text,
                           "ratio": median(constrained) / median(free)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="the second batch size measured (besides 1)")
    args = common.parse_run_args(parser, "structured", "2 repeats", lambda a: setattr(a, "repeats", 2))
    common.set_threads()
    common.warn_if_busy()
    machine = common.machine_info()
    machine["llguidance"] = importlib.metadata.version("llguidance")
    with LLM(speculative=None) as llm:
        vocab = llm.engine.model_config.vocab_size
        libraries = {"llguidance": library_llguidance(llm.tokenizer, vocab),
                     "xgrammar": library_xgrammar(llm.tokenizer, vocab)}
        compiled = compile_times(llm, args.repeats)
        decoded = {"speculative_off": decode(llm, [1, args.batch], args.repeats)}
    with LLM() as llm:
        decoded["default_config"] = decode(llm, [1, args.batch], args.repeats)
    ratios = [entry["ratio"] for entry in decoded["speculative_off"].values()]
    payload = {
        "benchmark": "structured", "machine": machine, "args": vars(args), "vocab_size": vocab,
        "method": {"decode": "batch x (tokens - 1) / (last finish - first token), constrained to TOOL_SCHEMA vs the "
                             "same prompt unconstrained for as many tokens (ignore_eos); greedy; median of repeats",
                   "compile": "ConstraintCompiler.compile per schema on fresh compilers with a built tokenizer index",
                   "library": "tokenizer index build, schema compile, mask per token over a valid document"},
        "libraries": libraries, "compile": compiled, "decode": decoded,
        "targets": {"constrained_over_unconstrained_min": 0.9, "constrained_over_unconstrained": min(ratios),
                    "met": min(ratios) >= 0.9, "measured_on": "speculative_off (the grammar's own cost)"},
    }
    path = common.write_results(args.name, payload)
    print(json.dumps({"compile": compiled, "targets": payload["targets"]}, indent=1))
    print(f"wrote {path}")
    names = list(SCHEMAS)
    panels = [
        ("schema compile, ms (median)", names, {"first compile": [compiled["first_ms"][n] for n in names],
                                               "cached": [compiled["cached_ms"][n] for n in names]}),
        ("mask per token, us (median)", names, {lib: [r["schemas"][n]["mask_us_median"] if r["status"] == "ok" else None
                                                      for n in names] for lib, r in libraries.items()}),
        ("decode tokens/s (median)", [f"{config}\nbatch {b}" for config, runs in decoded.items() for b in runs],
         {"unconstrained": [d["unconstrained_tokens_per_s"]["median"] for runs in decoded.values() for d in runs.values()],
          "constrained (flight tool schema)": [d["constrained_tokens_per_s"]["median"]
                                               for runs in decoded.values() for d in runs.values()]}),
    ]
    common.plot_bars(args.name, panels, "Grammar-constrained decoding on Gemma 3 270M (262,144-token vocabulary)")


if __name__ == "__main__":
    main()
