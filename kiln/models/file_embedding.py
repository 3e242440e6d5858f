"""FileEmbedding: token embeddings read from the weight file row by row, not held in memory.

Why: in a small quantised model the embedding table is most of the weights (Gemma 3 270M: 671 MB of
float32 beside 270 MB of int8 projections) yet a step reads only the rows of its new tokens. A copy
holds the whole table resident; a memory map of the file is no better in practice, since the kernel maps
pages around each faulting one, so scattered lookups soon hold hundreds of megabytes. Reading the rows
with pread costs one system call per distinct token of a step (from the page cache after the first
read) and holds nothing: the table stays in the file, shared with every other process that reads it.
The rows are decoded as they are read (float32, float16, bfloat16, or a GGUF block format such as Q8_0),
to exactly the values the whole table would decode to. Used only where the table serves lookups alone
(CausalLM.map_embeddings): a head computing with it would read the whole table every step.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

_BLOCK_ROWS = 4096
RowDecoder = Callable[[np.ndarray], np.ndarray]  # uint8 [n, row_bytes] -> float32 [n, cols]


@dataclass(frozen=True)
class StoredRows:
    """Where a [rows, cols] matrix lies in a file: row r is the `row_bytes` bytes at offset + r * row_bytes,
    which `decode` turns into float32."""

    path: Path
    offset: int
    rows: int
    cols: int
    row_bytes: int
    decode: RowDecoder

    def read(self, ids: list[int], fd: int) -> np.ndarray:
        """float32 [len(ids), cols]: rows `ids` (each in [0, rows)) read through the open descriptor `fd`."""
        raw = np.empty((len(ids), self.row_bytes), dtype=np.uint8)
        for index, row in enumerate(ids):
            if os.preadv(fd, [memoryview(raw[index])], self.offset + row * self.row_bytes) != self.row_bytes:
                raise OSError(f"{self.path} is shorter than its header says (row {row})")
        return self.decode(raw).reshape(len(ids), self.cols)

    def read_all(self) -> torch.Tensor:
        """The whole matrix, float32 (a fresh copy), decoded a block of rows at a time so that no decoding
        temporary is the size of the matrix."""
        out = torch.empty(self.rows, self.cols)
        start = 0
        for block in self.blocks():
            out[start : start + len(block)] = block
            start += len(block)
        return out

    def blocks(self) -> Iterator[torch.Tensor]:
        """The matrix as consecutive float32 blocks of rows, each read and decoded when asked for."""
        with self.path.open("rb") as file:
            file.seek(self.offset)
            for start in range(0, self.rows, _BLOCK_ROWS):
                raw = np.empty((min(_BLOCK_ROWS, self.rows - start), self.row_bytes), dtype=np.uint8)
                if file.readinto(raw) != raw.nbytes:
                    raise OSError(f"{self.path} is shorter than its header says (rows from {start})")
                yield torch.from_numpy(self.decode(raw).reshape(len(raw), self.cols))


class FileEmbedding(nn.Module):
    """forward(ids [N] long) -> [N, cols] float32, the rows of a StoredRows. Ids must lie in [0, rows)
    (the engine refuses others before they reach a model)."""

    def __init__(self, table: StoredRows) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.rows, table.cols
        self._fd = os.open(table.path, os.O_RDONLY)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table, read from the file (quantising a tied LM head needs it once)."""
        return self.table.read_all()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        rows = torch.from_numpy(self.table.read(unique.tolist(), self._fd))
        return rows[inverse].reshape(*ids.shape, self.embedding_dim)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, file={self.table.path}"
