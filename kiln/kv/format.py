"""KVFormat: everything that decides the bytes of a KV page, hashed into the prefix-chain salt.

A page written by one engine may be matched by another only if both would have computed the same
bytes: same model weights in the same format and dtype, same KV dtype, same encoding, page size and page layout. Pages
that leave the process (snapshots, tiers) carry this fingerprint, so a different engine never reads them.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch

LAYOUT_VERSION = 1  # bump when the order of bytes inside a page changes


@dataclass(frozen=True)
class KVFormat:
    model_fingerprint: str  # the loaded weights' fingerprint (content hash of the checkpoint)
    weights: str  # compute dtype and weight format ("float32/fp16"): K/V depend on both
    kv_dtype: str
    encoding: str  # how a page's values are stored: "raw" (the KV dtype as is) or a KV codec ("int8", "int4")
    page_size: int
    layout_version: int = LAYOUT_VERSION

    def fingerprint(self) -> bytes:
        """32 bytes naming this format: equal only for formats whose pages are interchangeable."""
        fields = "|".join(f"{key}={value}" for key, value in sorted(asdict(self).items()))
        return hashlib.sha256(fields.encode()).digest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
