"""Host and disk tiers: budgets never exceeded, LRU moves down, referenced pages never dropped, bad
directories and budgets refused."""

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
