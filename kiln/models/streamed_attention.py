"""Streamed attention: exact attention over pages that are partly resident and partly in a tier.

Used for the global layers of every step that holds a `restore` sequence (whether or not its pages are in
a tier yet, so its step memory is bounded by the chunk either way; sliding-window layers are bounded by
their window and attend as usual). Two paths, the same result up to float rounding:

`tiered_attention`, where the C++ kernels run and the step attends in place (decode, speculative
verification, short appends): every part of the keys is attended where it lies, by the kernel's merging
calls (kernels/attention.cpp), into one online-softmax state per query row: the pool's pages of every
sequence, then each sequence's tier pages as `KVStep.tier_runs` plans them (host-tier pages read in place
from the host tier's pool; a chunk holding disk pages copied into a staging buffer first). Nothing is
gathered or decoded ahead, so a `restore` sequence's step costs about what a `full` one's does, plus any
disk reads; its transient memory is the state, the kernel's partial states and one staging chunk.

`streamed_attention`, otherwise (no kernels; steps with more than IN_PLACE_MAX_ROWS rows, which attend by
matrix products under `full` too). Per sequence, its keys are visited in chunks of `KVStep.stream_pages`
pages (resident pages gathered from the pool, tier pages read from their tier, both decoded by the codec
into float32 buffers, a chunk at once) and the partial results are merged with the online softmax
(running max, running sum, rescaled accumulator: FlashAttention's recurrence). The transient memory of a
layer is bounded by one chunk, not by the history: `KVStep.peak_bytes` records it. With the identity
codec the result equals full attention up to float rounding (a different summation order).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from kiln.kernels import kernels
from kiln.kernels.page_format import CHUNK_TOKENS
from kiln.kv.codec import Segment
from kiln.kv.step import KVStep

Load = Callable[[torch.Tensor, torch.Tensor], None]  # fills a chunk's K and V buffers


@dataclass
class _Merge:
    """Online-softmax state of one sequence's queries, folded per KV head: [kv_heads, rows, ...]."""

    top: torch.Tensor  # running max of the scores
    total: torch.Tensor  # running sum of exp(score - top)
    acc: torch.Tensor  # running sum of exp(score - top) * value

    @classmethod
    def start(cls, kv_heads: int, rows: int, head_dim: int, device: torch.device) -> _Merge:
        return cls(
            torch.full((kv_heads, rows, 1), float("-inf"), device=device),
            torch.zeros(kv_heads, rows, 1, device=device),
            torch.zeros(kv_heads, rows, head_dim, device=device),
        )

    def add(self, scores: torch.Tensor, values: torch.Tensor) -> None:
        """scores [kv_heads, rows, L] (-inf where masked); values [kv_heads, L, head_dim]."""
        top = torch.maximum(self.top, scores.amax(dim=2, keepdim=True))
        shift = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # rows with nothing visible yet
        weights = torch.exp(scores - shift)
        rescale = torch.exp(self.top - shift)
        self.total = self.total * rescale + weights.sum(dim=2, keepdim=True)
        self.acc = self.acc * rescale + torch.bmm(weights, values)
        self.top = top

    def result(self) -> torch.Tensor:
        return self.acc / self.total


def streamed_attention(q: torch.Tensor, layer: int, kv: KVStep, scale: float) -> torch.Tensor:
    """q: [N, heads, head_dim] (the step's rows, after RoPE); returns [N, heads, head_dim]. The step's new
    K/V must already be written (they are read back from the pool like every other resident key)."""
    g, slot = kv.layer_slots[layer]
    window = kv.layout.groups[g].window
    ps, kv_heads, dim = kv.layout.page_size, kv.layout.num_kv_heads, kv.layout.head_dim
    out = torch.empty_like(q)
    row = 0
    for s in kv.slices:
        rows = slice(row, row + s.num_tokens)
        row += s.num_tokens
        group = q.shape[1] // kv_heads
        folded = q[rows].float().view(s.num_tokens, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, -1, dim)
        query_pos = kv.row_pos[rows].repeat(group)  # folded row r is query r % num_tokens
        merge = _Merge.start(kv_heads, folded.shape[1], dim, q.device)
        chunks = _chunks(s.tiered[g], s.page_indices[g], s.pages[g], kv.stream_pages)
        for indices, load in _loaders(chunks, kv, slot):
            keys, values = _take(kv, len(indices) * ps, kv_heads, dim, q.device)
            load(keys.view(len(indices), ps, kv_heads, dim), values.view(len(indices), ps, kv_heads, dim))
            key_pos = (torch.tensor(indices, device=q.device)[:, None] * ps + torch.arange(ps, device=q.device)).view(-1)
            visible = key_pos[None, :] <= query_pos[:, None]
            if window is not None:
                visible &= key_pos[None, :] > query_pos[:, None] - window
            scores = torch.bmm(folded, keys.permute(1, 2, 0)).mul_(scale).masked_fill_(~visible, float("-inf"))
            merge.add(scores, values.transpose(0, 1))
            kv.note_bytes(2 * keys.numel() * 4 + 2 * scores.numel() * 4 + visible.numel() + 3 * merge.acc.numel() * 4)
        result = merge.result().view(kv_heads, group, s.num_tokens, dim).permute(2, 0, 1, 3).reshape(s.num_tokens, -1, dim)
        out[rows] = result.to(q.dtype)
    return out


