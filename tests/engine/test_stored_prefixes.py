"""The persistent prefix store through the engine (tiny models, a directory store): a fresh engine over an
earlier engine's store restores the prompt's full pages instead of recomputing them, with bit-identical
logits (deterministic mode) and the same greedy tokens; a session whose K/V was dropped for room restores
its next turn from the store; a fetch never costs more than recomputing: one slower than its patience
leaves the request to recompute while others run, and still helps the prefill under way when it lands;
a failed or corrupt fetch recomputes, counted; another KV format never matches."""

from __future__ import annotations

import argparse
import threading
import time

import pytest
import torch

from kiln import SamplingParams, cli
from kiln.config import EngineConfig
from kiln.engine.stream import GenerationStream
from kiln.errors import InvalidArgumentError, UnavailableError
from kiln.kv.pages import chain_hashes
from tests.snapshots.synthetic import flip_blob_byte

GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def written(llm) -> None:
    """Everything offered so far is in the store (the write-behind is asynchronous)."""
    assert llm.prefix_store.flush()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: sliding-window groups beside the global one
def test_a_fresh_engine_restores_an_earlier_engines_prefix_bit_exactly(tiny_llm, tmp_path, arch):
    options = {"snapshot_dir": str(tmp_path), "deterministic": True, "speculative": None}
    params = {**GREEDY, "logprobs": True, "top_logprobs": 5}
    tokens = prompt(150)
    first = tiny_llm(arch, **options)
    computed = first.generate(tokens, **params)[0]
    written(first)
    first.close()
    again = tiny_llm(arch, **options)  # a restart: an empty pool over the same store
    restored = again.generate(tokens, **params)[0]
    assert again.engine.stats.restored_tokens == restored.usage.reused_tokens == 144  # every full page but the last token's
    assert restored.usage.prefilled_tokens == 6 and again.engine.stats.prefix_fetches["restored"] == 1
    recomputed = tiny_llm(arch, deterministic=True, speculative=None).generate(tokens, **params)[0]
    assert restored.token_ids == computed.token_ids == recomputed.token_ids
    assert restored.logprobs == computed.logprobs == recomputed.logprobs  # bit for bit


def test_the_default_engine_restores_with_the_same_greedy_tokens(tiny_llm, tmp_path):
    tokens = prompt(200, seed=1)
    first = tiny_llm("gemma3", snapshot_dir=str(tmp_path))
    computed = first.generate(tokens, **GREEDY)[0]
    written(first)
    again = tiny_llm("gemma3", snapshot_dir=str(tmp_path))
    restored = again.generate(tokens, **GREEDY)[0]
    assert again.engine.stats.restored_tokens == restored.usage.reused_tokens == 192
    assert restored.token_ids == computed.token_ids


def test_another_kv_format_never_matches(tiny_llm, tmp_path):
    tokens = prompt(100, seed=2)
    first = tiny_llm("llama", snapshot_dir=str(tmp_path))
    first.generate(tokens, **GREEDY)
    written(first)
    coded = tiny_llm("llama", snapshot_dir=str(tmp_path), kv_codec="int8")  # another codec: another prefix space
    out = coded.generate(tokens, **GREEDY)[0]
    assert out.usage.reused_tokens == 0 and coded.engine.stats.prefix_fetches["started"] == 0
    assert out.token_ids == tiny_llm("llama", kv_codec="int8").generate(tokens, **GREEDY)[0].token_ids


def test_a_session_whose_kv_was_dropped_for_room_restores_its_next_turn(tiny_llm, tmp_path):
    turns = [prompt(120, seed=3), prompt(20, seed=4)]

    def converse(llm) -> tuple[list[int], object, int]:
        session = llm.create_session(turns[0])
        session.generate(**GREEDY).result()
        for n in range(4):  # other work takes the whole pool: the idle session's K/V is dropped, cached pages evicted
            llm.generate(prompt(120, seed=10 + n), **GREEDY)
        before = llm.engine.stats.restored_tokens
        session.append(turns[1])
        result = session.generate(**GREEDY).result()
        return result.token_ids, result.usage, llm.engine.stats.restored_tokens - before

    llm = tiny_llm("llama", kv_pages=12, snapshot_dir=str(tmp_path), speculative=None)
    tokens, usage, restored = converse(llm)
    assert llm.engine.stats.kv_dropped_tokens["idle"] > 0
    assert restored == usage.reused_tokens == 112 and usage.prefilled_tokens == usage.prompt_tokens - 112  # 7 full pages
    reference, recomputed, _ = converse(tiny_llm("llama", kv_pages=12, speculative=None))
    assert recomputed.reused_tokens == 0 and recomputed.prefilled_tokens == recomputed.prompt_tokens  # today
    assert tokens == reference


def held_fetch(llm, release: threading.Event):
    """The store's fetch waits for `release` (at most 10 s) before reading."""
    real = llm.prefix_store.fetch

    def fetch(keys):
        release.wait(10)
        return real(keys)

    llm.prefix_store.fetch = fetch


