"""Paged attention for GPUs: a Triton kernel over the KV pages where they lie, the GPU's counterpart of
kernels/attention.cpp.

Why: gathering a step's pages into contiguous buffers (GatheredAttention) copies every visible key and value
once a layer and pads every sequence to the step's longest; decode and verification steps are spent reading
K and V, so reading them once, in place, is most of their attention's cost. The kernel reads codes where the
pool keeps them, dequantising int8 and int4 pages as it loads them, so a coded pool also costs a GPU only its
own bytes.

Semantics are the C++ kernel's: query row r of sequence b = row_seq[r] at position p = row_pos[r] attends over
the pages block_table[b, :page_counts[b]] (in position order, not necessarily a prefix: a sink+window policy
lists its sink pages, then its recent ones); slot s of listed page i holds position first_pos[b, i] + s,
visible iff it is <= p and, for window > 0, > p - window. GQA: query head h reads KV head h // (heads //
kv_heads).

One program per (query row, KV head, split): the KV head's query heads are one tile (padded to 16 rows for
tl.dot), so each key and value is read once for all of them; a split's pages, a contiguous run of the row's
listed ones, are visited one at a time with an online softmax in float32. Scores and weighted values are
matrix products in the query's dtype, with keys and values decoded to float32 and cast to it, as
GatheredAttention computes them (float32: IEEE products, not TF32).

Why split ("flash-decoding"): a decode step has few (row, KV head) pairs (Gemma 3 270M at batch 1: one), and
one program walking a long context's pages is one SM's bandwidth. Where the pairs alone do not fill the GPU,
the listed pages are cut into splits (at least MIN_PAGES_PER_SPLIT each, up to TARGET_PROGRAMS programs in
all), each writing its running max, sum and unnormalised values to a float32 workspace that a second kernel
merges (log-sum-exp rescaling) into the output; with one split the first kernel writes the output itself.
The split count and length come from shapes only (the block table's width, not the page counts), the loop
bounds are read from page_counts on the device, and the workspace's and output's sizes are the query's and
the table's, so a launch reads nothing back on the host and can be captured in a CUDA graph.

Triton is optional (a GPU install has it with torch; a CPU install need not): without it this module still
imports and `available()` says False. Triton's interpreter (TRITON_INTERPRET=1: kernels run on CPU tensors,
for tests) is a mode of the whole process, fixed when Triton is imported: its own library functions
(tl.zeros, tl.max) are decorated then, as these kernels are when this module is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

try:
    import triton
    import triton.language as tl

    _jit: Callable[[Any], Any] = triton.jit
except ImportError:  # a CPU install without Triton: the module imports, available() says False
    triton = None
    _jit = lambda fn: fn  # noqa: E731

MIN_DOT = 16  # the tile side tl.dot takes on every backend and release: query-head groups and pages pad to it
TARGET_PROGRAMS = 2 * 132  # programs that fill an H100/H200 (132 SMs) twice over: splits stop there
MIN_PAGES_PER_SPLIT = 4  # below it a split's fixed cost (its query, its partial) outweighs its pages
MERGE_TILE = 32  # splits the merge reads at once: a few loads in flight, not one a split
_BITS = {torch.int8: 8, torch.uint8: 4}  # codes' dtype -> bits (any other dtype: raw values, 0)


class PageSegment(Protocol):
    """One (K or V) segment of a layer's pages (kiln/kv/codec.py Segment: this layer imports nothing above
    it). codes: [pages, page_size, kv_heads, head_dim] in the KV dtype, or int8 codes, or uint8 4-bit pairs
    [..., head_dim / 2]; scales, zeros: float16 [pages, page_size, kv_heads, groups] or None."""

    codes: torch.Tensor
    scales: torch.Tensor | None
    zeros: torch.Tensor | None


def interpreting() -> bool:
    """Whether this process runs the kernel in Triton's interpreter (on CPU tensors) rather than compiled:
    what triton.jit made of it."""
    return triton is not None and not isinstance(_attend, triton.runtime.JITFunction)


def available() -> bool:
    """Whether `paged_attention` runs in this process: Triton imports, and there is a CUDA device (or the
    interpreter was asked for)."""
    return triton is not None and (interpreting() or torch.cuda.is_available())


def paged_attention(
    query: torch.Tensor, k: PageSegment, v: PageSegment, block_table: torch.Tensor, first_pos: torch.Tensor,
    page_counts: torch.Tensor, row_seq: torch.Tensor, row_pos: torch.Tensor, window: int, scale: float,
    splits: int | None = None,
) -> torch.Tensor:
    """query [N, heads, head_dim] (float32, float16 or bfloat16); k, v one layer's segments across the pool;
    block_table [B, P], first_pos [B, P] int64; page_counts [B] int32; row_seq, row_pos [N] int64; window 0
    for none; splits of each row's listed pages (None: split_count's; tests force one). Returns [N, heads,
    head_dim] in the query's dtype. Only shapes and strides are read on the host."""
    rows, heads, head_dim = query.shape
    page_size, kv_heads = k.codes.shape[1:3]
    group = heads // kv_heads
    out = torch.empty(rows, heads, head_dim, dtype=query.dtype, device=query.device)
    if rows == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    width = block_table.shape[1]
    splits = splits or split_count(rows, kv_heads, width)
    per_split = max(1, -(-width // splits))
    k_parts, v_parts = _side(k), _side(v)
    scales = k.scales if k.scales is not None else v.scales
    channels = head_dim if scales is None else head_dim // scales.shape[-1]  # channels one scale covers
    dims = {"HEAD_DIM": head_dim, "DIM_PAD": max(MIN_DOT, triton.next_power_of_2(head_dim))}
    fusion = {"enable_fp_fusion": True}  # Triton's default, said so (3.9 warns where it is left unsaid)
    stats = values = out  # one split: the kernel writes the output, and no partial
    if splits > 1:  # per (row, query head): each split's running max, then each one's sum; each one's values
        stats = torch.empty(rows, heads, 2, splits, dtype=torch.float32, device=query.device)
        values = torch.empty(rows, heads, splits, head_dim, dtype=torch.float32, device=query.device)
    _attend[(rows, kv_heads, splits)](
        out, stats, values, query, block_table, first_pos, page_counts, row_seq, row_pos,
        *k_parts[0], *v_parts[0], out.stride(0), out.stride(1), query.stride(0), query.stride(1),
        block_table.stride(0), first_pos.stride(0), *k_parts[1], *v_parts[1], window, scale, per_split,
        GROUP=group, GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)), **dims,
        PAGE_SIZE=page_size, PAGE_PAD=max(MIN_DOT, triton.next_power_of_2(page_size)),
        K_BITS=_BITS.get(k.codes.dtype, 0), V_BITS=_BITS.get(v.codes.dtype, 0), CHANNELS=channels,
        DOT=_dot_dtype(query.dtype), SPLIT=splits > 1, **fusion,
    )
    if splits > 1:
        _merge[(rows, heads)](out, stats, values, page_counts, row_seq, out.stride(0), out.stride(1), splits,
                              per_split, **dims, SPLIT_PAD=min(MERGE_TILE, triton.next_power_of_2(splits)),
                              **fusion)
    return out


