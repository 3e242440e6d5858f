"""ModelRunner: a step's chunks -> model forward over the paged cache -> logits of the rows that sample."""

from __future__ import annotations

import torch

from kiln.engine.batch import SeqSlice, build_step
from kiln.kv.cache import KVCache
from kiln.models.attention import GatherWorkspace


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self.workspace = GatherWorkspace()

    @torch.inference_mode()
    def run(self, slices: list[SeqSlice], sample_rows: list[int]) -> torch.Tensor | None:
        """Write K/V for every slice's tokens; return float32 logits [len(sample_rows), vocab] for the
        slices listed in `sample_rows` (those whose chunk ends their sequence), None if there are none.
        The LM head is the biggest matmul of a small model, so intermediate prefill chunks skip it."""
        pool = self.cache.pool
        step = build_step(slices, self.cache.layout, pool.k, pool.v, self.workspace)
        hidden = self.model(step.input_ids, step.positions, step.attention)
        if not sample_rows:
            return None
        return self.model.logits(hidden[step.last_rows[sample_rows]])

    def slice_for(self, tokens: list[int], start: int, size: int, table_pages: list[list[int | None]]) -> SeqSlice:
        """The SeqSlice of tokens[start:start+size]: each group's pages from the first one a query at
        `start` may read (sliding-window groups have released the earlier ones)."""
        firsts = [self.cache.first_needed_page(g, start) for g in range(len(table_pages))]
        tables = [pages[first:] for pages, first in zip(table_pages, firsts, strict=True)]
        if any(page is None for table in tables for page in table):
            raise RuntimeError("a page inside the attention window was released")
        return SeqSlice(start, tokens[start : start + size], tables, firsts)  # type: ignore[arg-type]

