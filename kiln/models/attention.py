"""The paged attention every model layer calls, and the backends that compute it.

The runner flattens a step's new tokens of B sequences into N rows (sequence after sequence, positions
ascending). Each layer hands its new K/V to the step's KVStep, which stores them in the sequences' pages,
and attends over the keys and values each sequence may see (causality, the sliding window and padding
encoded by the KVStep's positions). Models never allocate pages or know how they are laid out.

How a step's layers attend is chosen once per step (AttentionBatch.for_lengths), from what the step's device
can do (the runner's `kernel_attention` and `paged_kernel`, kiln/platform.py) and the step's shape, and is an
AttentionBackend: `InPlaceAttention`, the C++ kernel over the pages where they lie (CPU); `TritonAttention`,
the Triton kernel over the pages where they lie (a GPU, kiln/kernels/triton_attention.py);
`GatheredAttention`, PyTorch matrix products over the pages gathered into contiguous buffers (the reference,
long steps, and every other device's path). For a layer that some `restore` sequence streams, each backend
has its streamed counterpart (kiln/models/streamed_attention.py). A new device's attention is another
backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.kernels import kernels
from kiln.kernels.page_format import CHUNK_TOKENS
from kiln.kv.step import KVStep
from kiln.models.streamed_attention import streamed_attention, tiered_attention

# Steps whose sequences have at most this many queries attend in place (the kernel reads a sequence's keys
# once per block of its rows; gathering pads every sequence to the step's longest and builds a mask). The
# two cost about the same for one sequence's appends, and in place is far cheaper in agents' steps that mix
# decode rows with appends (bench/README.md § Design figures).
IN_PLACE_MAX_ROWS = 64


class AttentionBackend(ABC):
    """How the layers of one step attend over its KVStep's pages."""

    def __init__(self, kv: KVStep) -> None:
        self.kv = kv

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        """Stores the rows' new k, v [N, kv_heads, head_dim] (after RoPE/norms) and returns the attention of q
        [N, heads, head_dim] over what each row may see: [N, heads, head_dim]."""

    def layer_kernel_args(self, layer: int, query_values: int) -> tuple[torch.Tensor | int, ...] | None:
        """What a layer kernel (kernels/decoder_layer.h) needs to store and attend `layer`'s rows itself; None
        where this backend attends them (every backend but the in-place one). `query_values`: the step's
        query floats at that layer."""
        return None


class InPlaceAttention(AttentionBackend):
    """The C++ kernel (kernels/attention.cpp) over the pages where they lie, dequantising coded pages as it reads
    them: no gathered copy, no mask. Always in the deterministic mode (its per-query arithmetic does not depend
    on the step); in other steps where no sequence has more than IN_PLACE_MAX_ROWS rows (decode, speculative
    verification, short appends), where it is faster."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        kv = self.kv
        kv.write(layer, k, v)
        if kv.streams(layer):  # a `restore` sequence's global layer: pool and tier parts merged
            return tiered_attention(q, layer, kv, scale)
        k_pages, v_pages, group, window = kv.pages(layer)
        tail = (group.block_table, group.first_pos, kv.row_seq, kv.row_pos, window or 0, scale)
        query = q.float().contiguous()
        _note_partial_states(kv, query.numel())
        if k_pages.scales is None:
            return kernels().paged_attention(query, k_pages.codes, v_pages.codes, *tail)
        return kernels().paged_attention_coded(query, *k_pages.kernel_parts(), *v_pages.kernel_parts(), *tail)

    def layer_kernel_args(self, layer: int, query_values: int) -> tuple[torch.Tensor | int, ...] | None:
        """KVStep.kernel_args; None where the layer attends otherwise (streaming a tier's pages, or pages the
        kernels do not store)."""
        if not self.kv.storage.kernel_pages or self.kv.streams(layer):
            return None
        _note_partial_states(self.kv, query_values)
        return self.kv.kernel_args(layer)


class GatheredAttention(AttentionBackend):
    """PyTorch over the keys and values each sequence may read, gathered (and decoded) from its pages into
    contiguous buffers, with a mask: one matmul pair per KV head for a decode step, SDPA otherwise.

    query_index: [B, Q] long, row of each (sequence, query) in the flattened tokens; padding repeats a valid
                 row of the same sequence. None when B == 1 (no padding needed).
    query_valid: [B, Q] bool, False on padding.
    prompt:      the step is one sequence's first tokens (KVStep.fresh_prompt): a layer whose window they fit
                 attends over its own new keys and values, causally, with no gather and no mask, which lets a
                 GPU's SDPA take its flash kernel (the pages hold exactly those values).
    """

    def __init__(
        self, kv: KVStep, query_index: torch.Tensor | None = None, query_valid: torch.Tensor | None = None,
        prompt: bool = False,
    ) -> None:
        super().__init__(kv)
        self.query_index = query_index
        self.query_valid = query_valid
        self.prompt = prompt

    @classmethod
    def for_lengths(cls, lengths: list[int], kv: KVStep, flash_prompt: bool = False) -> GatheredAttention:
        """`flash_prompt`: a fresh prompt's layers attend causally over their own keys (a GPU's flash kernel)."""
        if len(lengths) == 1:
            return cls(kv, prompt=flash_prompt and kv.fresh_prompt())
        device = kv.storage.device
        counts = torch.tensor(lengths, device=device)
        starts = torch.cumsum(counts, 0) - counts
        offsets = torch.arange(max(lengths), device=device)[None, :]
        index = starts[:, None] + torch.minimum(offsets, counts[:, None] - 1)
        return cls(kv, index, offsets < counts[:, None])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        kv = self.kv
        kv.write(layer, k, v)
        if kv.streams(layer):  # a `restore` sequence's global layer: chunk by chunk, merged
            return streamed_attention(q, layer, kv, scale)
        if self.prompt and k.dtype == kv.storage.read_dtype and (kv.window(layer) or len(q)) >= len(q):
            return F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, scale=scale,
                enable_gqa=True,
            )[0].transpose(0, 1)
        keys, values, mask = kv.read(layer)
        scores = mask.numel() * q.shape[1]  # [B, heads, Q, L]: scores, then weights
        kv.note_bytes(2 * keys.numel() * keys.element_size() + mask.numel() + 2 * scores * q.element_size())
        if mask.shape[1] == 1:
            return _decode_attention(q, keys.to(q.dtype), values.to(q.dtype), mask[:, 0], scale)
        queries = q.unsqueeze(0) if self.query_index is None else q[self.query_index]
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys.to(q.dtype),
            values.to(q.dtype),
            attn_mask=mask.unsqueeze(1),
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)
        return out[0] if self.query_valid is None else out[self.query_valid]


def paged_attention(*args: object, **options: object) -> torch.Tensor:
    """kernels/triton_attention.py's paged_attention, imported on first use: importing Triton costs every process
    about 0.2 s, and only a GPU's runs it."""
    from kiln.kernels.triton_attention import paged_attention as kernel

    return kernel(*args, **options)  # type: ignore[arg-type]