def tiered_attention(q: torch.Tensor, layer: int, kv: KVStep, scale: float) -> torch.Tensor:
    """The kernel path: q [N, heads, head_dim] (the step's rows, after RoPE; the step's new K/V written);
    returns [N, heads, head_dim]."""
    k, v, group, window = kv.pages(layer)
    g, slot = kv.layer_slots[layer]
    query = q.float().contiguous()
    step = _Rows(query, kv.row_seq, kv.row_pos, window or 0, scale,
                 torch.zeros_like(query), torch.full(query.shape[:2], float("-inf")), torch.zeros(query.shape[:2]))
    step.merge((k, v), group.block_table, group.first_pos)
    staged, row = 0, 0
    for s, runs in zip(kv.slices, kv.tier_runs(g), strict=True):
        rows = step.part(row, s.num_tokens)
        row += s.num_tokens
        for run in runs:
            if run.host_slots is not None:  # attended where they lie
                rows.merge(kv.tiers.host_segments(slot), run.host_slots, run.first_pos)  # type: ignore[union-attr]
                continue
            codec = kv.tiers.codec  # type: ignore[union-attr]
            buffer = torch.empty((len(run.places), codec.page_nbytes), dtype=torch.uint8)  # disk reads dwarf allocating it
            kv.tiers.copy(run.places, buffer)  # type: ignore[union-attr]
            staging = (codec.segment(buffer, 0, slot), codec.segment(buffer, 1, slot))
            rows.merge(staging, torch.arange(len(run.places))[None], run.first_pos)
            staged = max(staged, buffer.numel())
    chunks = kv.last_position // CHUNK_TOKENS + 1  # the kernel keeps a partial state per row per chunk at most
    kv.note_bytes(query.numel() * 4 * (chunks + 1) + 2 * step.top.numel() * 4 + staged)
    return (step.acc / step.total.unsqueeze(-1)).to(q.dtype)


@dataclass
class _Rows:
    """Query rows of a step and their online-softmax state (acc [rows, heads, dim] the weighted values, top
    and total [rows, heads] the running max and sum), which the kernel's merging calls continue."""

    query: torch.Tensor
    seq: torch.Tensor  # each row's sequence: its row of the block tables merged
    pos: torch.Tensor
    window: int
    scale: float
    acc: torch.Tensor
    top: torch.Tensor
    total: torch.Tensor

    def part(self, start: int, count: int) -> _Rows:
        """`count` rows from `start`, all of one sequence (block tables of one row), sharing this state's memory."""
        rows = slice(start, start + count)
        return _Rows(self.query[rows], self.seq.new_zeros(count), self.pos[rows], self.window, self.scale,
                     self.acc[rows], self.top[rows], self.total[rows])

    def merge(self, segments: tuple[Segment, Segment], table: torch.Tensor, first: torch.Tensor) -> None:
        """Merge in the pages of `segments` (raw or coded) each row's sequence lists in `table` (first_pos `first`)."""
        k, v = segments
        tail = (table, first, self.seq, self.pos, self.window, self.scale, self.acc, self.top, self.total)
        if k.scales is None:
            kernels().paged_attention_merge(self.query, k.codes, v.codes, *tail)
        else:
            kernels().paged_attention_coded_merge(self.query, *k.kernel_parts(), *v.kernel_parts(), *tail)


def _chunks(tiered: list[tuple[int, Hashable]], indices: list[int], pages: list[int], size: int) -> list[tuple[str, list]]:
    """The sequence's pages in position order, cut into chunks of at most `size` pages of one source:
    ("tier", [(index, key)...]) or ("pool", [(index, page)...])."""
    entries = sorted([("tier", i, key) for i, key in tiered] + [("pool", i, p) for i, p in zip(indices, pages, strict=True)],
                     key=lambda entry: entry[1])
    chunks: list[tuple[str, list]] = []
    for source, index, where in entries:
        if not chunks or chunks[-1][0] != source or len(chunks[-1][1]) == size:
            chunks.append((source, []))
        chunks[-1][1].append((index, where))
    return chunks


def _loaders(chunks: list[tuple[str, list]], kv: KVStep, slot: int):
    """(page indices, load) per chunk: `load` fills float32 K/V buffers [pages, page_size, kv_heads, dim]."""
    for source, entries in chunks:
        indices = [index for index, _ in entries]
        if source == "tier":
            keys = [key for _, key in entries]

            def load(k: torch.Tensor, v: torch.Tensor, keys: list = keys) -> None:
                kv.tiers.load(keys, slot, (k, v))  # type: ignore[union-attr]
        else:
            ids = torch.tensor([page for _, page in entries], device=kv.storage.device)

            def load(k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor = ids) -> None:
                kv.storage.read(slot, ids, (k, v))
        yield indices, load


def _take(kv: KVStep, length: int, kv_heads: int, dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 K and V buffers [length, kv_heads, dim] from the step's reusable workspace."""
    return kv.workspace.take((length, kv_heads, dim), torch.empty(0, dtype=torch.float32, device=device))
