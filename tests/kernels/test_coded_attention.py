"""The attention kernel over coded and float16 KV pages (kernels/attention.cpp): reading 8-bit
and 4-bit codes (each side its own) in place from strided views of one byte pool, it returns bit for bit what paged_attention
returns on the pages dequantised by torch, for decode and multi-row steps, several sequences with shuffled
pages and padding, windows and long histories; a query's result does not depend on its batch; bad inputs
are refused."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.errors import InvariantViolation
from kiln.kernels import kernels, supported
from kiln.kv.step import NO_POSITION

pytestmark = pytest.mark.skipif(not supported(), reason="Kiln's CPU kernels need AVX2 and a C++ compiler")


class CodedPool:
    """A uint8 pool [P, page_nbytes] holding K and V codes (k_bits, v_bits: 8 or 4), float16 scales per
    `group` channels (and zeros for 4 bits) of every page at their own byte offsets, random, and the
    float32 pages torch dequantises them to."""

    def __init__(self, pages: int, page_size: int, kv_heads: int, dim: int, bits: tuple[int, int], group: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.bits = dict(zip("kv", bits, strict=True))
        groups = dim // group
        rows = page_size * kv_heads

        def codes(side: str) -> tuple:
            four = self.bits[side] == 4
            return (f"{side}_codes", torch.uint8 if four else torch.int8, dim // 2 if four else dim)

        # Codes at odd offsets, V before K, a gap and some tail: no view lines up with another or the page.
        parts = [codes("v"), ("k_scales", torch.float16, groups), codes("k"), ("v_scales", torch.float16, groups)]
        parts += [(f"{side}_zeros", torch.float16, groups) for side in "vk" if self.bits[side] == 4]
        offset, at = 3, {}
        for name, dtype, last in parts:
            size = torch.empty(0, dtype=dtype).element_size()
            offset = -(-offset // size) * size
            at[name] = offset
            offset += rows * last * size + 1
        page_nbytes = offset + 6 + offset % 2  # even: the float16 views' page stride is whole
        self.pool = torch.zeros(pages, page_nbytes, dtype=torch.uint8)
        self.views: dict[str, torch.Tensor] = {}
        for name, dtype, last in parts:
            nbytes = rows * last * torch.empty(0, dtype=dtype).element_size()
            view = self.pool[:, at[name] : at[name] + nbytes].view(dtype).view(pages, page_size, kv_heads, last)
            if dtype == torch.float16:  # values within a few units: every key keeps some softmax weight
                low, high = (-1.0, 1.0) if "zeros" in name else (0.002, 0.02) if self.bits[name[0]] == 8 else (0.02, 0.2)
                view.copy_(torch.empty(view.shape).uniform_(low, high, generator=gen).half())
            else:
                view.copy_(torch.randint(0, 256, view.shape, generator=gen, dtype=torch.uint8).view(dtype))
            self.views[name] = view
        empty = torch.empty(0, dtype=torch.float16)
        self.k_zeros, self.v_zeros = self.views.get("k_zeros", empty), self.views.get("v_zeros", empty)
        self.group = group

    def dequantised(self, side: str) -> torch.Tensor:
        codes, scales = self.views[f"{side}_codes"], self.views[f"{side}_scales"].float().repeat_interleave(self.group, -1)
        if self.bits[side] == 8:
            return codes.float() * scales
        channels = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2)
        zeros = self.views[f"{side}_zeros"].float()
        return channels.float() * scales + zeros.repeat_interleave(self.group, -1)

    def coded_args(self) -> tuple:
        v = self.views
        return (v["k_codes"], v["k_scales"], self.k_zeros, v["v_codes"], v["v_scales"], self.v_zeros)


def step(lengths: list[int], rows: list[int], page_size: int, pages: int, seed: int) -> tuple[torch.Tensor, ...]:
    """block_table, first_pos, row_seq, row_pos of sequences of `lengths` tokens whose last `rows` are the
    step's queries, their pages shuffled over the pool, padding at the end of the shorter ones' tables."""
    gen = torch.Generator().manual_seed(seed)
    counts = [math.ceil(n / page_size) for n in lengths]
    ids = torch.randperm(pages, generator=gen)[: sum(counts)].tolist()
    width = max(counts)
    table, first = [], []
    for count in counts:
        mine, ids = ids[:count], ids[count:]
        table.append(mine + [mine[0]] * (width - count))
        first.append([i * page_size for i in range(count)] + [NO_POSITION] * (width - count))
    row_seq = [b for b, r in enumerate(rows) for _ in range(r)]
    row_pos = [p for n, r in zip(lengths, rows, strict=True) for p in range(n - r, n)]
    return torch.tensor(table), torch.tensor(first), torch.tensor(row_seq), torch.tensor(row_pos)


FORMATS = {"int8": (8, 8), "int4 (8-bit keys)": (8, 4), "4-bit keys": (4, 4)}  # (key bits, value bits)
CASES = {  # lengths, rows per sequence, window, kv_heads, query heads per KV head, head_dim, channels per scale
    "decode one sequence": ([700], [1], 0, 1, 4, 64, 32),  # few blocks: a task per chunk, merged after
    "20 rows one sequence": ([900], [20], 0, 1, 4, 64, 32),
    "window one sequence": ([400], [5], 100, 2, 2, 64, 64),
    "decode batch": ([37, 300, 5, 520], [1, 1, 1, 1], 0, 2, 2, 64, 32),  # many blocks: whole blocks a thread
    "5 and 20 rows": ([600, 290], [5, 20], 0, 2, 1, 64, 16),
    "rows and decode mixed": ([20, 530, 64], [20, 1, 5], 0, 1, 2, 32, 8),
    "window": ([600, 90, 300], [5, 1, 20], 50, 2, 4, 64, 32),
    "head_dim an odd multiple of 8": ([300, 41], [3, 1], 0, 2, 3, 72, 24),  # the tiles' 8-channel tail; 3 heads a tile
    "8 heads per KV head, head_dim 256": ([530], [2], 0, 1, 8, 256, 32),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("case", list(CASES))
def test_coded_pages_give_the_float32_kernels_bits(fmt: str, case: str) -> None:
    lengths, rows, window, kv_heads, per_kv, dim, group = CASES[case]
    page_size, pages = 16, 2 + sum(math.ceil(n / 16) for n in lengths)
    pool = CodedPool(pages, page_size, kv_heads, dim, FORMATS[fmt], group, seed=len(case))
    table, first, row_seq, row_pos = step(lengths, rows, page_size, pages, seed=len(fmt))
    q = torch.randn(len(row_seq), kv_heads * per_kv, dim, generator=torch.Generator().manual_seed(1))
    scale = dim**-0.5
    k_pages, v_pages = pool.dequantised("k"), pool.dequantised("v")
    expected = kernels().paged_attention(q, k_pages, v_pages, table, first, row_seq, row_pos, window, scale)
    got = kernels().paged_attention_coded(q, *pool.coded_args(), table, first, row_seq, row_pos, window, scale)
    assert torch.equal(got, expected), f"differs by {(got - expected).abs().max()}"
    # The last sequence's rows alone: the same bits as in the batch.
    b = len(lengths) - 1
    mine = row_seq == b
    alone = kernels().paged_attention_coded(q[mine].contiguous(), *pool.coded_args(), table[b:], first[b:],
                                            torch.zeros(int(mine.sum()), dtype=torch.long), row_pos[mine], window, scale)
    assert torch.equal(alone, got[mine])


@pytest.mark.parametrize("case", list(CASES))
def test_float16_pages_give_the_float32_kernels_bits(case: str) -> None:
    """Raw float16 pages are read in place, widened exactly: the bits paged_attention gives on float32 pages
    holding the same values, and a query's result does not depend on its batch."""
    lengths, rows, window, kv_heads, per_kv, dim, _ = CASES[case]
    page_size, pages = 16, 2 + sum(math.ceil(n / 16) for n in lengths)
    gen = torch.Generator().manual_seed(len(case))
    k_pages, v_pages = (torch.randn(pages, page_size, kv_heads, dim, generator=gen).half() for _ in range(2))
    table, first, row_seq, row_pos = step(lengths, rows, page_size, pages, seed=3)
    q = torch.randn(len(row_seq), kv_heads * per_kv, dim, generator=gen)
    scale = dim**-0.5
    expected = kernels().paged_attention(q, k_pages.float(), v_pages.float(), table, first, row_seq, row_pos, window, scale)
    got = kernels().paged_attention(q, k_pages, v_pages, table, first, row_seq, row_pos, window, scale)
    assert torch.equal(got, expected), f"differs by {(got - expected).abs().max()}"
    b = len(lengths) - 1
    mine = row_seq == b
    alone = kernels().paged_attention(q[mine].contiguous(), k_pages, v_pages, table[b:], first[b:],
                                      torch.zeros(int(mine.sum()), dtype=torch.long), row_pos[mine], window, scale)
    assert torch.equal(alone, got[mine])


