"""The attention kernel's merging calls (kernels/attention.cpp): a sequence's pages split into parts (some
in another pool, as a `restore` sequence's tier pages are), each part merged into one online-softmax state,
give full attention (a torch reference, and the plain kernel call up to float rounding); a part a row sees
no key of leaves its state as it was; coded pages merge to the bits of their dequantised pages; a bad state
is refused."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.errors import InvariantViolation
from kiln.kernels import kernels, supported
from tests.kernels.test_coded_attention import CodedPool, step

pytestmark = pytest.mark.skipif(not supported(), reason="Kiln's CPU kernels need AVX2 and a C++ compiler")

PAGE = 16


def fresh_state(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.zeros_like(q), torch.full(q.shape[:2], float("-inf")), torch.zeros(q.shape[:2])


def reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], row_seq: torch.Tensor,
              row_pos: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """Softmax attention row by row in float64: keys[b] / values[b] [positions, kv_heads, D] of sequence b."""
    out = torch.empty_like(q)
    for n in range(len(q)):
        pos = int(row_pos[n])
        lo = max(0, pos - window + 1) if window else 0
        k, v = keys[int(row_seq[n])][lo : pos + 1].double(), values[int(row_seq[n])][lo : pos + 1].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [L, H, D]
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[n].double(), k) * scale, dim=-1)
        out[n] = torch.einsum("hl,lhd->hd", weights, v).float()
    return out


def split_call(q, k_pages, v_pages, table, first, row_seq, row_pos, window, scale, cut: int):  # noqa: ANN001, ANN201
    """Merge the first `cut` pages of every sequence from a copy of the pool (another tensor, pages
    renumbered), then the rest from the pool itself; returns acc / total."""
    acc, top, total = fresh_state(q)
    head = table[:, :cut]
    other_k, other_v = k_pages[head.reshape(-1)].clone(), v_pages[head.reshape(-1)].clone()
    renumbered = torch.arange(head.numel()).view(head.shape)
    kernels().paged_attention_merge(q, other_k, other_v, renumbered, first[:, :cut].contiguous(), row_seq, row_pos, window, scale,
                                    acc, top, total)
    kernels().paged_attention_merge(q, k_pages, v_pages, table[:, cut:].contiguous(), first[:, cut:].contiguous(), row_seq,
                                    row_pos, window, scale, acc, top, total)
    return acc / total.unsqueeze(-1)


CASES = {  # lengths, rows per sequence, window, kv_heads, query heads per KV head, head_dim, pages in the first part
    "decode one sequence": ([700], [1], 0, 1, 4, 64, 30),
    "verification rows": ([900], [5], 0, 1, 4, 64, 20),
    "decode batch": ([300, 520, 280], [1, 1, 1], 0, 2, 2, 64, 17),
    "rows and decode mixed": ([530, 300], [20, 1], 0, 1, 2, 32, 3),
    "window": ([600, 300], [5, 1], 50, 2, 4, 64, 10),
}


@pytest.mark.parametrize("case", list(CASES))
def test_merged_parts_equal_full_attention(case: str) -> None:
    lengths, rows, window, kv_heads, per_kv, dim, cut = CASES[case]
    pages = 2 + sum(math.ceil(n / PAGE) for n in lengths)
    gen = torch.Generator().manual_seed(len(case))
    k_pages = torch.randn(pages, PAGE, kv_heads, dim, generator=gen)
    v_pages = torch.randn(pages, PAGE, kv_heads, dim, generator=gen)
    table, first, row_seq, row_pos = step(lengths, rows, PAGE, pages, seed=3)
    q = torch.randn(len(row_seq), kv_heads * per_kv, dim, generator=gen)
    scale = dim**-0.5
    got = split_call(q, k_pages, v_pages, table, first, row_seq, row_pos, window, scale, cut)
    plain = kernels().paged_attention(q, k_pages, v_pages, table, first, row_seq, row_pos, window, scale)
    keys = [k_pages[table[b, : math.ceil(n / PAGE)]].flatten(0, 1) for b, n in enumerate(lengths)]
    values = [v_pages[table[b, : math.ceil(n / PAGE)]].flatten(0, 1) for b, n in enumerate(lengths)]
    expected = reference(q, keys, values, row_seq, row_pos, window, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-6)


def test_pages_a_row_does_not_see_leave_its_state_alone() -> None:
    gen = torch.Generator().manual_seed(5)
    k_pages, v_pages = torch.randn(8, PAGE, 1, 32, generator=gen), torch.randn(8, PAGE, 1, 32, generator=gen)
    q = torch.randn(2, 2, 32, generator=gen)
    acc, top, total = torch.randn(2, 2, 32, generator=gen), torch.randn(2, 2), torch.rand(2, 2) + 1
    before = (acc.clone(), top.clone(), total.clone())
    # Pages 4..5 hold positions 64..95; the rows sit at positions 10 and 40 (their own keys are elsewhere).
    kernels().paged_attention_merge(q, k_pages, v_pages, torch.tensor([[4, 5]]), torch.tensor([[64, 80]]), torch.tensor([0, 0]),
                                    torch.tensor([10, 40]), 0, 0.2, acc, top, total)
    assert all(torch.equal(a, b) for a, b in zip((acc, top, total), before, strict=True))


@pytest.mark.parametrize("bits", [(8, 8), (8, 4), (4, 4)])
def test_coded_merging_gives_the_bits_of_dequantised_pages(bits: tuple[int, int]) -> None:
    lengths, rows = [500, 200], [5, 1]
    pages = 2 + sum(math.ceil(n / PAGE) for n in lengths)
    pool = CodedPool(pages, PAGE, 2, 64, bits, 32, seed=7)
    table, first, row_seq, row_pos = step(lengths, rows, PAGE, pages, seed=4)
    q = torch.randn(len(row_seq), 4, 64, generator=torch.Generator().manual_seed(2))
    raw, coded = fresh_state(q), fresh_state(q)
    for begin, end in ((0, 6), (6, table.shape[1])):
        part = (table[:, begin:end].contiguous(), first[:, begin:end].contiguous(), row_seq, row_pos, 0, 0.125)
        kernels().paged_attention_merge(q, pool.dequantised("k"), pool.dequantised("v"), *part, *raw)
        kernels().paged_attention_coded_merge(q, *pool.coded_args(), *part, *coded)
    assert all(torch.equal(a, b) for a, b in zip(raw, coded, strict=True))


@pytest.mark.parametrize("bad", ["acc shape", "top dtype", "total not contiguous"])
def test_a_bad_state_is_refused(bad: str) -> None:
    k_pages = v_pages = torch.zeros(2, PAGE, 1, 32)
    q = torch.zeros(1, 2, 32)
    acc, top, total = fresh_state(q)
    if bad == "acc shape":
        acc = torch.zeros(1, 2, 16)
    elif bad == "top dtype":
        top = top.double()
    else:
        total = torch.zeros(1, 4)[:, ::2]
    with pytest.raises(InvariantViolation, match="acc|top|total"):
        kernels().paged_attention_merge(q, k_pages, v_pages, torch.tensor([[0]]), torch.tensor([[0]]), torch.tensor([0]),
                                        torch.tensor([3]), 0, 0.2, acc, top, total)
