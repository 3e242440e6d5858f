"""Pages, refcounts, prefix reuse, LRU order, forks, rollback and sliding-window release, without a model."""

import pytest
import torch

import kiln.kv.cache as cache_module
from kiln.errors import InvariantViolation
from kiln.kv.cache import KVCache
from kiln.kv.codec import KVCodec
from kiln.kv.format import KVFormat
from kiln.kv.layout import KVLayout
from kiln.kv.pages import PageTable, chain_hashes
from kiln.models.config import ModelConfig

PS = 4


def make_cache(num_pages: int, window: int | None = None, layers: int = 2, fingerprint: str = "m") -> KVCache:
    types = ("full_attention",) * layers
    if window:
        types = ("sliding_attention",) * (layers - 1) + ("full_attention",)
    config = ModelConfig("llama", 100, 8, 16, layers, 2, 1, 4, sliding_window=window, layer_types=types)
    kv_format = KVFormat(fingerprint, "float32", "float32", "raw", PS)
    layout = KVLayout.for_model(config, PS)
    return KVCache(layout, num_pages, KVCodec("none", layout, torch.float32), "cpu", kv_format)


def run_sequence(cache: KVCache, tokens: list[int]) -> PageTable:
    """Admit tokens as a request would: prefix match, pages for the rest, commit."""
    table = PageTable.empty(cache.layout.num_groups)
    cache.attach(table, tokens)
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


def test_each_page_is_one_contiguous_block():
    cache = make_cache(4)
    block = cache.storage.page(2)
    assert block.is_contiguous() and block.numel() == cache.page_bytes
    block.fill_(7)
    assert cache.storage.data[2].eq(7).all() and cache.storage.data[[0, 1, 3]].eq(0).all()


def test_chain_hashes_depend_on_whole_prefix_and_salt():
    a = chain_hashes(list(range(12)), PS, b"s")
    b = chain_hashes([99] + list(range(1, 12)), PS, b"s")
    assert len(a) == 3 and all(x != y for x, y in zip(a, b, strict=True))  # a change in page 0 changes every page
    assert chain_hashes(list(range(12)), PS, b"t") != a
    assert chain_hashes(list(range(12)), PS, b"s", a[0], 1) == a[1:]  # incremental = from scratch
    assert chain_hashes(list(range(12)), PS, b"s", a[0], 1, 2) == a[1:2]


def test_kv_format_fingerprint_separates_engines():
    """Pages of another model, dtype, encoding, page size or layout version are never matched."""
    base = KVFormat("m", "float32", "float32", "raw", PS)
    variants = [KVFormat("other", "float32", "float32", "raw", PS), KVFormat("m", "bfloat16", "float32", "raw", PS),
                KVFormat("m", "float32", "bfloat16", "raw", PS), KVFormat("m", "float32", "float32", "int8", PS),
                KVFormat("m", "float32", "float32", "raw", 8), KVFormat("m", "float32", "float32", "raw", PS, 2)]
    assert len({base.fingerprint(), *(v.fingerprint() for v in variants)}) == 1 + len(variants)
    tokens = list(range(1, 14))
    assert make_cache(8).attach(PageTable.empty(1), tokens) == 0
    one, other = make_cache(8), make_cache(8, fingerprint="other")
    one.release(run_sequence(one, tokens))
    other.release(run_sequence(other, tokens))
    assert one.cached_pages() and one.lookup(0, chain_hashes(tokens, PS, other.salt(PageTable.empty(1).policy))[0]) is None


def test_prefix_hit_reuses_only_pages_before_first_difference():
    cache = make_cache(32)
    first = list(range(1, 14))  # 3 full pages + 1 token
    table = run_sequence(cache, first)
    cache.release(table)  # finished: named pages stay cached
    assert cache.usage().cached == 3  # one group: both layers share pages

    def matched(tokens: list[int]) -> int:
        probe = PageTable.empty(1)
        count = cache.attach(probe, tokens)
        cache.release(probe)
        return count

    assert matched(first[:8] + [50, 51, 52, 53, 54]) == 8  # recompute from the first differing page
    assert matched(first) == 12
    assert matched(first[:12]) == 8  # at least one token is left to compute
    assert matched([7] + first[1:]) == 0


def test_shared_pages_are_refcounted_and_survive_one_owner():
    cache = make_cache(32)
    tokens = list(range(1, 10))
    a = run_sequence(cache, tokens)
    b = PageTable.empty(cache.layout.num_groups)
    cache.attach(b, tokens + [77])
    assert b.pages[0][:2] == a.pages[0][:2]
    assert cache.refcount[a.pages[0][0]] == 2
    cache.release(a)
    assert cache.refcount[b.pages[0][0]] == 1  # still used by b, not cached or free
    assert cache.usage().cached == 0


