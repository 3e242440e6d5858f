"""Streamed attention: exact attention over pages that are partly resident and partly in a tier.

Used for the global layers of every step that holds a `restore` sequence (whether or not its pages are in
a tier yet, so its step memory is bounded by the chunk either way; sliding-window layers are bounded by
their window and attend as usual). Per sequence, its keys are visited in chunks of `KVStep.stream_pages`
pages (resident pages gathered from the pool, tier pages read from their tier, both decoded by the codec
into float32 buffers, a chunk at once) and the partial results are merged with the online softmax
(running max, running sum, rescaled accumulator: FlashAttention's recurrence). The transient memory of a
layer is bounded by one chunk, not by the history: `KVStep.peak_bytes` records it. With the identity
codec the result equals full attention up to float rounding (a different summation order).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # kiln.kv imports the model config, hence this package
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
