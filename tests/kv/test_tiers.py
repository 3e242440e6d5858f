"""Host and disk tiers: budgets never exceeded, LRU moves down, referenced pages never dropped, host pages
readable where they lie and freed slots reused, bad directories and budgets refused."""

import os

import pytest
import torch

from kiln.errors import InvalidArgumentError
from kiln.kv.codec import KVCodec
from kiln.kv.layout import KVLayout
from kiln.kv.tiers import PageTiers

LAYOUT = KVLayout(groups=(), slots=1, page_size=4, num_kv_heads=1, head_dim=8)
CODEC = KVCodec("none", LAYOUT, torch.float32)
SIZE = CODEC.page_nbytes


def block(value: float) -> torch.Tensor:
    """A pool page's bytes (the raw codec) holding `value` everywhere."""
    return CODEC.encode(torch.full((2, 1, 4, 1, 8), value))


def test_pages_move_down_in_lru_order_and_budgets_hold(tmp_path):
    tiers = PageTiers(CODEC, 2 * SIZE + SIZE // 2, str(tmp_path), 3 * SIZE)  # 2 host pages, 3 disk pages
    for key in range(5):
        assert tiers.hold(key, block(key))
        usage = tiers.usage()
        assert all(usage.bytes[t] <= usage.budget_bytes[t] for t in ("host", "disk"))
    assert [tiers.tier_of(k) for k in range(5)] == ["disk", "disk", "disk", "host", "host"]
    assert not tiers.hold(5, block(5))  # every page referenced, both tiers full: refused, nothing lost
    assert all(torch.equal(tiers.page(k), block(k)) for k in range(5))
    tiers.release(0)
    assert tiers.hold(5, block(5))  # the coldest unreferenced page (0, on disk) made room
    assert not tiers.has(0) and torch.equal(tiers.page(5), block(5))
    k, v = torch.empty(1, 4, 1, 8), torch.empty(1, 4, 1, 8)
    tiers.load([1], 0, (k, v))
    assert k.eq(1).all() and v.eq(1).all()


def test_host_pages_are_read_in_place_and_located_with_disk_ones(tmp_path):
    tiers = PageTiers(CODEC, 2 * SIZE, str(tmp_path), 2 * SIZE)
    for key in range(3):
        assert tiers.hold(key, block(key))
    places = tiers.locate([0, 1, 2])
    assert [tier for tier, _ in places] == ["disk", "host", "host"]
    k, v = tiers.host_segments(0)
    for (_, slot), key in zip(places[1:], [1, 2], strict=True):
        assert k.codes[slot].eq(key).all() and v.codes[slot].eq(key).all()
    staged = torch.empty(3, SIZE, dtype=torch.uint8)
    tiers.copy(places, staged)
    assert all(torch.equal(staged[key], block(key)) for key in range(3))
    tiers.locate([1])  # now the most recently used: 2 moves down next, and its host slot goes to the new page
    tiers.release(0)
    assert tiers.hold(3, block(3))
    assert [tiers.tier_of(key) for key in (1, 2, 3)] == ["host", "disk", "host"]
    assert tiers.locate([3])[0] == places[2] and torch.equal(tiers.page(2), block(2))


def test_without_disk_a_full_host_drops_only_unreferenced_pages():
    tiers = PageTiers(CODEC, 2 * SIZE)
    assert tiers.hold("a", block(1)) and tiers.hold("b", block(2))
    assert not tiers.hold("c", block(3))
    tiers.release("a")
    assert tiers.hold("c", block(3)) and not tiers.has("a")
    assert tiers.hold("b", block(9)) and tiers.references("b") == 2  # held again: shared, not re-stored
    assert torch.equal(tiers.page("b"), block(2))


def test_disk_file_leaves_nothing_behind(tmp_path):
    PageTiers(CODEC, SIZE, str(tmp_path), 4 * SIZE)
    assert os.listdir(tmp_path) == []


def test_bad_tier_options_are_refused(tmp_path):
    with pytest.raises(InvalidArgumentError, match="kv_disk_dir") as raised:
        PageTiers(CODEC, SIZE, str(tmp_path / "missing"), SIZE)
    assert raised.value.param == "kv_disk_dir"
    with pytest.raises(InvalidArgumentError, match="kv_host_budget_mb"):
        PageTiers(CODEC, 0)
    with pytest.raises(InvalidArgumentError, match="kv_disk_budget_mb"):
        PageTiers(CODEC, SIZE, str(tmp_path), 0)
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:  # root writes through permissions: then a directory of a read-only file system (procfs)
        target = "/proc" if os.access(read_only, os.W_OK) else str(read_only)
        with pytest.raises(InvalidArgumentError, match="not writable"):
            PageTiers(CODEC, SIZE, target, SIZE)
    finally:
        read_only.chmod(0o700)
