"""Turns one scheduler step (which sequences, which new tokens, which pages) into model inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.kv.layout import KVLayout
from kiln.models.attention import AttentionBatch, GatherWorkspace, GroupBatch


@dataclass
class SeqSlice:
    """New tokens of one sequence in a step.

    start:       position of the first new token (= tokens whose K/V is already in pages).
    token_ids:   the new tokens, at positions start .. start + len - 1.
    page_tables: per KV group, the sequence's pages from page index first_pages[g] on; they must cover
                 every position up to start + len - 1.
    first_pages: per KV group, index of the first page listed (earlier ones are out of the window).
    """

    start: int
    token_ids: list[int]
    page_tables: list[list[int]]
    first_pages: list[int]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    last_rows: torch.Tensor  # [B], row of each sequence's last new token (its logits sample the next)
    attention: AttentionBatch


def build_step(
    slices: list[SeqSlice],
    layout: KVLayout,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    workspace: GatherWorkspace | None = None,
) -> StepInputs:
    device = k_cache.device
    lengths = [len(s.token_ids) for s in slices]
    if not slices or min(lengths) == 0:
        raise ValueError("every sequence in a step needs at least one new token")
    page_size = layout.page_size
    max_q = max(lengths)
    positions = [list(range(s.start, s.start + n)) for s, n in zip(slices, lengths, strict=True)]
    # Padding queries repeat the sequence's last query: same mask row, never a fully masked row.
    padded_positions = torch.tensor([p + [p[-1]] * (max_q - len(p)) for p in positions], device=device)

    groups = []
    for g, group in enumerate(layout.groups):
        tables = [s.page_tables[g] for s in slices]
        width = max(len(t) for t in tables)
        block_table = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], device=device)
        first = torch.tensor([s.first_pages[g] * page_size for s in slices], device=device)
        key_pos = first[:, None] + torch.arange(width * page_size, device=device)[None, :]
        key_pos = torch.where(
            torch.arange(width * page_size, device=device)[None, :]
            < torch.tensor([len(t) * page_size for t in tables], device=device)[:, None],
            key_pos,
            torch.iinfo(torch.long).max,
        )
        q_pos = padded_positions[:, :, None]
        mask = key_pos[:, None, :] <= q_pos
        if group.window is not None:
            mask &= key_pos[:, None, :] > q_pos - group.window
        slots = []
        for s, pos in zip(slices, positions, strict=True):
            table, first_page = s.page_tables[g], s.first_pages[g]
            slots.extend(table[p // page_size - first_page] * page_size + p % page_size for p in pos)
        groups.append(GroupBatch(torch.tensor(slots, device=device), block_table, mask))

    rows = torch.cumsum(torch.tensor(lengths, device=device), 0)
    if len(slices) == 1:
        query_index = query_valid = None
    else:
        starts = rows - torch.tensor(lengths, device=device)
        offsets = torch.arange(max_q, device=device)[None, :]
        valid = offsets < torch.tensor(lengths, device=device)[:, None]
        query_index = starts[:, None] + torch.minimum(offsets, torch.tensor(lengths, device=device)[:, None] - 1)
        query_valid = valid
    attention = AttentionBatch(
        query_index, query_valid, groups, k_cache, v_cache, layout.layer_slots(), workspace or GatherWorkspace()
    )
    return StepInputs(
        input_ids=torch.tensor([t for s in slices for t in s.token_ids], device=device),
        positions=torch.tensor([p for pos in positions for p in pos], device=device),
        last_rows=rows - 1,
        attention=attention,
    )
