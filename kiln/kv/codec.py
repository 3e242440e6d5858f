"""KV codecs: how one KV page is stored as bytes at rest (the seed's KVCompressor contract).

A page is `[2 (K, V), slots, page_size, kv_heads, head_dim]` (kiln/kv/storage.py). A codec turns it into
a fixed number of bytes (`page_nbytes`), laid out as 2 * slots independent segments (K of slot 0, ...,
V of slot 0, ...), so attention can decode the one layer it needs (`decode_slot`) without touching the
others. Fixed size, so a disk tier is an array of equal slots. Snapshots can share this format.

- `none`: the page's own dtype, bit for bit.
- `int8`: per token and head, symmetric, scale absmax / 127 in float16. Error per element is at most
  ~absmax / 254 of its (token, head) row (`max_error` states the bound exactly).
- `int4`: KIVI: keys per channel (scale and zero point per (head, channel) over the page's tokens: key
  outliers live in channels), values per token in groups of 32 channels (scale and zero point per
  (token, head, group)); 4-bit codes, two per byte, float16 scales. Error at most ~(max - min) / 30 of
  its group.

A lattice codec (D4/E8) would have to beat int4 at equal bits to earn a place; not built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kiln.errors import InvalidArgumentError
from kiln.kv.layout import KVLayout

CODECS = ("none", "int8", "int4")
INT4_VALUE_GROUP = 32  # channels per value quantisation group (KIVI's group size)
_TINY = 1e-30  # floor for a scale: an all-zero row encodes to zeros, not NaN


@dataclass(frozen=True)
class _Segment:
    """How one [page_size, kv_heads, head_dim] tensor is coded: `reduce` is the dim(s) a scale spans."""

    bits: int  # 0 = raw
    reduce: tuple[int, ...]  # dims of the view [page_size, kv_heads, groups, group] one scale spans
    group: int  # channels per group along head_dim (head_dim itself = no grouping)
    symmetric: bool


class KVCodec:
    """encode / decode pages to and from bytes; `bytes_per_token` is what one token costs at rest."""

    def __init__(self, name: str, layout: KVLayout, dtype: torch.dtype) -> None:
        if name not in CODECS:
            raise InvalidArgumentError(f"kv_codec must be one of {list(CODECS)}, got {name!r}", "kv_codec")
        self.name = name
        self.layout = layout
        self.dtype = dtype
        dim = layout.head_dim
        if name == "none":
            self.key = self.value = _Segment(0, (), dim, True)
        elif name == "int8":
            self.key = self.value = _Segment(8, (2, 3), dim, True)
        else:
            self.key = _Segment(4, (0,), dim, False)
            self.value = _Segment(4, (3,), math.gcd(dim, INT4_VALUE_GROUP), False)
        self._shape = (layout.page_size, layout.num_kv_heads, dim)
        self._sizes = [self._segment_bytes(self.key)] * layout.slots + [self._segment_bytes(self.value)] * layout.slots
        self._offsets = [sum(self._sizes[:i]) for i in range(len(self._sizes))]
        self.page_nbytes = sum(self._sizes)

    def bytes_per_token(self) -> float:
        """Bytes one token of one KV group costs at rest (all its layers, K and V)."""
        return self.page_nbytes / self.layout.page_size

    def max_error(self, segment: torch.Tensor, kind: int) -> torch.Tensor:
        """Per-element bound on |decode(encode(x)) - x| for a [page_size, kv_heads, head_dim] segment
        (kind 0 = K, 1 = V): half a quantisation step, with room for the float16 scale's rounding."""
        spec = self.key if kind == 0 else self.value
        if spec.bits == 0:
            return torch.zeros_like(segment, dtype=torch.float32)
        grouped = self._grouped(segment.float(), spec)
        top = grouped.abs().amax(dim=spec.reduce, keepdim=True)
        if spec.symmetric:
            step = top / (2 ** (spec.bits - 1) - 1)
        else:
            step = (grouped.amax(dim=spec.reduce, keepdim=True) - grouped.amin(dim=spec.reduce, keepdim=True)) / (2**spec.bits - 1)
        bound = step * (0.5 + 2**-9) + top * 2**-10
        return (bound + torch.zeros_like(grouped)).reshape(segment.shape)

    # ---- pages ----------------------------------------------------------------------------------------

    def encode(self, page: torch.Tensor) -> torch.Tensor:
        """[2, slots, page_size, kv_heads, head_dim] -> uint8 [page_nbytes]."""
        out = torch.empty(self.page_nbytes, dtype=torch.uint8)
        for kind in range(2):
            for slot in range(self.layout.slots):
                index = kind * self.layout.slots + slot
                start = self._offsets[index]
                out[start : start + self._sizes[index]] = self._encode_segment(page[kind, slot], self.key if kind == 0 else self.value)
        return out

    def decode(self, data: torch.Tensor) -> torch.Tensor:
        """uint8 [page_nbytes] -> [2, slots, page_size, kv_heads, head_dim] in the codec's dtype."""
        slots = [self.decode_slot(data, slot) for slot in range(self.layout.slots)]
        return torch.stack([torch.stack([k for k, _ in slots]), torch.stack([v for _, v in slots])])

    def decode_slot(self, data: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one slot, each [page_size, kv_heads, head_dim] in the codec's dtype."""
        parts = []
        for kind, spec in ((0, self.key), (1, self.value)):
            index = kind * self.layout.slots + slot
            start = self._offsets[index]
            parts.append(self._decode_segment(data[start : start + self._sizes[index]], spec))
        return parts[0], parts[1]

    # ---- segments -------------------------------------------------------------------------------------

    def _segment_bytes(self, spec: _Segment) -> int:
        ps, heads, dim = self.layout.page_size, self.layout.num_kv_heads, self.layout.head_dim
        if spec.bits == 0:
            return ps * heads * dim * torch.empty(0, dtype=self.dtype).element_size()
        scales = math.prod(self._scale_shape(spec))
        return -(-ps * heads * dim * spec.bits // 8) + scales * 2 * (1 if spec.symmetric else 2)

    def _scale_shape(self, spec: _Segment) -> tuple[int, ...]:
        grouped = (*self._shape[:2], self._shape[2] // spec.group, spec.group)
        return tuple(1 if d in spec.reduce else n for d, n in enumerate(grouped))

    def _grouped(self, x: torch.Tensor, spec: _Segment) -> torch.Tensor:
        return x.reshape(*self._shape[:2], self._shape[2] // spec.group, spec.group)

    def _encode_segment(self, x: torch.Tensor, spec: _Segment) -> torch.Tensor:
        if spec.bits == 0:
            return x.to(self.dtype).contiguous().view(-1).view(torch.uint8)
        grouped, dims, levels = self._grouped(x.float(), spec), spec.reduce, 2**spec.bits - 1
        if spec.symmetric:
            half = levels // 2
            scale = (grouped.abs().amax(dim=dims, keepdim=True) / half).clamp_min(_TINY).half()
            codes = torch.round(grouped / scale.float()).clamp_(-half, half).to(torch.int8)
            parts = [codes.view(torch.uint8).reshape(-1), scale.view(torch.uint8).reshape(-1)]
        else:
            low = grouped.amin(dim=dims, keepdim=True).half()
            scale = ((grouped.amax(dim=dims, keepdim=True) - low.float()) / levels).clamp_min(_TINY).half()
            codes = torch.round((grouped - low.float()) / scale.float()).clamp_(0, levels).to(torch.uint8).reshape(-1)
            packed = codes[0::2] | (codes[1::2] << 4)
            parts = [packed, scale.view(torch.uint8).reshape(-1), low.view(torch.uint8).reshape(-1)]
        return torch.cat(parts)

    def _decode_segment(self, data: torch.Tensor, spec: _Segment) -> torch.Tensor:
        if spec.bits == 0:
            return data.view(self.dtype).view(self._shape)
        count = math.prod(self._shape)
        code_bytes = -(-count * spec.bits // 8)
        scale_count = math.prod(self._scale_shape(spec))
        scale = data[code_bytes : code_bytes + 2 * scale_count].view(torch.float16).float().view(self._scale_shape(spec))
        grouped_shape = (*self._shape[:2], self._shape[2] // spec.group, spec.group)
        if spec.symmetric:
            codes = data[:code_bytes].view(torch.int8).float().view(grouped_shape)
            values = codes * scale
        else:
            packed = data[:code_bytes]
            codes = torch.stack((packed & 15, packed >> 4), dim=1).reshape(-1)[:count].float().view(grouped_shape)
            low = data[code_bytes + 2 * scale_count : code_bytes + 4 * scale_count].view(torch.float16).float()
            values = codes * scale + low.view(self._scale_shape(spec))
        return values.view(self._shape).to(self.dtype)
