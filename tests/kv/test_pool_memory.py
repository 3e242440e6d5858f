"""The KV pool's memory (issue 29 § 4): reserved at the budget, committed as pages are first used. A free
page used before is handed out again before a page never used, so the committed part grows with the pages
held at once (in use or cached for reuse), and never passes the budget."""

import os
import subprocess
from pathlib import Path

import torch

from kiln.kv.pages import PageTable
from kiln.kv.storage import zeroed_pool
from tests.kv.test_cache import make_cache, run_sequence


def resident_bytes() -> int:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status["VmRSS"].split()[0]) * 1024


def test_a_large_pool_costs_no_memory_until_used() -> None:
    before = resident_bytes()
    cache = make_cache(num_pages=1 << 20)  # 256 MiB of pages (256 bytes each)
    assert cache.num_pages * cache.page_bytes == 256 * 2**20
    assert cache.committed_bytes == 0
    assert resident_bytes() - before < 64 * 2**20  # torch.zeros would have written all 256 MiB


def test_committed_pages_grow_with_need_and_stop_at_the_budget() -> None:
    cache = make_cache(num_pages=64)  # 4 tokens a page
    budget = cache.num_pages * cache.page_bytes
    prompt = list(range(16))
    cache.release(run_sequence(cache, prompt))
    cache.release(run_sequence(cache, prompt))
    settled = cache.committed_bytes
    assert 0 < settled < budget
    for _ in range(5):  # the same prompt again: its cached pages serve it, the page it recomputes is reused
        cache.release(run_sequence(cache, prompt))
    assert cache.committed_bytes == settled
    committed = [settled]
    for k in range(1, 40):  # distinct prompts: new pages up to the budget, then the least recently used are reused
        cache.release(run_sequence(cache, [100 * k + i for i in range(16)]))
        committed.append(cache.committed_bytes)
    assert committed == sorted(committed) and committed[-1] == budget
    tables = [run_sequence(cache, [5000 + 100 * k + i for i in range(16)]) for k in range(16)]
    assert not cache.ensure(PageTable.empty(cache.layout.num_groups), 4)  # every page held: nothing past the budget
    for table in tables:
        cache.release(table)
    assert cache.committed_bytes == budget


def test_pools_reserved_past_the_machines_memory_leave_the_process_able_to_fork() -> None:
    """A test run, or a server that built several engines, holds pools whose reservations add up past RAM;
    Linux's overcommit heuristic counted accounted mappings at every fork, which then failed (ENOMEM)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    chunk = 2**30
    pools = [zeroed_pool(chunk // 4096, 4096, torch.device("cpu")) for _ in range(ram * 3 // 2 // chunk + 1)]
    pools[0][0, 0] = 1  # a used page, as a live pool has
    child = subprocess.run(["true"], preexec_fn=lambda: None, check=False)  # a preexec_fn: fork, not vfork
    assert child.returncode == 0