def test_release_is_tail_first_so_eviction_keeps_the_chain_head():
    """LRU eviction takes a released chain's last page first: what is left still matches from page 0."""
    cache = make_cache(4, layers=1)
    tokens = list(range(1, 14))  # 3 full pages + a partial one
    table = run_sequence(cache, tokens)
    pages = list(table.pages[0])
    cache.release(table)
    assert cache.cached_pages() == [pages[2], pages[1], pages[0]]  # evicted in this order
    assert cache.usage().free == 1
    other = run_sequence(cache, [90, 91, 92, 93, 94, 95])  # takes the free page and one cached page
    assert pages[2] in other.pages[0]
    probe = PageTable.empty(1)
    assert cache.attach(probe, tokens) == 8  # pages 0 and 1 still match


def test_lru_evicts_least_recently_released_first():
    cache = make_cache(6, layers=1)
    old = run_sequence(cache, [1, 2, 3, 4, 5])  # 2 pages: 1 named, 1 partial
    new = run_sequence(cache, [9, 8, 7, 6, 5])
    old_page, new_page, new_hash = old.pages[0][0], new.pages[0][0], new.hashes[0]
    cache.release(old)
    cache.release(new)
    assert cache.cached_pages() == [old_page, new_page]
    assert cache.usage().evicted == 0
    taker = PageTable.empty(1)
    assert cache.ensure(taker, 5 * PS)  # 4 free, then the oldest cached page
    assert taker.pages[0][-1] == old_page
    assert cache.usage().evicted == 1  # counted by the dashboard's evictions chart
    assert cache.attach(PageTable.empty(1), [1, 2, 3, 4, 5]) == 0
    assert cache.lookup(0, new_hash) == new_page


def test_ensure_is_all_or_nothing():
    cache = make_cache(3, window=4)  # 2 groups: a 6-token sequence needs 2 pages per group
    table = PageTable.empty(cache.layout.num_groups)
    assert not cache.ensure(table, 6)
    assert table.pages == [[], []] and cache.usage().free == 3


def test_sliding_group_releases_pages_outside_window_and_match_needs_window():
    cache = make_cache(64, window=6, layers=2)  # one full group, one sliding group (window 6)
    full, sliding = (0, 1) if cache.layout.groups[0].window is None else (1, 0)
    tokens = list(range(1, 22))
    table = run_sequence(cache, tokens)
    # A query at 21 reads keys 16..21; with one page of slack (for a rollback to 17) the sliding group
    # keeps pages from 12 on and releases pages 0-2 (positions 0..11).
    assert table.pages[sliding][:4] == [None, None, None, table.pages[sliding][3]]
    assert None not in table.pages[full]
    assert cache.usage().cached == 3
    hashes = list(table.hashes)
    full_pages = list(table.pages[full])
    cache.release(table)
    probe = PageTable.empty(2)
    assert cache.attach(probe, tokens + [5]) == 20
    cache.release(probe)
    # Keep the full group's pages referenced, evict cached sliding pages up to positions 12..15 (which a
    # query at 20 still reads): no prefix has a complete window any more.
    for page in full_pages:
        cache._acquire(page)
    hog = PageTable.empty(1)  # takes one page at a time
    while cache.lookup(sliding, hashes[3]) is not None:
        assert cache.ensure(hog, (len(hog.pages[0]) + 1) * PS)
    assert cache.lookup(full, hashes[4]) is not None
    assert cache.attach(PageTable.empty(2), tokens + [5]) == 0


def test_fork_shares_full_pages_and_copies_the_partial_one():
    cache = make_cache(16, layers=1)
    tokens = list(range(1, 11))  # 2 full pages + 2 tokens
    parent = run_sequence(cache, tokens)
    cache.storage.page(parent.pages[0][2]).fill_(3)
    child, computed = cache.fork(parent, 10, tokens[:9])
    assert computed == 9
    assert child.pages[0][:2] == parent.pages[0][:2] and cache.refcount[parent.pages[0][0]] == 2
    copy = child.pages[0][2]
    assert copy != parent.pages[0][2] and cache.storage.page(copy).eq(3).all()
    cache.check(child, tokens[:9], computed)
    cache.release(parent)
    assert cache.refcount[child.pages[0][0]] == 1


def test_drop_rolls_back_privately_and_never_writes_a_shared_page():
    cache = make_cache(16, layers=1)
    tokens = list(range(1, 9))  # exactly two full pages
    table = run_sequence(cache, tokens)
    assert cache.drop(table, 7) == 4  # the full (named) last page is released, not rewritten
    assert len(table.hashes) == 1 and len(table.pages[0]) == 1
    partial = run_sequence(cache, list(range(1, 7)))
    assert cache.drop(partial, 5) == 5  # a private partial page just steps back
    speculative = run_sequence(cache, list(range(20, 31)))  # 2 full pages + 3 tokens
    assert cache.drop(speculative, 6) == 4 and len(speculative.pages[0]) == 1