def test_a_fetch_slower_than_recomputing_leaves_the_request_to_recompute_and_holds_no_one(tiny_llm, tmp_path):
    tokens = prompt(150, seed=5)
    first = tiny_llm("llama", snapshot_dir=str(tmp_path))
    expected = first.generate(tokens, **GREEDY)[0].token_ids
    written(first)
    first.close()
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path))
    costs = llm.engine.stored_prefixes.costs
    costs.compute_token_s = 0.5 / 150  # recomputing looks like half a second: the request waits that long
    patience = costs.patience_s(150 // llm.config.page_size * llm.config.page_size)  # for the whole pages stored
    release = threading.Event()
    held_fetch(llm, release)
    started = time.monotonic()
    waiting = llm.start(tokens, SamplingParams(**GREEDY), GenerationStream(llm.engine.cancel))
    other = llm.generate(prompt(40, seed=6), **GREEDY)[0]  # runs while the fetch is stuck
    assert other.usage.generated_tokens == 8 and not waiting.request.admitted_at
    result = waiting.result()
    release.set()
    assert time.monotonic() - started >= patience and result.token_ids == expected
    assert llm.engine.stats.restored_tokens == 0 and result.usage.prefilled_tokens == 150
    assert llm.engine.stats.prefix_fetches["late"] == 1


def test_a_late_fetch_still_shortens_the_prefill_under_way(tiny_llm, tmp_path):
    tokens = prompt(240, seed=7)
    options = {"snapshot_dir": str(tmp_path), "prefill_chunk_tokens": 16, "max_batched_tokens": 16, "speculative": None}
    first = tiny_llm("llama", **options)
    expected = first.generate(tokens, **GREEDY)[0].token_ids
    written(first)
    first.close()
    llm = tiny_llm("llama", **options)
    costs = llm.engine.stored_prefixes.costs
    costs.fetch_page_s, costs.compute_token_s = 0.0, 1e-9  # worth a fetch, but no patience: admitted at once
    real = llm.prefix_store.fetch

    fetched = threading.Event()

    def after_two_steps(keys):
        deadline = time.monotonic() + 10
        while llm.engine.stats.steps < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        try:
            return real(keys)
        finally:
            fetched.set()

    step = llm.engine.step

    def step_once_fetched() -> None:  # on a busy machine the prefill must not finish before the fetch lands
        if llm.engine.stats.steps >= 2:
            fetched.wait(10)
        step()

    llm.prefix_store.fetch = after_two_steps
    llm.engine.step = step_once_fetched
    result = llm.generate(tokens, **GREEDY)[0]
    stats = llm.engine.stats
    assert stats.prefix_fetches["late"] == 1 and stats.prefix_fetches["restored"] == 1
    restored = stats.restored_tokens
    assert 0 < restored < 240 and result.usage.reused_tokens == restored  # computed meanwhile: at most a page more
    assert stats.prefill_tokens <= 240 - restored + 16
    assert result.token_ids == expected


def test_a_failed_or_corrupt_fetch_recomputes_and_is_counted(tiny_llm, tmp_path, monkeypatch):
    tokens = prompt(100, seed=8)
    first = tiny_llm("llama", snapshot_dir=str(tmp_path), speculative=None)
    expected = first.generate(tokens, **GREEDY)[0].token_ids
    written(first)
    first.close()
    down = tiny_llm("llama", snapshot_dir=str(tmp_path), speculative=None)

    def unreachable(digests):
        raise UnavailableError("the snapshot store is unreachable")

    monkeypatch.setattr(down.prefix_store.store, "get_blobs", unreachable)
    out = down.generate(tokens, **GREEDY)[0]
    assert out.token_ids == expected and down.engine.stats.restored_tokens == 0
    assert down.engine.stats.prefix_fetches["failed"] == 1
    store, space = down.prefix_store.store, down.prefix_store.space
    down.close()
    monkeypatch.undo()
    index = {r.chain: r.digest for r in store.prefix_records(space)}
    engine = down.engine
    fourth = chain_hashes(tokens, 16, engine.kv_format.fingerprint() + engine.default_policy.key)[3]
    flip_blob_byte(tmp_path, index[fourth])  # the first three pages restore, the rest is recomputed
    corrupt = tiny_llm("llama", snapshot_dir=str(tmp_path), speculative=None)
    out = corrupt.generate(tokens, **GREEDY)[0]
    assert out.token_ids == expected and corrupt.engine.stats.restored_tokens == out.usage.reused_tokens == 48
    written(corrupt)  # the record of the corrupt blob is gone; recomputed bytes that differ may be stored anew
    assert corrupt.prefix_store.stats.failed_pages == 1
    assert {r.chain: r.digest for r in store.prefix_records(space)}.get(fourth) != index[fourth]
    corrupt.prefix_store.fetch([(0, fourth)])
    assert corrupt.prefix_store.stats.failed_pages == 1


def test_the_budget_flag_and_what_turns_the_store_off(tiny_llm, tmp_path):
    parser = argparse.ArgumentParser()
    cli._engine_args(parser)
    assert cli.engine_options(parser.parse_args(["--prefix-store-mb", "64"]))["prefix_store_mb"] == 64
    assert "prefix_store_mb" not in cli.engine_options(parser.parse_args([]))  # unset: the config's default
    assert tiny_llm("llama", snapshot_dir=str(tmp_path), prefix_store_mb=64).prefix_store.budget_bytes == 64 * 2**20
    assert tiny_llm("llama", snapshot_dir=str(tmp_path / "off"), prefix_store_mb=0).prefix_store is None
    assert tiny_llm("llama").prefix_store is None  # no persistence (kiln serve --no-persist)
    with pytest.raises(InvalidArgumentError, match="prefix_store_mb"):
        EngineConfig(prefix_store_mb=-1)