class TritonAttention(AttentionBackend):
    """The Triton kernel (kernels/triton_attention.py) over the pages where they lie, dequantising coded pages
    as it loads them: no gathered copy, no mask, and no read back on the host, so a step can be captured in a
    CUDA graph. In steps where no sequence has more than IN_PLACE_MAX_ROWS rows (decode, speculative
    verification, short appends): each query row reads its sequence's pages on its own, which longer
    prefill chunks would repeat once per row. Layers that stream a tier's pages take PyTorch's streamed path,
    as GatheredAttention's do."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        kv = self.kv
        kv.write(layer, k, v)
        if kv.streams(layer):  # a `restore` sequence's global layer: chunk by chunk, merged
            return streamed_attention(q, layer, kv, scale)
        k_pages, v_pages, group, window = kv.pages(layer)
        return paged_attention(q, k_pages, v_pages, group.block_table, group.first_pos, group.page_counts,
                               kv.row_seq, kv.row_pos, window or 0, scale)


@dataclass
class AttentionBatch:
    """Everything attention needs for one forward step: its KVStep (where the layers' K/V go and come from)
    and how its layers attend."""

    kv: KVStep
    backend: AttentionBackend

    @classmethod
    def for_lengths(
        cls, lengths: list[int], kv: KVStep, batch_invariant: bool = False, kernel_attention: bool = False,
        paged_kernel: bool = False, flash_prompt: bool = False,
    ) -> AttentionBatch:
        """`kernel_attention`: the C++ kernels attend over this device's pages (a CPU); `paged_kernel`: the
        Triton kernel does (a GPU). Either takes the steps of few rows per sequence; the rest gather, a fresh
        prompt's step with `flash_prompt` causally over its own keys (GatheredAttention)."""
        short = max(lengths) <= IN_PLACE_MAX_ROWS
        if batch_invariant or (kernel_attention and short):
            return cls(kv, InPlaceAttention(kv))
        if paged_kernel and short:
            return cls(kv, TritonAttention(kv))
        return cls(kv, GatheredAttention.for_lengths(lengths, kv, flash_prompt))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        """The step's backend's attention of one layer (AttentionBackend.attend)."""
        return self.backend.attend(q, k, v, layer, scale)

    def layer_kernel_args(self, layer: int, query_values: int) -> tuple[torch.Tensor | int, ...] | None:
        """The step's backend's AttentionBackend.layer_kernel_args."""
        return self.backend.layer_kernel_args(layer, query_values)


def _note_partial_states(kv: KVStep, query_values: int) -> None:
    """The in-place kernel keeps a float32 partial softmax state per query value per chunk, at most."""
    kv.note_bytes(query_values * 4 * (kv.last_position // CHUNK_TOKENS + 1))


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