def split_count(rows: int, kv_heads: int, width: int) -> int:
    """How many splits each row's `width` listed-page slots are cut into: enough that rows * kv_heads *
    splits reaches TARGET_PROGRAMS, but none shorter than MIN_PAGES_PER_SPLIT pages (1: no split). From
    shapes only: a captured step's table is as wide as its graph's, whatever its rows' page counts."""
    wanted = -(-TARGET_PROGRAMS // (rows * kv_heads))
    per_split = max(MIN_PAGES_PER_SPLIT, -(-width // wanted))
    return max(1, -(-width // per_split))


def _dot_dtype(dtype: torch.dtype) -> Any:
    """The type tl.dot multiplies in: the query's (its operands are rounded to it either way), but float32
    for bfloat16 under the interpreter, whose tl.dot multiplies bfloat16 operands' bits as integers (Triton
    3.9); float32 products of bfloat16-rounded operands are exact, as a GPU's are."""
    if dtype == torch.bfloat16:
        return tl.float32 if interpreting() else tl.bfloat16
    return {torch.float32: tl.float32, torch.float16: tl.float16}[dtype]


def _side(segment: PageSegment) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """A segment's tensors (codes, scales, zeros; raw pages pass their codes for the parts they lack, never
    read) and strides (codes' page, slot, head; scales' and zeros' the same). Each is a view of the byte pool:
    any page stride, contiguous along the head dimension."""
    codes, scales, zeros = segment.codes, segment.scales, segment.zeros
    if codes.stride(3) != 1 or (scales is not None and scales.stride(3) != 1):
        raise ValueError("page segments must be contiguous along the head dimension")
    if zeros is not None and zeros.stride() != scales.stride():  # type: ignore[union-attr]
        raise ValueError("zero points must be laid out like their scales")
    scale_strides = scales.stride()[:3] if scales is not None else (0, 0, 0)
    return (codes, scales if scales is not None else codes, zeros if zeros is not None else codes), (
        *codes.stride()[:3], *scale_strides)


@_jit
def _load_values(codes, scales, zeros, page, kv_head, slots, dims, inside, code_page, code_slot, code_head,
                 scale_page, scale_slot, scale_head, BITS: tl.constexpr, CHANNELS: tl.constexpr):
    """[slots, dims] values of one (page, KV head) as float32, 0 outside `inside`: raw values (BITS 0), code *
    scale (8), code * scale + zero with channel 2i in byte i's low nibble (4), as KVCodec.dequantize."""
    at = page * code_page + kv_head * code_head + slots[:, None] * code_slot
    scale_at = page * scale_page + kv_head * scale_head + slots[:, None] * scale_slot
    scale_at += dims[None, :] // CHANNELS
    if BITS == 0:  # (constexpr branches: a return inside one would not end the function at compile time)
        values = tl.load(codes + at + dims[None, :], mask=inside, other=0.0).to(tl.float32)
    elif BITS == 8:
        code = tl.load(codes + at + dims[None, :], mask=inside, other=0).to(tl.float32)
        values = code * tl.load(scales + scale_at, mask=inside, other=0.0).to(tl.float32)
    else:
        pair = tl.load(codes + at + dims[None, :] // 2, mask=inside, other=0)
        code = ((pair >> ((dims[None, :] % 2) * 4).to(tl.uint8)) & 15).to(tl.float32)
        values = code * tl.load(scales + scale_at, mask=inside, other=0.0).to(tl.float32)
        values += tl.load(zeros + scale_at, mask=inside, other=0.0).to(tl.float32)
    return values


@_jit
def _attend(out, stats, values, query, block_table, first_pos, page_counts, row_seq, row_pos,
            k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros,
            out_row, out_head, query_row, query_head, table_row, first_row,
            kc_page, kc_slot, kc_head, ks_page, ks_slot, ks_head,
            vc_page, vc_slot, vc_head, vs_page, vs_slot, vs_head,
            window, scale, per_split,
            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
            PAGE_SIZE: tl.constexpr, PAGE_PAD: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
            CHANNELS: tl.constexpr, DOT: tl.constexpr, SPLIT: tl.constexpr):
    """A query row's query heads of one KV head over one split of its sequence's listed pages (the module's
    docstring): the output itself, or with SPLIT the split's partial for _merge (none where the split owns
    no page: _merge reads only the splits that do)."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(row_seq + row)
    pos = tl.load(row_pos + row)
    start = split * per_split
    end = tl.minimum(tl.load(page_counts + seq), start + per_split)
    members = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    slots = tl.arange(0, PAGE_PAD)
    heads = kv_head * GROUP + members
    q_inside = (members[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)
    q_at = query + row * query_row + heads[:, None] * query_head + dims[None, :]
    q = tl.load(q_at, mask=q_inside, other=0.0)
    inside = (slots[:, None] < PAGE_SIZE) & (dims[None, :] < HEAD_DIM)
    log2_scale = scale * 1.4426950408889634  # exp2 of scores in log2 units: exp of the scaled scores
    top = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for i in range(start, end):
        page = tl.load(block_table + seq * table_row + i)
        key_pos = tl.load(first_pos + seq * first_row + i) + slots
        seen = (slots < PAGE_SIZE) & (key_pos <= pos) & ((window == 0) | (key_pos > pos - window))
        k = _load_values(k_codes, k_scales, k_zeros, page, kv_head, slots, dims, inside,
                         kc_page, kc_slot, kc_head, ks_page, ks_slot, ks_head, K_BITS, CHANNELS)
        scores = tl.dot(q.to(DOT), tl.trans(k.to(q.dtype).to(DOT)), input_precision="ieee") * log2_scale
        scores = tl.where(seen[None, :], scores, float("-inf"))  # masked slots may hold anything, even NaN
        new_top = tl.maximum(top, tl.max(scores, 1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # a head that has seen nothing yet
        weights = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(top - shift)
        v = _load_values(v_codes, v_scales, v_zeros, page, kv_head, slots, dims, inside,
                         vc_page, vc_slot, vc_head, vs_page, vs_slot, vs_head, V_BITS, CHANNELS)
        v = tl.where(seen[:, None], v, 0.0)  # a zero weight times a NaN would still be NaN
        total = total * rescale + tl.sum(weights, 1)
        weighted = tl.dot(weights.to(q.dtype).to(DOT), v.to(q.dtype).to(DOT), input_precision="ieee")
        acc = acc * rescale[:, None] + weighted
        top = new_top
    if SPLIT:
        splits = tl.num_programs(2)
        at = row * tl.num_programs(1) * GROUP + heads  # the (row, query head) pairs' partials
        owned = members < tl.where(start < end, GROUP, 0)  # (a bool & a scalar bool: int32 to the interpreter)
        tl.store(stats + 2 * at * splits + split, top, mask=owned)
        tl.store(stats + (2 * at + 1) * splits + split, total, mask=owned)
        tl.store(values + (at * splits + split)[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=q_inside & owned[:, None])
    else:
        result = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(out + row * out_row + heads[:, None] * out_head + dims[None, :],
                 result.to(out.dtype.element_ty), mask=q_inside)


@_jit
def _merge(out, stats, values, page_counts, row_seq, out_row, out_head, splits, per_split,
           HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLIT_PAD: tl.constexpr):
    """A query row's query head from its splits that own pages (_attend's partials, in log2 units),
    SPLIT_PAD at a time: rescaled to their common max, summed and normalised. A head that saw nothing (every
    max -inf, every sum 0) gives 0, as the unsplit kernel does."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    used = tl.cdiv(tl.load(page_counts + tl.load(row_seq + row)), per_split)
    at = row * tl.num_programs(1) + head
    tiles = tl.arange(0, SPLIT_PAD)
    dims = tl.arange(0, DIM_PAD)
    tops = tl.full([SPLIT_PAD], float("-inf"), tl.float32)
    for first in range(0, used, SPLIT_PAD):
        live = first + tiles < used
        tops = tl.maximum(tops, tl.load(stats + 2 * at * splits + first + tiles, mask=live, other=float("-inf")))
    top = tl.max(tops, 0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    totals = tl.zeros([SPLIT_PAD], tl.float32)
    acc = tl.zeros([DIM_PAD], tl.float32)
    for first in range(0, used, SPLIT_PAD):
        split = first + tiles
        live = split < used
        weights = tl.exp2(tl.load(stats + 2 * at * splits + split, mask=live, other=float("-inf")) - shift)
        totals += weights * tl.load(stats + (2 * at + 1) * splits + split, mask=live, other=0.0)
        part = tl.load(values + (at * splits + split)[:, None] * HEAD_DIM + dims[None, :],
                       mask=live[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
        acc += tl.sum(weights[:, None] * part, 0)
    total = tl.sum(totals, 0)
    result = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(out + row * out_row + head * out_head + dims, result.to(out.dtype.element_ty), mask=dims < HEAD_DIM)
