"""huge_page_buffer (kiln/huge_pages.py): a zeroed, writable buffer starting on a 2 MiB boundary, its whole
2 MiB extents advised for huge pages and its tail not, so no huge page is committed past its end."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from kiln.huge_pages import HUGE_PAGE, huge_page_buffer

needs_advice = pytest.mark.skipif(
    sys.platform != "linux" or not hasattr(mmap, "MADV_HUGEPAGE") or not Path("/sys/kernel/mm/transparent_hugepage").exists(),
    reason="huge pages are advised only on Linux kernels built with transparent huge pages")


def vm_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(bound, 16) for bound in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("nbytes", [1, 4096 + 3, HUGE_PAGE, 3 * HUGE_PAGE + 12345])
def test_the_buffer_is_zeroed_writable_and_starts_on_a_huge_page(nbytes: int) -> None:
    buffer = huge_page_buffer(nbytes)
    assert buffer.dtype == torch.uint8 and buffer.shape == (nbytes,)
    assert buffer.data_ptr() % HUGE_PAGE == 0
    assert not buffer.any()
    buffer.fill_(7)
    assert int(buffer.sum()) == 7 * nbytes


@needs_advice
def test_whole_extents_are_advised_and_the_tail_is_not() -> None:
    buffer = huge_page_buffer(3 * HUGE_PAGE + 12345)
    start = buffer.data_ptr()
    assert "hg" in vm_flags(start) and "hg" in vm_flags(start + 3 * HUGE_PAGE - 1)
    assert "hg" not in vm_flags(start + 3 * HUGE_PAGE)  # the tail, on small pages


@needs_advice
def test_a_buffer_smaller_than_a_huge_page_is_not_advised() -> None:
    assert "hg" not in vm_flags(huge_page_buffer(HUGE_PAGE - 1).data_ptr())
