"""Decode steps over static buffers, replayed as CUDA graphs on a GPU.

A decode step (one new token per sequence) is the same work every time but for a handful of numbers: token ids,
positions, where each row's K/V goes and which pages it reads. On a GPU its Python (a few hundred small kernel
launches) costs several times the GPU's own work, so the step is captured once per batch-size bucket as a CUDA
graph and replayed: the runner writes the step's numbers into the bucket's static buffers, pads the batch to the
bucket with rows that write to and read from a scratch page nobody owns, and replays. Prefill and mixed steps,
speculative verification and steps that stream a tier's pages stay eager (ModelRunner).

Nothing in a captured step may read a device value on the host (tests/models/test_host_reads.py guards the model
code): every size is the bucket's, the block tables are as wide as the longest history a sequence may have
(`max_model_len`; a sliding-window group's window), the RoPE tables are built for every position before capture,
and a paged kernel loops to each row's `page_counts` on the device. On the CPU the same static step runs eagerly
(EngineConfig.decode_graphs=True): what the tests compare with the dynamic step.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kiln.kv.layout import KVLayout
from kiln.kv.step import NO_POSITION, GroupStep, KVSlice, KVStep, Workspace
from kiln.kv.storage import PageStorage
from kiln.models.attention import AttentionBatch

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # batch sizes a decode step is padded to (and max_num_seqs itself)

AttentionChooser = Callable[[list[int], KVStep], AttentionBatch]


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """The buckets up to max_num_seqs, and max_num_seqs itself, so every decode step has one."""
    return [size for size in BUCKETS if size < max_num_seqs] + [max_num_seqs]


@dataclass
class _GroupBuffers:
    """One KV group's part of a bucket's static inputs (see GroupStep)."""

    write_pages: torch.Tensor  # [B]
    write_offsets: torch.Tensor  # [B]
    block_table: torch.Tensor  # [B, width]
    first_pos: torch.Tensor  # [B, width]
    page_counts: torch.Tensor  # [B] int32


class DecodeBucket:
    """The static inputs of a decode step of `size` rows, the step built over them, and its graph once captured."""

    def __init__(
        self, size: int, storage: PageStorage, widths: list[int], scratch: int, last_position: int, choose: AttentionChooser,
    ) -> None:
        device, layout = storage.device, storage.layout
        self.size = size
        self.choose = choose
        self.storage = storage
        self.layout: KVLayout = layout
        self.scratch = scratch
        self.last_position = last_position
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.row_seq = torch.arange(size, device=device)
        self.groups = [
            _GroupBuffers(
                torch.full((size,), scratch, dtype=torch.long, device=device),
                torch.zeros(size, dtype=torch.long, device=device),
                torch.full((size, width), scratch, dtype=torch.long, device=device),
                torch.full((size, width), NO_POSITION, dtype=torch.long, device=device),
                torch.ones(size, dtype=torch.int32, device=device),
            )
            for width in widths
        ]
        self.workspace = Workspace()  # the bucket's own: a graph holds the buffers it captured
        self._spans = [1] * len(widths)  # per group, the block table's leading columns the last fill listed
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the graph's output, [size, vocab] float32
        self.captured: AttentionBatch | None = None  # the step the graph captured
        self.fill([], [])  # every row padding: a valid step to warm up and capture on

    def step(self) -> KVStep:
        """A KVStep over the buffers (new each call: a gathered mask is built, and cached, per KVStep)."""
        groups = [
            GroupStep(g.write_pages, g.write_offsets, g.block_table, g.first_pos, self.positions.view(-1, 1),
                       g.page_counts, group.window, self.layout.page_size)
            for g, group in zip(self.groups, self.layout.groups, strict=True)
        ]
        return KVStep.of_tensors(self.storage, groups, self.row_seq, self.positions, self.last_position, self.workspace)

    def fill(self, slices: list[KVSlice], tokens: list[int]) -> None:
        """The step's rows into the buffers: slice b (one new token, `tokens[b]`) is row b; the rest are padding,
        writing to offset 0 of the scratch page and attending to it alone. Only the block tables' leading columns
        that this step or the last one listed are written: a step costs what its histories do, not what
        `max_model_len` does."""
        n, size, ps = len(slices), self.size, self.layout.page_size
        self.input_ids.copy_(_host([*tokens, *[0] * (size - n)]), non_blocking=True)
        self.positions.copy_(_host([s.start for s in slices] + [0] * (size - n)), non_blocking=True)
        for g, buffers in enumerate(self.groups):
            counts = np.ones(size, dtype=np.int32)
            counts[:n] = [len(s.pages[g]) for s in slices]
            span = max(int(counts.max()), self._spans[g])
            self._spans[g] = int(counts.max())
            block_table = np.full((size, span), self.scratch, dtype=np.int64)
            first_pos = np.full((size, span), NO_POSITION, dtype=np.int64)
            first_pos[n:, 0] = 0
            write_pages = np.full(size, self.scratch, dtype=np.int64)
            write_offsets = np.zeros(size, dtype=np.int64)
            for b, s in enumerate(slices):
                pages, indices = s.pages[g], s.page_indices[g]
                block_table[b, : len(pages)] = pages
                first_pos[b, : len(pages)] = indices
                first_pos[b, : len(pages)] *= ps
                write_pages[b] = pages[bisect_left(indices, s.start // ps)]
                write_offsets[b] = s.start % ps
            for buffer, values in zip(
                (buffers.block_table[:, :span], buffers.first_pos[:, :span], buffers.page_counts, buffers.write_pages,
                 buffers.write_offsets),
                (block_table, first_pos, counts, write_pages, write_offsets), strict=True,
            ):
                buffer.copy_(torch.from_numpy(values), non_blocking=True)

    def fits(self, slices: list[KVSlice]) -> bool:
        """Whether each slice's page lists fit the block tables' width."""
        return all(len(s.pages[g]) <= buffers.block_table.shape[1] for s in slices for g, buffers in enumerate(self.groups))

    def attention(self) -> AttentionBatch:
        """What the next run attends with: the captured step's where there is a graph, else a new one."""
        return self.captured if self.graph is not None else self.choose([1] * self.size, self.step())  # type: ignore[return-value]

    def run(self, model: torch.nn.Module, batch: AttentionBatch) -> torch.Tensor:
        """Logits [size, vocab] of the step the buffers hold: the graph replayed where one was captured, else
        computed eagerly with `batch` (from `attention`)."""
        if self.graph is not None:
            self.graph.replay()
            return self.logits  # type: ignore[return-value]
        return model.logits(model(self.input_ids, self.positions, batch))

    def capture(self, model: torch.nn.Module, pool: tuple[int, int] | None) -> None:
        """Warm up on a side stream (allocations and lazy tables settle outside the graph), then capture the step
        over a new KVStep, so that whatever it builds from the buffers (a gathered mask) is built inside the graph."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.run(model, self.attention())
        torch.cuda.current_stream().wait_stream(side)
        graph, batch = torch.cuda.CUDAGraph(), self.attention()
        with torch.cuda.graph(graph, pool=pool):
            self.logits = self.run(model, batch)
        self.graph, self.captured = graph, batch


class DecodeGraphs:
    """Every bucket of one engine's decode steps, and the scratch page their padding rows use."""

    def __init__(
        self, storage: PageStorage, max_num_seqs: int, max_model_len: int, scratch: int, choose: AttentionChooser,
    ) -> None:
        storage.page(scratch).zero_()  # finite: a masked read of it must not turn a row's sum into NaN
        ps = storage.layout.page_size
        history = -(-max_model_len // ps)
        widths = [history if group.window is None else min(history, -(-group.window // ps) + 1)
                  for group in storage.layout.groups]
        self.buckets = [DecodeBucket(size, storage, widths, scratch, max_model_len - 1, choose)
                        for size in bucket_sizes(max_num_seqs)]
        self.capture_s = 0.0

    def bucket(self, slices: list[KVSlice]) -> DecodeBucket | None:
        """The smallest bucket a decode step of these slices fits, None if none does (the step runs eagerly)."""
        if any(s.num_tokens != 1 or s.stream or any(s.tiered) for s in slices):
            return None
        bucket = next((b for b in self.buckets if b.size >= len(slices)), None)
        return bucket if bucket is not None and bucket.fits(slices) else None

    def capture(self, model: torch.nn.Module) -> None:
        """A CUDA graph per bucket, largest first, all in one memory pool (they never run at once)."""
        started = time.perf_counter()
        pool = None
        with torch.inference_mode():
            for bucket in reversed(self.buckets):
                bucket.capture(model, pool)
                pool = bucket.graph.pool()  # type: ignore[union-attr]
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - started
        logger.info("captured %d decode graphs (batch sizes %s) in %.2f s", len(self.buckets),
                    ", ".join(str(b.size) for b in self.buckets), self.capture_s)


def _host(values: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=np.int64))
