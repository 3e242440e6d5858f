"""KV memory policies through the engine and sessions: `restore` gives `full`'s greedy tokens with a
bounded resident set, `sink_window` bounds it and forgets, per-session policies, bad options refused
with nothing changed."""

import pytest

from kiln.config import EngineConfig
from kiln.errors import InvalidArgumentError, ResourceExhaustedError
from kiln.kv.policy import KVPolicy
from kiln.server.metrics import Metrics
from tests.engine.test_engine import prompts

BOUNDED = {"kv_sink_tokens": 8, "kv_window_tokens": 32}
PAGE = 8


def greedy(session, n: int = 24) -> list[int]:
    return session.generate(max_tokens=n, temperature=0.0, ignore_eos=True).result().token_ids


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_restore_session_matches_full_with_bounded_resident_pages(tiny_llm, arch):
    llm = tiny_llm(arch, page_size=PAGE, speculative=None, max_batched_tokens=64, prefill_chunk_tokens=64)
    history = prompts(1, 300, seed=4)[0]
    full = llm.create_session(history)
    restored = llm.create_session(history, kv_policy="restore", **BOUNDED)
    assert greedy(restored) == greedy(full)
    full.append(history[:40])
    restored.append(history[:40])
    assert greedy(restored) == greedy(full)  # a second turn over tier pages
    info = restored.info()
    assert (info.kv_policy, info.kv_sink_tokens, info.kv_window_tokens) == ("restore", 8, 32)
    assert info.host_tier_bytes > 0 and info.disk_tier_bytes == 0
    assert info.resident_kv_bytes < full.info().resident_kv_bytes / 3
    limit = KVPolicy("restore", 8, 32).resident_limit(PAGE)  # per group (gemma3's window groups keep fewer)
    assert info.resident_pages <= limit * (1 if arch == "llama" else 3)
    assert 0 < info.global_kv_bytes <= limit * llm.engine.kv_page_bytes
    assert llm.engine.stats.max_step_attention_bytes > 0
    assert llm.engine.tier_usage().bytes["host"] >= info.host_tier_bytes


def test_sink_window_is_bounded_and_kept_apart_from_full_pages(tiny_llm):
    llm = tiny_llm("llama", page_size=PAGE, kv_policy="sink_window", **BOUNDED)
    history = prompts(1, 200, seed=2)[0]
    windowed = llm.create_session(history)
    greedy(windowed, 4)
    limit = KVPolicy("sink_window", 8, 32).resident_limit(PAGE)  # llama: one KV group
    assert windowed.info().resident_pages <= limit
    windowed.append(history)
    greedy(windowed, 4)
    assert windowed.info().resident_pages <= limit  # flat while the history doubled
    full = llm.create_session(history, kv_policy="full")
    greedy(full, 4)
    assert full.info().reused_tokens == 0  # a different policy's pages hold different K/V: never shared
    child = windowed.fork()
    assert child.info().kv_policy == "sink_window"


def test_tier_metrics_and_bytes_per_token(tiny_llm):
    llm = tiny_llm("llama", page_size=PAGE, kv_codec="int8", kv_policy="restore", **BOUNDED)
    session = llm.create_session(prompts(1, 200, seed=3)[0])
    greedy(session, 2)
    info = session.info()
    raw = tiny_llm("llama", page_size=PAGE, kv_dtype="float32")
    assert info.kv_bytes_per_token < raw.engine.kv_bytes_per_token / 3  # the pool holds int8 codes too
    assert info.tier_bytes_per_token == info.kv_bytes_per_token  # tiers keep the pool's bytes (llama: all layers global)
    assert llm.engine.kv_pages > 3 * raw.engine.kv_pages  # the same kv_budget_bytes holds the tokens
    text = Metrics(llm).render().decode()
    assert f'kiln_kv_tier_bytes{{tier="host"}} {float(llm.engine.tier_usage().bytes["host"])}' in text
    assert 'kiln_kv_tier_bytes{tier="disk"} 0.0' in text


