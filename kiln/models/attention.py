"""The paged attention call every model layer makes.

The runner flattens a step's new tokens of B sequences into N rows (sequence after sequence, positions
ascending). Each layer writes its new K/V into the page pool at `slot_mapping`, gathers the pages its
KV group reads for each sequence, and attends with a boolean mask that already encodes causality,
the sliding window and padding. Models never allocate pages: they only read and write where told.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class GroupBatch:
    """One KV group's view of this step.

    slot_mapping: [N] long, flat slot (page * page_size + offset) where each new token's K/V goes.
    block_table:  [B, P] long, pages whose keys each sequence reads, in position order (padded with any
                  valid page; the mask hides padding).
    mask:         [B, Q, P * page_size] bool, True where query q of sequence b may attend to that key.
    """

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    mask: torch.Tensor


class GatherWorkspace:
    """Reusable buffers for the pages a layer gathers. At long contexts a fresh tensor per layer per
    step costs more than the attention itself (allocation and page faults); these grow to the largest
    step seen and are reused by every layer, which run one after another."""

    def __init__(self) -> None:
        self._k = self._v = torch.empty(0)

    def take(self, pages: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two [pages, *like.shape[1:]] buffers of like's dtype and device."""
        shape = (pages, *like.shape[1:])
        needed = pages * like[0].numel()
        if self._k.numel() < needed or self._k.dtype != like.dtype or self._k.device != like.device:
            self._k = torch.empty(needed, dtype=like.dtype, device=like.device)
            self._v = torch.empty(needed, dtype=like.dtype, device=like.device)
        return self._k[:needed].view(shape), self._v[:needed].view(shape)


@dataclass
class AttentionBatch:
    """Everything attention needs for one forward step.

    query_index: [B, Q] long, row of each (sequence, query) in the flattened tokens; padding repeats a
                 valid row of the same sequence. None when B == 1 (no padding needed).
    query_valid: [B, Q] bool, False on padding.
    k_cache, v_cache: [slots, num_pages, page_size, kv_heads, head_dim], the pool's tensors.
    layer_slots: (group, slot) of each model layer.
    """

    query_index: torch.Tensor | None
    query_valid: torch.Tensor | None
    groups: list[GroupBatch]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    layer_slots: list[tuple[int, int]]
    workspace: GatherWorkspace = field(default_factory=GatherWorkspace)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: AttentionBatch, scale: float
) -> torch.Tensor:
    """q: [N, heads, head_dim]; k, v: [N, kv_heads, head_dim] (after RoPE/norms). Returns [N, heads, head_dim]."""
    group_index, slot = batch.layer_slots[layer]
    group = batch.groups[group_index]
    k_pages, v_pages = batch.k_cache[slot], batch.v_cache[slot]
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_pages.view(-1, kv_heads, head_dim).index_copy_(0, group.slot_mapping, k.to(k_pages.dtype))
    v_pages.view(-1, kv_heads, head_dim).index_copy_(0, group.slot_mapping, v.to(v_pages.dtype))

    num_seqs = group.block_table.shape[0]
    pages = group.block_table.reshape(-1)
    k_gathered, v_gathered = batch.workspace.take(pages.numel(), k_pages)
    torch.index_select(k_pages, 0, pages, out=k_gathered)
    torch.index_select(v_pages, 0, pages, out=v_gathered)
    keys = k_gathered.view(num_seqs, -1, kv_heads, head_dim).transpose(1, 2)
    values = v_gathered.view(num_seqs, -1, kv_heads, head_dim).transpose(1, 2)
    if group.mask.shape[1] == 1:
        return _decode_attention(q, keys.to(q.dtype), values.to(q.dtype), group.mask[:, 0], scale)
    queries = q.unsqueeze(0) if batch.query_index is None else q[batch.query_index]
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=group.mask.unsqueeze(1),
        scale=scale,
        enable_gqa=True,
    ).transpose(1, 2)
    return out[0] if batch.query_valid is None else out[batch.query_valid]


def _decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per sequence (a decode step): q [B, heads, D], keys/values [B, kv_heads, L, D], mask
    [B, L]. Each KV head's query heads are folded into the columns of one matmul against K, so K and V
    are each read once; on CPU this is ~3x faster than SDPA at long contexts, where the step is spent
    streaming K and V."""
    num_seqs, kv_heads, length, head_dim = keys.shape
    group = q.shape[1] // kv_heads
    folded = q.reshape(num_seqs * kv_heads, group, head_dim).transpose(1, 2)  # [B*kvh, D, g]
    scores = torch.bmm(keys.reshape(-1, length, head_dim), folded).mul_(scale)  # [B*kvh, L, g]
    scores = scores.view(num_seqs, kv_heads, length, group).masked_fill_(~mask[:, None, :, None], float("-inf"))
    weights = torch.softmax(scores, dim=2).view(-1, length, group).transpose(1, 2).contiguous()  # [B*kvh, g, L]
    out = torch.bmm(weights, values.reshape(-1, length, head_dim))  # [B*kvh, g, D]
    return out.view(num_seqs, kv_heads * group, head_dim)
