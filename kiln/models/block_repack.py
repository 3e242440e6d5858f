"""GGUF blocks repacked eight rows to a group, the layouts kernels/blocks.h describes (kRepacked): one
vector lane holds one row, so a group's scales and float steps are one vector operation for eight rows,
its input codes are four bytes broadcast to every lane, and no row ends in a horizontal sum. Decoding and
prefill both computed 1.4-2x faster this way than row by row (bench/README.md § gguf_sizes); llama.cpp
repacks its common types for the same reason.

The bytes stay the file's bytes, rearranged: each format keeps its size, except Q4_K, whose 6-bit scales
and minimums are unpacked (148 bytes a row-block against the file's 144).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as GGML
from gguf.constants import GGML_QUANT_SIZES

REPACKED = 1000  # blocks.h's kRepacked: REPACKED + a GGML type is that type repacked
GROUP_ROWS = 8
REPACKABLE = frozenset({GGML.Q4_0, GGML.Q4_1, GGML.Q5_0, GGML.Q5_1, GGML.Q8_0, GGML.IQ4_NL, GGML.Q4_K, GGML.Q6_K})


def repack(stored: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Rows of `ggml_type` blocks as the file stores them (uint8 [rows, bytes per row], rows a multiple
    of 8) in the type's repacked layout: uint8, group after group, each group's blocks in order."""
    values, size = GGML_QUANT_SIZES[GGML(ggml_type)]
    rows, blocks = stored.shape[0], stored.shape[1] // size
    raw = stored.reshape(rows // GROUP_ROWS, GROUP_ROWS, blocks, size).transpose(1, 2)  # [group, block, row, byte]
    if ggml_type == GGML.Q4_K:
        parts = _q4_k(raw)
    elif ggml_type == GGML.Q6_K:
        parts = _q6_k(raw)
    else:
        parts = _blocks_of_32(raw, GGML(ggml_type))
    return torch.cat([part.reshape(*raw.shape[:2], -1) for part in parts], dim=-1).flatten()


def _by_row(raw: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Bytes [start, end) of every row's block, row after row: [group, block, 8 * (end - start)]."""
    return raw[..., start:end].flatten(2)


def _nibble_vectors(values: torch.Tensor) -> torch.Tensor:
    """4-bit codes [group, block, row, ..., 32 * n] (in value order) as nibble vectors: per 8 values, each
    row's 4 bytes, byte k holding value 8q + k (low nibble) and 8q + 4 + k (high): [group, block, ..., q, row, 4]."""
    shaped = values.reshape(*values.shape[:-1], -1, 2, 4)  # [..., q, half, k]
    packed = shaped[..., 0, :] | (shaped[..., 1, :] << 4)  # [group, block, row, ..., q, k]
    return packed.movedim(2, -2)


def _blocks_of_32(raw: torch.Tensor, ggml_type: GGML) -> list[torch.Tensor]:
    """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL: the scales by row, then the fifth bits, then the codes."""
    if ggml_type == GGML.Q8_0:
        codes = raw[..., 2:34].reshape(*raw.shape[:3], 8, 4).movedim(2, -2)  # [group, block, v, row, 4]
        return [_by_row(raw, 0, 2), codes]
    scales = 4 if ggml_type in (GGML.Q4_1, GGML.Q5_1) else 2
    fifth = ggml_type in (GGML.Q5_0, GGML.Q5_1)
    nibbles = raw[..., scales + 4 * fifth :]
    values = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)  # value j and j + 16 of ggml's layout, in order
    parts = [_by_row(raw, 0, 2)] + ([_by_row(raw, 2, 4)] if scales == 4 else [])
    if fifth:
        words = raw[..., scales : scales + 4].to(torch.int64)
        word = words[..., 0] | (words[..., 1] << 8) | (words[..., 2] << 16) | (words[..., 3] << 24)
        bits = (word.unsqueeze(-1) >> torch.arange(32)) & 1  # [group, block, row, value]
        by_place = bits.reshape(*bits.shape[:3], 4, 2, 4)  # [.., q, h, k]: value 8q + 4h + k
        weights = (1 << (2 * torch.arange(4).view(4, 1, 1) + torch.arange(2).view(1, 2, 1)))  # bit 2q + h
        fifth_bits = (by_place * weights).sum(dim=(-3, -2)).to(torch.uint8)  # [group, block, row, k]
        parts.append(fifth_bits)
    return [*parts, _nibble_vectors(values)]


def _q4_k(raw: torch.Tensor) -> list[torch.Tensor]:
    """d, dmin by row; scales [sub-block][row]; minimums [pair][row][2]; per sub-block its nibble vectors."""
    packed = raw[..., 4:16].to(torch.int32)  # ggml's get_scale_min_k4, for all eight sub-blocks at once
    low, high = packed[..., :4], packed[..., 4:8]
    scales = torch.cat([low & 63, (packed[..., 8:] & 15) | ((low >> 6) << 4)], dim=-1)
    minimums = torch.cat([high & 63, (packed[..., 8:] >> 4) | ((high >> 6) << 4)], dim=-1)
    codes = raw[..., 16:].reshape(*raw.shape[:3], 4, 32)  # sub-block 2c: low nibbles of chunk c; 2c + 1: high
    values = torch.stack([codes & 15, codes >> 4], dim=-2).reshape(*raw.shape[:3], 8, 32)
    return [_by_row(raw, 0, 2), _by_row(raw, 2, 4), scales.transpose(2, 3).to(torch.uint8),
            minimums.reshape(*minimums.shape[:3], 4, 2).movedim(2, 3).to(torch.uint8), _nibble_vectors(values)]


def _q6_k(raw: torch.Tensor) -> list[torch.Tensor]:
    """d by row; scales [sub-block][row]; per sub-block of 16 its 2 nibble vectors and its top-bit vector."""
    ql = raw[..., :128].reshape(*raw.shape[:3], 2, 2, 32)  # [.., half p, a, l]
    qh = raw[..., 128:192].reshape(*raw.shape[:3], 2, 1, 32)
    low = torch.stack([ql & 15, ql >> 4], dim=-3).reshape(*raw.shape[:3], 256)  # value 128p + 32 (2 nib + a) + l
    top = ((qh >> (2 * torch.arange(4, dtype=torch.uint8).view(4, 1))) & 3).reshape(*raw.shape[:3], 256)
    sub_low = low.reshape(*raw.shape[:3], 16, 16)
    nibbles = _nibble_vectors(sub_low)  # [group, block, sub, 2, row, 4]
    by_place = top.reshape(*raw.shape[:3], 16, 2, 2, 4)  # [.., sub, q, h, k]: value 8q + 4h + k
    top_bits = (by_place[..., 0, 0, :] | (by_place[..., 0, 1, :] << 4) | (by_place[..., 1, 0, :] << 2)
                | (by_place[..., 1, 1, :] << 6))  # [group, block, row, sub, k]
    codes = torch.cat([nibbles.flatten(-3), top_bits.movedim(2, 3).flatten(-2)], dim=-1)  # [group, block, sub, 96]
    return [_by_row(raw, 208, 210), raw[..., 192:208].transpose(2, 3), codes]