def test_check_verifies_new_pages_only_and_catches_corruption(monkeypatch):
    cache = make_cache(64, layers=1)
    tokens = list(range(1, 42))
    table = run_sequence(cache, tokens)
    cache.check(table, tokens, 41)
    hashed: list[tuple[int, int | None]] = []
    real = cache_module.chain_hashes

    def counting(tokens, page_size, salt, previous=b"", start_page=0, end_page=None):
        hashed.append((start_page, end_page))
        return real(tokens, page_size, salt, previous, start_page, end_page)

    monkeypatch.setattr(cache_module, "chain_hashes", counting)
    more = tokens + list(range(50, 58))
    assert cache.ensure(table, len(more))
    cache.commit(table, more, len(more))
    cache.check(table, more, len(more))
    assert hashed == [(10, 12), (10, 12)]  # commit hashed the 2 new pages, check verified just those
    cache.check(table, more, len(more))
    assert hashed[-1] == (11, 12)  # nothing new: the last page is verified again
    table.hashes[-1] = b"corrupted-hash!!"
    with pytest.raises(InvariantViolation, match="hashes"):
        cache.check(table, more, len(more))
    with pytest.raises(InvariantViolation, match="page tables"):
        cache.check(table, more + [1, 2, 3, 4], len(more) + 4)


def test_capture_copies_held_pages_and_clears_the_partial_tail_of_the_copy_only():
    cache = make_cache(8)
    tokens = list(range(1, 11))  # 2 full pages of 4 and a partial one of 2
    table = run_sequence(cache, tokens)
    for n, page in enumerate(table.pages[0]):
        cache.storage.page(page).copy_(torch.arange(cache.page_bytes, dtype=torch.int32).add(n).to(torch.uint8))
    pool = cache.storage.data.clone()
    full_page, partial = table.pages[0][0], table.pages[0][2]
    image = cache.capture(table, tokens, len(tokens), {(0, 0): full_page})
    assert set(image.blocks) == {(0, 1), (0, 2)}  # the known full page is not copied again
    assert torch.equal(image.blocks[(0, 1)], pool[table.pages[0][1]])
    expected = pool[partial].clone()
    cache.storage.codec.clear_from(expected, len(tokens) % PS)
    assert torch.equal(image.blocks[(0, 2)], expected) and not torch.equal(expected, pool[partial])
    assert torch.equal(cache.storage.data, pool)  # the pool itself is untouched


def test_named_pages_are_logged_and_fetched_pages_extend_a_table_named_like_computed_ones():
    """The persistent prefix store's two sides of the cache: `take_named` lists each page the index names
    once (and only while it still holds that content), `extend` puts fetched bytes back under their keys."""
    source = make_cache(16, window=6)  # a sliding group (window 6: the last two pages) beside the global one
    source.track_named()
    tokens = list(range(20, 41))  # 21 tokens: 5 full pages; a request computes its first 20
    table = run_sequence(source, tokens[:20])
    named = source.take_named()
    assert len(named) == 10 and source.take_named() == []  # 5 pages x 2 groups, each once
    for key, page in named:
        source.storage.page(page).fill_(key[1][0])  # stand-in K/V: each page's bytes tell its key
    fetched = {key: source.storage.page(page).clone() for key, page in named}
    source.release(table)

    fresh = make_cache(16, window=6)
    fresh.track_named()
    restored = PageTable.empty(fresh.layout.num_groups)
    assert fresh.attach(restored, tokens) == 0
    chain = fresh.chain(restored.policy, tokens)
    assert fresh.missing(restored.policy, chain, 0) == [(g, h) for g in (0, 1) for h in chain if g == 0 or h in chain[3:]]
    assert fresh.extend(restored, chain, fetched) == 5
    window = [i for i, page in enumerate(restored.pages[1]) if page is not None]
    assert window == [3, 4] and all(page is not None for page in restored.pages[0])  # the window's pages, every global one
    for g, pages in enumerate(restored.pages):
        for i, page in enumerate(pages):
            if page is not None:
                assert torch.equal(fresh.storage.page(page), fetched[(g, chain[i])])
    assert fresh.take_named() == []  # fetched pages are in the store already: not written back
    fresh.check(restored, tokens, 20)
    fresh.release(restored)
    again = PageTable.empty(fresh.layout.num_groups)
    assert fresh.attach(again, tokens) == 20  # named and cached like computed pages


def test_extend_takes_nothing_when_the_pool_cannot_hold_the_fetched_pages():
    source = make_cache(16)
    source.track_named()
    tokens = list(range(30, 47))
    source.release(run_sequence(source, tokens[:16]))
    fetched = {key: source.storage.page(page).clone() for key, page in source.take_named()}
    small = make_cache(3)  # its 4 fetched pages do not fit
    table = PageTable.empty(small.layout.num_groups)
    small.attach(table, tokens)
    assert small.extend(table, small.chain(table.policy, tokens), fetched) == 0
    assert not table.holds_pages and small.usage().free == 3