@pytest.mark.parametrize("case", list(CASES))
def test_both_instruction_set_paths_give_the_same_bits(case: str) -> None:
    """The AVX-512 tiles (kernels/attention_tiles.h) do each lane's operations in the AVX2 tiles' order, so
    float32, float16 and coded pages give the same bits on both paths."""
    if not kernels().cpu_has_avx512_vnni():
        pytest.skip("this CPU has no AVX-512: the two paths are compared where one has both")
    lengths, rows, window, kv_heads, per_kv, dim, group = CASES[case]
    page_size, pages = 16, 2 + sum(math.ceil(n / 16) for n in lengths)
    pool = CodedPool(pages, page_size, kv_heads, dim, (8, 4), group, seed=len(case))
    tail = (*step(lengths, rows, page_size, pages, seed=5), window, dim**-0.5)
    q = torch.randn(len(tail[2]), kv_heads * per_kv, dim, generator=torch.Generator().manual_seed(2))
    k_pages, v_pages = (torch.randn_like(pool.dequantised(side)).half() for side in "kv")

    def run() -> list[torch.Tensor]:
        return [kernels().paged_attention(q, k_pages.float(), v_pages.float(), *tail),
                kernels().paged_attention(q, k_pages, v_pages, *tail),
                kernels().paged_attention_coded(q, *pool.coded_args(), *tail)]

    previous = kernels().use_isa("avx2")
    try:
        narrow = run()
        kernels().use_isa("avx512_vnni")
        wide = run()
    finally:
        kernels().use_isa(previous)
    for pages_kind, a, b in zip(["float32", "float16", "coded"], narrow, wide, strict=True):
        assert torch.equal(a, b), f"{pages_kind} pages differ by {(a - b).abs().max()}"