@pytest.mark.parametrize(("options", "field"), [
    ({"kv_policy": "lru"}, "kv_policy"),
    ({"kv_codec": "zstd"}, "kv_codec"),
    ({"kv_host_budget_mb": 0}, "kv_host_budget_mb"),
    ({"kv_disk_budget_mb": 0}, "kv_disk_budget_mb"),
    ({"kv_policy": "restore", "deterministic": True}, "restore"),
])
def test_bad_engine_options_are_refused(options, field):
    with pytest.raises(InvalidArgumentError, match=field):
        EngineConfig(**options)


@pytest.mark.parametrize(("options", "field"), [
    ({"kv_policy": "sink_window", "kv_window_tokens": 4}, "kv_window_tokens"),  # smaller than a page
    ({"kv_policy": "restore", "kv_sink_tokens": 600, "kv_window_tokens": 600}, "kv_window_tokens"),  # > context
    ({"kv_disk_dir": "/nonexistent/kiln"}, "kv_disk_dir"),
])
def test_bad_engine_options_needing_the_model_are_refused(tiny_llm, options, field):
    with pytest.raises(InvalidArgumentError, match=field):
        tiny_llm("llama", **options)


@pytest.mark.parametrize(("options", "field"), [
    ({"kv_policy": "streaming"}, "kv_policy"),
    ({"kv_policy": "restore", "kv_window_tokens": 15}, "kv_window_tokens"),
    ({"kv_policy": "sink_window", "kv_sink_tokens": -1}, "kv_sink_tokens"),
    ({"kv_policy": "restore", "kv_window_tokens": 2000}, "kv_window_tokens"),
])
def test_bad_session_policy_is_refused_and_creates_nothing(tiny_llm, options, field):
    llm = tiny_llm("llama")
    with pytest.raises(InvalidArgumentError, match=field) as raised:
        llm.create_session([5, 6, 7], **options)
    assert raised.value.param == field
    assert len(llm.sessions) == 0 and llm.sessions.outcomes["created"] == 0


def test_restore_runs_in_a_pool_too_small_for_the_full_history(tiny_llm):
    history = prompts(1, 300, seed=6)[0]
    big = tiny_llm("llama", page_size=PAGE, speculative=None)
    expected = greedy(big.create_session(history))
    small = tiny_llm("llama", kv_pages=30, page_size=PAGE, speculative=None, max_batched_tokens=64, prefill_chunk_tokens=64)
    with pytest.raises(ResourceExhaustedError):
        small.create_session(history).generate(max_tokens=24).result()
    assert greedy(small.create_session(history, kv_policy="restore", **BOUNDED)) == expected


def test_a_sink_window_session_says_when_it_starts_forgetting(tiny_llm):
    """ADR 0008 OQ-2: info().forgotten_tokens and kiln_kv_forgotten_tokens_total stay 0 while the history
    fits in sink + window, then count the whole pages between them; K/V dropped for room and recomputed
    is not counted again; a `full` session forgets nothing."""
    llm = tiny_llm("llama", page_size=PAGE, kv_pages=24, speculative=None)  # 192 tokens
    windowed = llm.create_session(prompts(1, 30, seed=5)[0], kv_policy="sink_window", **BOUNDED)  # 8 + 32
    greedy(windowed, 4)
    assert windowed.info().forgotten_tokens == 0  # 33 computed positions: all read
    windowed.append(prompts(1, 40, seed=6)[0])
    greedy(windowed, 4)
    info = windowed.info()
    assert (info.computed_tokens, info.forgotten_tokens) == (77, 32)  # pages 1-4 lie between sink and window
    full = llm.create_session(prompts(1, 180, seed=7)[0])
    greedy(full, 2)
    assert windowed.info().computed_tokens == 0 and full.info().forgotten_tokens == 0  # dropped for room
    greedy(windowed, 1)
    assert windowed.info().forgotten_tokens == 32 and llm.engine.stats.kv_forgotten_tokens == 32
    assert "kiln_kv_forgotten_tokens_total 32.0" in Metrics(llm).render().decode()
