"""KVStep: how one forward step reads and writes KV pages, built from the scheduler's slices.

The runner flattens a step's new tokens of B sequences into N rows (sequence after sequence, positions
ascending). For each layer, attention hands the new K/V to `write` (they land in the sequence's pages)
and takes back from `read` the keys, values and mask of the pages that sequence may read. Each listed
page carries its own positions (page index * page_size + offset), so the pages a sequence reads need
not be a prefix of its history: a policy may keep sink pages and a recent window.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Hashable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from kiln.kernels.page_format import CHUNK_TOKENS
from kiln.kv.codec import Segment
from kiln.kv.layout import KVLayout
from kiln.kv.storage import PageStorage
from kiln.kv.tiers import PageTiers

NO_POSITION = 1 << 62  # key position of padding: later than every query (and room to add offsets)


@dataclass
class KVSlice:
    """One sequence's part of a step.

    start:        position of the first new token.
    num_tokens:   new tokens, at positions start .. start + num_tokens - 1.
    pages:        per KV group, the page ids the slice reads, in position order; they include the pages
                  its new tokens are written to.
    page_indices: per KV group, the index of each listed page in the sequence (page i holds positions
                  i * page_size .. (i + 1) * page_size - 1).
    tiered:       per KV group, (page index, tier key) of the pages it also reads from a tier (a
                  `restore` policy), in position order, all before the listed pages' new tokens.
    stream:       attend global layers chunk by chunk (kiln/models/streamed_attention.py) even with
                  nothing in a tier: a `restore` sequence's step memory stays bounded by the chunk,
                  whatever it holds.
    """

    start: int
    num_tokens: int
    pages: list[list[int]]
    page_indices: list[list[int]]
    tiered: list[list[tuple[int, Hashable]]] = field(default_factory=list)
    stream: bool = False


@dataclass
class GroupStep:
    write_pages: torch.Tensor  # [N] page each new token's K/V goes to
    write_offsets: torch.Tensor  # [N] its offset in that page
    block_table: torch.Tensor  # [B, P] pages each sequence reads (padded with its first page; masked)
    first_pos: torch.Tensor  # [B, P] position of each listed page's first slot (padding: NO_POSITION)
    query_pos: torch.Tensor  # [B, Q] position of each query (padding repeats the sequence's last)
    page_counts: torch.Tensor  # [B] int32: pages listed for each sequence (the rest of its row is padding)
    window: int | None
    page_size: int

    @cached_property
    def mask(self) -> torch.Tensor:
        """[B, Q, P * page_size] True where query q of sequence b may attend to that key. Built on first
        read: steps that attend in place (decode, verification, the deterministic mode) never need it."""
        key_pos = (self.first_pos[:, :, None] + torch.arange(self.page_size, device=self.first_pos.device)).view(len(self.first_pos), -1)
        q = self.query_pos[:, :, None]
        mask = key_pos[:, None, :] <= q
        if self.window is not None:
            mask &= key_pos[:, None, :] > q - self.window
        return mask


@dataclass
class TierRun:
    """Tier pages of one sequence, in position order, that one merging call of the attention kernel attends
    (kiln/models/streamed_attention.py): where they lie in the host tier (`host_slots`), or else copied into
    a staging buffer first (some are on disk)."""

    first_pos: torch.Tensor  # [1, n] position of each page's first slot
    places: list[tuple[str, int]]  # each page's (tier, slot), as PageTiers.locate tells them
    host_slots: torch.Tensor | None  # [1, n] when every page is in the host tier


def _row(values: list[int]) -> torch.Tensor:
    """int64 [1, len(values)]; through numpy, four times faster than torch.tensor on a list (a step builds
    these for hundreds of tier pages)."""
    return torch.from_numpy(np.array(values, dtype=np.int64)).view(1, -1)


class Workspace:
    """Reusable buffers for the pages a layer gathers. At long contexts a fresh tensor per layer per
    step costs more than the attention itself (allocation and page faults); these grow to the largest
    step seen and are reused by every layer, which run one after another."""

    def __init__(self) -> None:
        self._k = self._v = torch.empty(0)

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        needed = math.prod(shape)
        if self._k.numel() < needed or self._k.dtype != like.dtype or self._k.device != like.device:
            self._k = torch.empty(needed, dtype=like.dtype, device=like.device)
            self._v = torch.empty(needed, dtype=like.dtype, device=like.device)
        return self._k[:needed].view(shape), self._v[:needed].view(shape)


class KVStep:
    """`streams(layer)`: some sequence reads that layer's pages from a tier (or is a `restore` sequence
    and the layer global), so the layer takes the streamed path (kiln/models/streamed_attention.py),
    reading tier pages from `tiers` (in place from host memory, or `stream_pages` at a time);
    sliding-window layers, bounded by their window, attend as usual. `peak_bytes` is the largest transient
    attention buffer set one layer of this step held (bytes), accounted by whichever attention path ran."""

    def __init__(
        self, storage: PageStorage, slices: list[KVSlice], workspace: Workspace | None = None,
        tiers: PageTiers | None = None, stream_pages: int = 64,
    ) -> None:
        if not slices or min(s.num_tokens for s in slices) == 0:
            raise ValueError("every sequence in a step needs at least one new token")
        self.storage = storage
        self.layout: KVLayout = storage.layout
        self.workspace = workspace or Workspace()
        self.slices = slices
        self.tiers = tiers
        self.stream_pages = stream_pages
        self._tier_runs: dict[int, list[list[TierRun]]] = {}
        self._streamed_groups = {
            g for g, group in enumerate(self.layout.groups)
            if any((g < len(s.tiered) and s.tiered[g]) or (s.stream and group.window is None) for s in slices)
        }
        device = storage.device
        max_q = max(s.num_tokens for s in slices)
        # Padding queries repeat the sequence's last query: same mask row, never a fully masked row.
        query_pos = torch.tensor(
            [[s.start + min(i, s.num_tokens - 1) for i in range(max_q)] for s in slices], device=device
        )
        self._bind([self._group(g, slices, query_pos, device) for g in range(self.layout.num_groups)],
                   torch.tensor([b for b, s in enumerate(slices) for _ in range(s.num_tokens)], device=device),
                   torch.tensor([p for s in slices for p in range(s.start, s.start + s.num_tokens)], device=device),
                   max(s.start + s.num_tokens for s in slices) - 1)

    @classmethod
    def of_tensors(
        cls, storage: PageStorage, groups: list[GroupStep], row_seq: torch.Tensor, row_pos: torch.Tensor,
        last_position: int, workspace: Workspace,
    ) -> KVStep:
        """A step over tensors built elsewhere (kiln/engine/decode_graphs.py's static buffers): no slices and no
        tier pages. `last_position` bounds the rows' positions (the RoPE tables are built up to it)."""
        step = cls.__new__(cls)
        step.storage, step.layout, step.workspace = storage, storage.layout, workspace
        step.slices, step.tiers, step.stream_pages = [], None, 0
        step._tier_runs, step._streamed_groups = {}, set()
        step._bind(groups, row_seq, row_pos, last_position)
        return step

    def _bind(self, groups: list[GroupStep], row_seq: torch.Tensor, row_pos: torch.Tensor, last_position: int) -> None:
        self.peak_bytes = 0
        self.layer_slots = self.storage.layer_slots
        self.groups = groups
        self.row_seq = row_seq
        self.row_pos = row_pos
        self.last_position = last_position
        self._kernel_rows = [
            (group.write_pages, group.write_offsets, group.block_table, group.first_pos, self.row_seq, self.row_pos, group.window or 0)
            for group in self.groups
        ]

    def _group(self, g: int, slices: list[KVSlice], query_pos: torch.Tensor, device: torch.device) -> GroupStep:
        ps = self.layout.page_size
        width = max(len(s.pages[g]) for s in slices)
        # Through numpy, whose conversion of a long list is several times torch.tensor's: these grow with the history.
        block_table = np.empty((len(slices), width), dtype=np.int64)
        first_pos = np.full((len(slices), width), NO_POSITION, dtype=np.int64)
        counts = np.array([len(s.pages[g]) for s in slices], dtype=np.int32)
        for b, s in enumerate(slices):
            listed = counts[b]
            block_table[b, :listed] = s.pages[g]
            block_table[b, listed:] = s.pages[g][0]
            first_pos[b, :listed] = s.page_indices[g]
            first_pos[b, :listed] *= ps
        pages, offsets = [], []
        for s in slices:
            # The pages new tokens go to end the slice's list, one per index: find the first by bisection
            # rather than mapping every listed page (the list grows with history, a step's tokens do not).
            first = bisect_left(s.page_indices[g], s.start // ps)
            for position in range(s.start, s.start + s.num_tokens):
                pages.append(s.pages[g][first + position // ps - s.start // ps])
                offsets.append(position % ps)
        return GroupStep(torch.tensor(pages, device=device), torch.tensor(offsets, device=device),
                          torch.from_numpy(block_table).to(device), torch.from_numpy(first_pos).to(device),
                          query_pos, torch.from_numpy(counts).to(device), self.layout.groups[g].window, ps)

    def tier_runs(self, g: int) -> list[list[TierRun]]:
        """Per slice, its tier pages of group `g` as merging calls, worked out once per step (every layer of the
        group reads the same pages). Calls are cut only at multiples of the kernel's chunk (CHUNK_TOKENS
        positions), whose partial results it merges the same way within a call or across calls: so a result
        depends on which pages are resident, never on which tier holds the others (a page moving from host
        to disk changes no bits). Consecutive host chunks make one call; a chunk with disk pages is staged
        alone, `stream_pages` pages (rounded up to the kernel's chunk) at most."""
        if g not in self._tier_runs:
            self._tier_runs[g] = [self._runs(s.tiered[g] if g < len(s.tiered) else []) for s in self.slices]
        return self._tier_runs[g]

    def _runs(self, tiered: list[tuple[int, Hashable]]) -> list[TierRun]:
        if not tiered:
            return []
        ps = self.layout.page_size
        places = self.tiers.locate([key for _, key in tiered])  # type: ignore[union-attr]
        if all(tier == "host" for tier, _ in places):  # the common case, in one call: no cut changes a bit
            return [TierRun(_row([index * ps for index, _ in tiered]), places, _row([slot for _, slot in places]))]
        aligned = max(1, CHUNK_TOKENS // ps)
        size = -(-self.stream_pages // aligned) * aligned
        chunks: list[list[int]] = []  # positions in `tiered`
        for n, (index, _) in enumerate(tiered):
            if not chunks or tiered[chunks[-1][0]][0] // size != index // size:
                chunks.append([])
            chunks[-1].append(n)
        runs: list[tuple[list[int], bool]] = []  # (the chunks, consecutive all-host ones joined; all host?)
        for chunk in chunks:
            host = all(places[n][0] == "host" for n in chunk)
            if host and runs and runs[-1][1]:
                runs[-1][0].extend(chunk)
            else:
                runs.append((chunk, host))
        return [TierRun(_row([tiered[n][0] * ps for n in run]), [places[n] for n in run],
                        _row([places[n][1] for n in run]) if host else None) for run, host in runs]

    def fresh_prompt(self) -> bool:
        """One sequence's first tokens, stored raw: each layer's pages then hold exactly the step's new K/V."""
        return len(self.slices) == 1 and self.slices[0].start == 0 and not self._streamed_groups and \
            self.storage.codec.name == "none"

    def window(self, layer: int) -> int | None:
        return self.layout.groups[self.layer_slots[layer][0]].window

    def streams(self, layer: int) -> bool:
        return self.layer_slots[layer][0] in self._streamed_groups

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new K/V of one layer: k, v [N, kv_heads, head_dim]."""
        g, slot = self.layer_slots[layer]
        self.storage.write(slot, self.groups[g].write_pages, self.groups[g].write_offsets, k, v)

    def pages(self, layer: int) -> tuple[Segment, Segment, GroupStep, int | None]:
        """For kernels that read pages in place: the layer's K and V segments across the pool (the codec's
        views, [P, page_size, kv_heads, ...]), its group's step (block_table, first_pos) and the group's
        window. Queries are described by `row_seq` (each row's sequence in the step) and `row_pos` (its
        position)."""
        g, slot = self.layer_slots[layer]
        k, v = self.storage.segments(slot)
        return k, v, self.groups[g], self.layout.groups[g].window

    def kernel_args(self, layer: int) -> tuple[torch.Tensor | int, ...]:
        """For a kernel that stores and attends one layer's rows in place (kernels/decoder_layer.h): the layer's
        K and V pages (PageStorage.kernel_parts), then where the step's rows go (write pages, offsets) and
        what they read (block_table, first_pos, row_seq, row_pos, the window; 0 for none)."""
        g, slot = self.layer_slots[layer]
        return self.storage.kernel_parts(slot) + self._kernel_rows[g]

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys and values [B, kv_heads, P * page_size, head_dim] each sequence may read at this layer
        (decoded, in the storage's read dtype), and the mask [B, Q, P * page_size] saying which a query sees."""
        g, slot = self.layer_slots[layer]
        group = self.groups[g]
        num_seqs, width = group.block_table.shape
        ps, heads, dim = self.layout.page_size, self.layout.num_kv_heads, self.layout.head_dim
        like = torch.empty(0, dtype=self.storage.read_dtype, device=self.storage.device)
        k_buf, v_buf = self.workspace.take((num_seqs * width, ps, heads, dim), like)
        self.storage.read(slot, group.block_table.view(-1), (k_buf, v_buf))
        keys = k_buf.view(num_seqs, -1, heads, dim).transpose(1, 2)
        values = v_buf.view(num_seqs, -1, heads, dim).transpose(1, 2)
        return keys, values, group.mask

    def note_bytes(self, nbytes: int) -> None:
        """Record a layer's transient attention buffers; the step keeps the largest."""
        self.peak_bytes = max(self.peak_bytes, nbytes)