def test_bad_inputs_are_refused() -> None:
    pool = CodedPool(4, 16, 2, 64, (4, 4), 32, seed=0)
    table, first, row_seq, row_pos = step([40], [1], 16, 4, seed=0)
    q = torch.randn(1, 4, 64)
    k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros = pool.coded_args()
    call = kernels().paged_attention_coded

    def attend(*pages, query=q):
        return call(query, *pages, table, first, row_seq, row_pos, 0, 0.125)

    with pytest.raises(InvariantViolation, match="k_codes: int8 .8-bit codes. or uint8"):
        attend(k_codes.float(), k_scales, k_zeros, v_codes, v_scales, v_zeros)
    with pytest.raises(InvariantViolation, match="k_codes: expected"):  # 8-bit codes need head_dim bytes, not half
        attend(k_codes.view(torch.int8), k_scales, torch.empty(0, dtype=torch.float16), v_codes, v_scales, v_zeros)
    with pytest.raises(InvariantViolation, match="v_scales: expected a CPU tensor of Half"):
        attend(k_codes, k_scales, k_zeros, v_codes, v_scales.float(), v_zeros)
    with pytest.raises(InvariantViolation, match="k_codes: expected"):  # head_dim 128 needs 64 code bytes
        attend(k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros, query=torch.randn(1, 4, 128))
    with pytest.raises(InvariantViolation, match="v_zeros: expected"):
        attend(k_codes, k_scales, k_zeros, v_codes, v_scales, torch.empty(0, dtype=torch.float16))
    with pytest.raises(InvariantViolation, match="group a multiple of 8"):  # groups of 4 channels
        attend(k_codes, torch.ones(4, 16, 2, 16, dtype=torch.float16), k_zeros, v_codes, v_scales, v_zeros)
    with pytest.raises(InvariantViolation, match="contiguous inside a page"):
        attend(k_codes, k_scales, k_zeros, v_codes.transpose(1, 2).contiguous().transpose(1, 2), v_scales, v_zeros)
    raw = kernels().paged_attention
    with pytest.raises(InvariantViolation, match="float32 or float16 .P, page_size, kv_heads, D., same dtype"):
        raw(q, torch.zeros(4, 16, 2, 64, dtype=torch.half), torch.zeros(4, 16, 2, 64), table, first, row_seq, row_pos, 0, 0.125)
    with pytest.raises(InvariantViolation, match="float32 or float16"):
        raw(q, *(torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2)), table, first, row_seq, row_pos, 0, 0.125)
    int8 = CodedPool(4, 16, 2, 64, (8, 8), 64, seed=0)
    with pytest.raises(InvariantViolation, match="zeros must be empty"):
        attend(*int8.coded_args()[:2], int8.views["k_scales"], *int8.coded_args()[3:])
