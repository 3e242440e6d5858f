"""Pages, refcounts, prefix reuse, LRU order and sliding-window release, without a model."""

import pytest
import torch

from kiln.kv.cache import KVCache
from kiln.kv.layout import KVLayout
from kiln.kv.pages import PageTable, chain_hashes
from kiln.models.config import ModelConfig

PS = 4


def make_cache(num_pages: int, window: int | None = None, layers: int = 2) -> KVCache:
    types = ("full_attention",) * layers
    if window:
        types = ("sliding_attention",) * (layers - 1) + ("full_attention",)
    config = ModelConfig("llama", 100, 8, 16, layers, 2, 1, 4, sliding_window=window, layer_types=types)
    return KVCache(KVLayout.for_model(config, PS), num_pages, torch.float32, "cpu", b"salt")


def run_sequence(cache: KVCache, tokens: list[int]) -> PageTable:
    """Admit tokens as a request would: prefix match, pages for the rest, commit."""
    table = PageTable.empty(cache.layout.num_groups)
    cache.attach(table, cache.match(tokens))
    assert cache.ensure(table, len(tokens))
    cache.commit(table, tokens, len(tokens))
    return table


def test_layout_groups_sliding_and_full_layers():
    config = ModelConfig(
        "gemma3", 10, 8, 16, 6, 2, 1, 4, sliding_window=8,
        layer_types=("sliding_attention",) * 2 + ("full_attention",) + ("sliding_attention",) * 2 + ("full_attention",),
    )
    layout = KVLayout.for_model(config, 16)
    assert layout.slots == 2
    assert [g.window for g in layout.groups] == [None, 8, 8]
    assert sorted(layer for g in layout.groups for layer in g.layers) == list(range(6))
    assert layout.layer_slots()[2] == (0, 0) and layout.layer_slots()[5] == (0, 1)


def test_chain_hashes_depend_on_whole_prefix_and_salt():
    a = chain_hashes(list(range(12)), PS, b"s")
    b = chain_hashes([99] + list(range(1, 12)), PS, b"s")
    assert len(a) == 3 and all(x != y for x, y in zip(a, b, strict=True))  # a change in page 0 changes every page
    assert chain_hashes(list(range(12)), PS, b"t") != a
    assert chain_hashes(list(range(12)), PS, b"s", a[0], 1) == a[1:]  # incremental = from scratch


def test_allocate_release_and_refcounts():
    cache = make_cache(4, layers=1)
    pool = cache.pool
    pages = [pool.allocate() for _ in range(4)]
    assert sorted(pages) == [0, 1, 2, 3] and pool.allocate() is None
    pool.acquire(pages[0])
    pool.release(pages[0])
    assert pool.refcount[pages[0]] == 1
    pool.release(pages[0])
    assert pool.usage().free == 1
    with pytest.raises(RuntimeError):
        pool.release(pages[0])


def test_prefix_hit_reuses_only_pages_before_first_difference():
    cache = make_cache(32)
    first = list(range(1, 14))  # 3 full pages + 1 token
    table = run_sequence(cache, first)
    cache.release(table)  # finished: named pages stay cached
    assert cache.pool.usage().cached == 3  # one group: both layers share pages

    same_two_pages = first[:8] + [50, 51, 52, 53, 54]
    match = cache.match(same_two_pages)
    assert match.num_tokens == 8  # recompute from the first differing page
    assert cache.match(first).num_tokens == 12
    assert cache.match(first[:12]).num_tokens == 8  # at least one token is left to compute
    assert cache.match([7] + first[1:]).num_tokens == 0


def test_shared_pages_are_refcounted_and_survive_one_owner():
    cache = make_cache(32)
    tokens = list(range(1, 10))
    a = run_sequence(cache, tokens)
    b = PageTable.empty(cache.layout.num_groups)
    cache.attach(b, cache.match(tokens + [77]))
    assert b.pages[0][:2] == a.pages[0][:2]
    assert cache.pool.refcount[a.pages[0][0]] == 2
    cache.release(a)
    assert cache.pool.refcount[b.pages[0][0]] == 1  # still used by b, not cached or free
    assert cache.pool.usage().cached == 0


def test_lru_evicts_least_recently_released_first():
    cache = make_cache(6, layers=1)
    old = run_sequence(cache, [1, 2, 3, 4, 5])  # 2 pages: 1 named, 1 partial
    new = run_sequence(cache, [9, 8, 7, 6, 5])
    old_page, new_page = old.pages[0][0], new.pages[0][0]
    cache.release(old)
    cache.release(new)
    assert cache.pool.prefix.lru_order() == [old_page, new_page]
    taken = [cache.pool.allocate() for _ in range(5)]  # 4 free, then the oldest cached page
    assert taken[-1] == old_page
    assert cache.match([1, 2, 3, 4, 5]).num_tokens == 0
    assert cache.match([9, 8, 7, 6, 5]).num_tokens == 4


def test_ensure_is_all_or_nothing():
    cache = make_cache(3, window=4)  # 2 groups: a 6-token sequence needs 2 pages per group
    table = PageTable.empty(cache.layout.num_groups)
    assert not cache.ensure(table, 6)
    assert table.pages == [[], []] and cache.pool.usage().free == 3


def test_sliding_group_releases_pages_outside_window_and_match_needs_window():
    cache = make_cache(64, window=6, layers=2)  # one full group, one sliding group (window 6)
    full, sliding = (0, 1) if cache.layout.groups[0].window is None else (1, 0)
    tokens = list(range(1, 22))
    table = run_sequence(cache, tokens)
    # A query at 21 reads keys 16..21; with one page of slack (for a rewind to 17) the sliding group
    # keeps pages from 12 on and releases pages 0-2 (positions 0..11).
    assert table.pages[sliding][:4] == [None, None, None, table.pages[sliding][3]]
    assert None not in table.pages[full]
    assert cache.pool.usage().cached == 3
    hashes = list(table.hashes)
    full_pages = list(table.pages[full])
    cache.release(table)
    assert cache.match(tokens + [5]).num_tokens == 20
    # Keep the full group's pages referenced, evict cached sliding pages up to positions 12..15 (which a
    # query at 20 still reads): no prefix has a complete window any more.
    for page in full_pages:
        cache.pool.acquire(page)
    while cache.pool.prefix.lookup(sliding, hashes[3]) is not None:
        cache.pool.allocate()
    assert cache.pool.prefix.lookup(full, hashes[4]) is not None
    assert cache.match(tokens + [5]).num_tokens == 0


def test_rewind_recomputes_a_full_last_page_privately():
    cache = make_cache(16, layers=1)
    tokens = list(range(1, 9))  # exactly two full pages
    table = run_sequence(cache, tokens)
    assert cache.rewind(table, 8) == 4  # the full (shareable) last page is released, not rewritten
    assert len(table.hashes) == 1 and len(table.pages[0]) == 1
    partial = run_sequence(cache, list(range(1, 7)))
    assert cache.rewind(partial, 6) == 5  # a private partial page just steps back
