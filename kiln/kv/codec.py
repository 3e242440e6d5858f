"""KV codecs: how a KV page is stored as bytes, in the pool, in the tiers and in snapshots (the seed's
KVCompressor contract).

A page holds K and V of `slots` layers for `page_size` positions: 2 * slots segments (K of slot 0, ...,
V of slot 0, ...), each the codes of `[page_size, kv_heads, head_dim]` values followed, for a lossy
format, by their float16 scales (and zero points). Every scale covers one token, head and group of 32
channels, so a token is encoded on its own when its K/V is written and a page is never re-encoded: the
pool, the tiers and snapshots hold the same bytes, and attention dequantises on read (in place in
kernels/attention.cpp, or gathered into float32 buffers by `load`). Fixed size (`page_nbytes`), so a
disk tier is an array of equal slots.

- `none`: the KV dtype, bit for bit; the page is the tensor `[2, slots, page_size, kv_heads, head_dim]`.
- `int8`: keys and values symmetric 8-bit, scale absmax / 127 per group (about a quarter of float32's
  bytes). One scale per (token, head) let a key's outlier channels swamp the rest; groups of 32 channels
  do not (bench/README.md § Design figures).
- `int4`: values asymmetric 4-bit per group, scale (max - min) / 15 and zero point min (KIVI's value
  scheme), two codes a byte, the even channel in the low nibble; keys stay 8-bit as in `int8`. KIVI keeps
  keys 4-bit by quantising them per channel across tokens, which needs a page's tokens all at once; pool
  pages are written a token at a time, and 4-bit keys per token cost far more perplexity than 4-bit
  values (bench/README.md § Design figures).

Dequantising is `code * scale` (+ `zero`, a separately rounded add) in float32, the same operations the
C++ kernel makes, so every path reads the same values. `max_error` states each format's bound. A lattice
codec (D4/E8) would have to beat int4 at equal bits to earn a place; not built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kiln.errors import InvalidArgumentError
from kiln.kernels.page_format import GROUP, INT4_MAX, INT8_MAX, TINY_SCALE
from kiln.kv.layout import KVLayout

CODECS = ("none", "int8", "int4")
FORMATS = {"none": (0, 0), "int8": (8, 8), "int4": (8, 4)}  # (key bits, value bits); 0 = the KV dtype as is
_NONE = torch.empty(0, dtype=torch.float16)  # what the kernels take for scales of raw pages, zeros of 8-bit codes


@dataclass(frozen=True)
class Segment:
    """One (K or V, slot) segment of a stack of pages, as typed views of their bytes. The codes' dtype says
    the format: the KV dtype (raw) [n, page_size, kv_heads, head_dim], int8 (8-bit) the same shape, uint8
    (two 4-bit codes a byte) [..., head_dim / 2]; scales, zeros: float16 [n, page_size, kv_heads, groups]
    (None where the format has none)."""

    codes: torch.Tensor
    scales: torch.Tensor | None
    zeros: torch.Tensor | None

    def parts(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        return self.codes, self.scales, self.zeros

    def kernel_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """codes, scales, zeros as the C++ kernels take them (an empty tensor for a part the format lacks)."""
        return self.codes, _NONE if self.scales is None else self.scales, _NONE if self.zeros is None else self.zeros

    def select(self, ids: torch.Tensor) -> Segment:
        """The same segment of pages `ids` only (copies)."""
        return Segment(*(None if t is None else t.index_select(0, ids) for t in self.parts()))


class KVCodec:
    """Encodes K/V rows as they are written and decodes pages on read; `bytes_per_token` is what one
    token of one KV group costs stored."""

    def __init__(self, name: str, layout: KVLayout, dtype: torch.dtype) -> None:
        if name not in CODECS:
            raise InvalidArgumentError(f"kv_codec must be one of {list(CODECS)}, got {name!r}", "kv_codec")
        self.name = name
        self.layout = layout
        self.dtype = dtype  # of the values: `none` stores them in it, the others decode to it
        self.bits = FORMATS[name]  # per kind: K, V
        self.group = math.gcd(layout.head_dim, GROUP)
        rows = layout.page_size * layout.num_kv_heads  # (token, head) rows of a segment
        self._code_nbytes = [rows * self._code_row_bytes(bits) for bits in self.bits]
        self._segment_nbytes = [size + rows * self._scale_count(bits) * 2 for size, bits in zip(self._code_nbytes, self.bits, strict=True)]
        self.page_nbytes = layout.slots * sum(self._segment_nbytes)

    def _code_row_bytes(self, bits: int) -> int:
        dim = self.layout.head_dim
        return {0: dim * torch.empty(0, dtype=self.dtype).element_size(), 8: dim, 4: dim // 2}[bits]

    def _scale_count(self, bits: int) -> int:
        """float16 numbers per (token, head) row: a scale per group (and a zero point for 4 bits)."""
        groups = self.layout.head_dim // self.group
        return {0: 0, 8: groups, 4: 2 * groups}[bits]

    @property
    def encoding(self) -> str:
        """How a page's values are stored, for the KV format's fingerprint: "raw" (the KV dtype) or the name."""
        return "raw" if self.name == "none" else self.name

    @property
    def read_dtype(self) -> torch.dtype:
        """The dtype `load` decodes to: the KV dtype itself for `none`, float32 for the others."""
        return self.dtype if self.name == "none" else torch.float32

    def bytes_per_token(self) -> float:
        """Bytes one token of one KV group costs stored (all its layers, K and V)."""
        return self.page_nbytes / self.layout.page_size

    # ---- views ----------------------------------------------------------------------------------------

    def segment(self, pages: torch.Tensor, kind: int, slot: int) -> Segment:
        """Typed views of segment (kind: 0 = K, 1 = V; slot) of `pages`, uint8 [n, page_nbytes]: writes
        through them land in the pages."""
        n, ps, heads, bits = pages.shape[0], self.layout.page_size, self.layout.num_kv_heads, self.bits[kind]
        start = kind * self.layout.slots * self._segment_nbytes[0] + slot * self._segment_nbytes[kind]
        code_dtype = {0: self.dtype, 8: torch.int8, 4: torch.uint8}[bits]
        codes = pages[:, start : start + self._code_nbytes[kind]].view(code_dtype).view(n, ps, heads, -1)
        if bits == 0:
            return Segment(codes, None, None)
        start += self._code_nbytes[kind]
        groups = self.layout.head_dim // self.group
        size = ps * heads * groups * 2
        scales = pages[:, start : start + size].view(torch.float16).view(n, ps, heads, groups)
        zeros = pages[:, start + size : start + 2 * size].view(torch.float16).view(n, ps, heads, groups) if bits == 4 else None
        return Segment(codes, scales, zeros)

    # ---- rows (written as they are computed) -----------------------------------------------------------

    def quantize(self, x: torch.Tensor, kind: int) -> Segment:
        """x [..., kv_heads, head_dim] -> codes, scales, zeros of `kind`'s format, with the same leading
        dims, each row alone."""
        bits = self.bits[kind]
        if bits == 0:
            return Segment(x.to(self.dtype), None, None)
        grouped = x.float().unflatten(-1, (-1, self.group))
        if bits == 8:
            scale = (grouped.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp_min(TINY_SCALE).half()
            codes = torch.round(grouped / scale.float()).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
            return Segment(codes.flatten(-2), scale.squeeze(-1), None)
        low = grouped.amin(dim=-1, keepdim=True).half()
        scale = ((grouped.amax(dim=-1, keepdim=True) - low.float()) / INT4_MAX).clamp_min(TINY_SCALE).half()
        codes = torch.round((grouped - low.float()) / scale.float()).clamp_(0, INT4_MAX).to(torch.uint8).flatten(-2)
        return Segment(codes[..., 0::2] | (codes[..., 1::2] << 4), scale.squeeze(-1), low.squeeze(-1))

    def dequantize(self, coded: Segment, out: torch.Tensor) -> torch.Tensor:
        """Decoded values of `coded` (its codes' dtype says the format) into `out` ([..., kv_heads,
        head_dim], any float dtype)."""
        if coded.scales is None:
            return out.copy_(coded.codes)
        codes = coded.codes
        if codes.dtype == torch.uint8:
            codes = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)
        values = codes.float().unflatten(-1, (-1, self.group)) * coded.scales.float().unsqueeze(-1)
        if coded.zeros is not None:
            values = values + coded.zeros.float().unsqueeze(-1)
        return out.copy_(values.flatten(-2))

    def store(self, target: Segment, kind: int, index: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> None:
        """Encode rows x [N, kv_heads, head_dim] into (page, offset) = index of `target`, views of
        segments of `kind`."""
        for view, part in zip(target.parts(), self.quantize(x, kind).parts(), strict=True):
            if view is not None:
                view.index_put_(index, part)

    def load(self, source: Segment, ids: torch.Tensor | None, out: torch.Tensor) -> None:
        """Pages `ids` (None: every page) of `source` decoded into out [len(ids), page_size, kv_heads,
        head_dim]."""
        if source.scales is None and ids is not None and out.dtype == source.codes.dtype:
            torch.index_select(source.codes, 0, ids, out=out)  # nothing to decode: straight into the buffer
        else:
            self.dequantize(source if ids is None else source.select(ids), out)

    # ---- whole pages --------------------------------------------------------------------------------

    def encode(self, page: torch.Tensor) -> torch.Tensor:
        """[2, slots, page_size, kv_heads, head_dim] -> uint8 [page_nbytes]."""
        out = torch.zeros(1, self.page_nbytes, dtype=torch.uint8)
        ps = self.layout.page_size
        index = (torch.zeros(ps, dtype=torch.long), torch.arange(ps))
        for kind in range(2):
            for slot in range(self.layout.slots):
                self.store(self.segment(out, kind, slot), kind, index, page[kind, slot])
        return out[0]

    def decode(self, data: torch.Tensor) -> torch.Tensor:
        """uint8 [page_nbytes] -> [2, slots, page_size, kv_heads, head_dim] in the codec's dtype."""
        ps, heads, dim = self.layout.page_size, self.layout.num_kv_heads, self.layout.head_dim
        out = torch.empty(2, self.layout.slots, 1, ps, heads, dim, dtype=self.dtype)
        for kind in range(2):
            for slot in range(self.layout.slots):
                self.load(self.segment(data[None], kind, slot), None, out[kind, slot])
        return out[:, :, 0]

    def clear_from(self, page: torch.Tensor, offset: int) -> None:
        """Zero every byte of positions offset.. of a page (uint8 [page_nbytes]) in every segment."""
        for kind in range(2):
            for slot in range(self.layout.slots):
                for view in self.segment(page[None], kind, slot).parts():
                    if view is not None:
                        view[:, offset:] = 0

    def max_error(self, segment: torch.Tensor, kind: int) -> torch.Tensor:
        """Per-element bound on |decode(encode(x)) - x| for a [page_size, kv_heads, head_dim] segment of
        `kind` (0 = K, 1 = V): half a quantisation step, with room for the float16 scale's (and zero
        point's) rounding."""
        bits = self.bits[kind]
        if bits == 0:
            return torch.zeros_like(segment, dtype=torch.float32)
        grouped = segment.float().unflatten(-1, (-1, self.group))
        top = grouped.abs().amax(dim=-1, keepdim=True)
        if bits == 8:
            step = top / INT8_MAX
        else:
            step = (grouped.amax(dim=-1, keepdim=True) - grouped.amin(dim=-1, keepdim=True)) / INT4_MAX
        bound = step * (0.5 + 2**-9) + top * 2**-9
        return (bound + torch.zeros_like(grouped)).flatten(-2)
