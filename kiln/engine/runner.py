"""ModelRunner: a step's chunks -> model inputs over the KV pages -> forward -> logits of chosen rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate, chain

import torch

from kiln.engine.decode_graphs import DecodeBucket, DecodeGraphs
from kiln.engine.sequence import Sequence
from kiln.kernels import kernels
from kiln.kv.layout import KVLayout
from kiln.kv.step import KVSlice, KVStep, Workspace
from kiln.kv.storage import PageStorage
from kiln.kv.tiers import PageTiers
from kiln.models.attention import AttentionBatch
from kiln.platform import Platform


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    logit_rows: torch.Tensor  # [M] rows whose logits the step returns, in chunk order
    attention: AttentionBatch
    decode: DecodeBucket | None = None  # a decode step run over this bucket's static buffers (and graph)


@dataclass
class Chunk:
    """`num_tokens` new tokens of `seq` from its first uncomputed one, the last len(draft) of them a
    speculative draft that is not (yet) part of its tokens; logits for the last `logit_rows`."""

    seq: Sequence
    num_tokens: int
    logit_rows: int = 1
    draft: list[int] = field(default_factory=list)

    def input_ids(self) -> list[int]:
        start = self.seq.num_computed
        return [*self.seq.tokens[start : start + self.num_tokens - len(self.draft)], *self.draft]


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, storage: PageStorage, batch_invariant: bool = False,
        tiers: PageTiers | None = None, stream_pages: int = 64,
    ) -> None:
        self.model = model
        self.tiers = tiers  # where `restore` sequences' evicted pages are read from
        self.stream_pages = stream_pages  # pages per chunk of streamed attention
        self.batch_invariant = batch_invariant  # the deterministic mode's attention kernel
        # Steps of few rows per sequence (decode, verification; see AttentionBatch) attend with the in-place
        # kernel where it runs: float32, float16 or int8 / int4 coded pages on an AVX2 CPU.
        self.kernel_attention = storage.kernel_pages
        # The same steps on a GPU attend with the Triton kernel over the pages in place; a fresh prompt's causally
        # over its own keys (SDPA's flash kernel there).
        self.paged_kernel = Platform.of(storage.device).paged_attention
        self.flash_prompt = not Platform.of(storage.device).on_host
        if self.kernel_attention or batch_invariant:
            kernels()  # built (or loaded) now, not inside the first request
        self.storage = storage
        self.layout: KVLayout = storage.layout
        self.workspace = Workspace()
        self.graphs: DecodeGraphs | None = None  # `use_decode_graphs`

    def use_decode_graphs(self, max_num_seqs: int, max_model_len: int, scratch: int, capture: bool) -> DecodeGraphs:
        """Decode steps from now on run over static buffers padded to batch-size buckets (kiln/engine/decode_graphs.py),
        their padding rows writing to page `scratch`, which nothing else may use; `capture`: as CUDA graphs."""
        self.graphs = DecodeGraphs(self.storage, max_num_seqs, max_model_len, scratch, self.attention)
        if capture:
            self.graphs.capture(self.model)
        return self.graphs

    def attention(self, lengths: list[int], kv: KVStep) -> AttentionBatch:
        """How a step of sequences with `lengths` new tokens over `kv` attends (AttentionBatch.for_lengths)."""
        return AttentionBatch.for_lengths(lengths, kv, self.batch_invariant, self.kernel_attention, self.paged_kernel,
                                          self.flash_prompt)

    def prepare(self, chunks: list[Chunk]) -> StepInputs:
        """Everything the forward needs, read from the sequences' page tables (call under the engine
        lock: the tables must not change while this runs; the forward itself needs no lock)."""
        device = self.storage.device
        slices = [self._slice(c.seq, c.num_tokens) for c in chunks]
        plain_decode = self.graphs is not None and all(c.logit_rows == 1 and not c.draft for c in chunks)
        if plain_decode and (bucket := self.graphs.bucket(slices)) is not None:  # type: ignore[union-attr]
            return self._static_decode(bucket, [c.seq.tokens[c.seq.num_computed] for c in chunks], slices)
        lengths = [c.num_tokens for c in chunks]
        ends = list(accumulate(lengths))
        rows = [row for c, end in zip(chunks, ends, strict=True) for row in range(end - c.logit_rows, end)]
        kv = KVStep(self.storage, slices, self.workspace, self.tiers, self.stream_pages)
        return StepInputs(
            input_ids=torch.tensor([t for c in chunks for t in c.input_ids()], device=device),
            positions=kv.row_pos,
            logit_rows=torch.tensor(rows, dtype=torch.long, device=device),
            attention=self.attention(lengths, kv),
        )

    def prepare_ahead(self, chunks: list[Chunk], ids: torch.Tensor) -> StepInputs | None:
        """A decode step (one row per chunk) whose input tokens are `ids` [len(chunks)], still on the device: the
        previous step's samples, not yet in the sequences (kiln/engine/run_ahead.py). None where no bucket of
        static buffers holds it (no decode graphs, or pages they cannot list)."""
        slices = [self._slice(c.seq, 1) for c in chunks]
        bucket = self.graphs.bucket(slices) if self.graphs is not None else None
        if bucket is None:
            return None
        inputs = self._static_decode(bucket, [0] * len(chunks), slices)
        inputs.input_ids.copy_(ids)  # on the device, after the step that sampled them
        return inputs

    def _static_decode(self, bucket: DecodeBucket, tokens: list[int], slices: list[KVSlice]) -> StepInputs:
        bucket.fill(slices, tokens)
        n = len(slices)
        return StepInputs(bucket.input_ids[:n], bucket.positions[:n], bucket.row_seq[:n], bucket.attention(), bucket)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """Write K/V for every chunk's tokens; return float32 logits [M, vocab] of the requested rows, None
        if none were. The LM head is the biggest matmul of a small model, so rows nobody samples from
        (intermediate prefill chunks) skip it."""
        if inputs.decode is not None:
            return inputs.decode.run(self.model, inputs.attention)[: len(inputs.logit_rows)]
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.attention)
        if not inputs.logit_rows.numel():
            return None
        return self.model.logits(hidden[inputs.logit_rows])

    def _slice(self, seq: Sequence, size: int) -> KVSlice:
        """Each group's pages a query at the chunk's first position (or later) may read: from the pool,
        or (a `restore` sequence's evicted pages) from a tier."""
        start, ps = seq.num_computed, self.layout.page_size
        pages: list[list[int]] = []
        indices: list[list[int]] = []
        tiered: list[list[tuple[int, tuple[int, bytes]]]] = []
        for g, (group, table) in enumerate(zip(self.layout.groups, seq.table.pages, strict=True)):
            spans = seq.table.policy.readable(group.window, len(table), start, ps)
            # Whole spans copied by slicing: these lists grow with the history, and a step builds them anew.
            index = list(chain.from_iterable(spans))
            in_tier = seq.table.tiered[g]
            tiered.append([(i, (g, seq.table.hashes[i])) for i in sorted(in_tier)])
            if in_tier:
                index = [i for i in index if i not in in_tier]
                listed = [table[i] for i in index]
            else:
                listed = list(chain.from_iterable(table[span.start : span.stop] for span in spans))
            if None in listed:
                raise RuntimeError("a page the attention reads was released")
            pages.append(listed)  # type: ignore[arg-type]
            indices.append(index)
        return KVSlice(start, size, pages, indices, tiered, stream=seq.table.policy.tiered)
