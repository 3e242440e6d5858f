"""Scenarios that write the KV disk tier on a full filesystem, run in a child process by
tests/kv/test_full_disk.py so that a tier which dies of SIGBUS (as a memory-mapped one did) fails that
test instead of killing the test run. `python -m tests.kv.full_disk_scenarios NAME DIR`: DIR is a full
filesystem holding a file `filler`; exit status 0 when every check holds."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from kiln.errors import ResourceExhaustedError
from kiln.kv.tiers import PageTiers
from tests.kv.test_tiers import CODEC, SIZE, block


def tiers_keep_pages_where_they_were(directory: Path) -> None:
    """Host holds 2 pages; the third `hold` must move one down to disk, whose write fails."""
    tiers = PageTiers(CODEC, 2 * SIZE, str(directory), 64 * SIZE)
    assert tiers.hold(0, block(0)) and tiers.hold(1, block(1))
    assert not tiers.hold(2, block(2))  # both host pages referenced, disk unwritable: refused
    assert [tiers.tier_of(k) for k in (0, 1)] == ["host", "host"] and not tiers.has(2)
    usage = tiers.usage()
    assert usage.failed_disk_writes == 1 and usage.pages == {"host": 2, "disk": 0}
    tiers.release(0)
    assert tiers.hold(2, block(2))  # the unreferenced host page made room instead
    assert not tiers.has(0) and tiers.tier_of(2) == "host"
    from kiln.kv.tiers import DiskSlots  # the typed error itself, from the file the tier writes through

    slots = DiskSlots(str(directory), SIZE)
    try:
        slots.write(0, block(1).numpy())
        raise AssertionError("a write to a full filesystem succeeded")
    except ResourceExhaustedError as error:
        assert "full" in str(error)
    slots.close()
    (directory / "filler").unlink()  # space again: pages move down as usual
    assert tiers.hold(3, block(3))
    assert tiers.tier_of(1) == "disk" and tiers.usage().failed_disk_writes == 2
    assert all(torch.equal(tiers.page(k), block(k)) for k in (1, 2, 3))
    k, v = torch.empty(2, 4, 1, 8), torch.empty(2, 4, 1, 8)
    tiers.load([1, 3], 0, (k, v))
    assert k[0].eq(1).all() and v[1].eq(3).all()


def cache_keeps_pages_resident(directory: Path) -> None:
    """A `restore` sequence on the real KVCache whose disk tier cannot take a page: the pages that do
    not fit stay resident and its logits equal `full`'s."""
    from kiln.kv.policy import FULL
    from tests.kv.test_restore import RESTORE, Harness, assert_close, tokens

    history = tokens(100, seed=5)
    with tempfile.TemporaryDirectory() as roomy:
        reference = Harness("llama", roomy)
        expected = reference.feed(reference.admit(history, FULL), [60, 40])
    harness = Harness("llama", str(directory), host_pages=1)
    seq = harness.admit(history, RESTORE)
    got = harness.feed(seq, [60, 40])  # checks INV-1 after every step
    usage = harness.tiers.usage()
    assert usage.failed_disk_writes > 0 and usage.pages["disk"] == 0 and usage.pages["host"] == 1
    assert max(len(r) for r in harness.global_resident(seq)) > RESTORE.resident_limit(8)  # overflow resident
    assert_close(got, expected)
    harness.cache.release(seq.table)
    assert harness.tiers.references() == 0


SCENARIOS = {"tiers": tiers_keep_pages_where_they_were, "cache": cache_keeps_pages_resident}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](Path(sys.argv[2]))
    print("ok")
