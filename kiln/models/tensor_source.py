"""TensorSource: a model's float32 tensors under Hugging Face names, read from their files when asked.

Why: the engine builds its model once and then computes with its own copy of the weights (quantised,
packed, or as they are), so float32 tensors held beside it would double the footprint, and reading
them all before building would make the start's peak the size of every tensor at once. A TensorSource
holds no tensor: indexing it reads one (a fresh float32 copy the caller owns), its shapes are known
without reading anything, and where a file stores a matrix row after row, `rows(name)` says where, so
token embeddings can be looked up in the file (kiln/models/file_embedding.py). The loader makes one
per model source: safetensors files here, a GGUF file in kiln/models/gguf_import.py.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from kiln.errors import InvalidArgumentError
from kiln.models.file_embedding import RowDecoder, StoredRows

# safetensors dtypes whose rows decode to float32 exactly.
_ROW_DECODERS: dict[str, RowDecoder] = {
    "F32": lambda raw: raw.view(np.float32),
    "F16": lambda raw: raw.view(np.float16).astype(np.float32),
    "BF16": lambda raw: (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32),
}


@dataclass(frozen=True)
class FileBlocks:
    """A matrix as a GGUF file stores it: `rows` rows of GGML type `ggml_type` from byte `offset` of `path`
    (kiln/models/gguf_blocks.py computes with them there). `row_order[r]` is the stored row holding the
    checkpoint's row r, where llama.cpp's converter reordered them (None: the same order)."""

    path: Path
    offset: int
    rows: int
    ggml_type: int
    row_order: tuple[int, ...] | None = None


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a source: its torch shape, how to read it (float32), its rows when the file stores
    it as a matrix of rows that decode on their own, and its blocks when a GGUF file stores it."""

    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]
    rows: StoredRows | None = None
    blocks: FileBlocks | None = None


class TensorSource(Mapping[str, torch.Tensor]):
    """name -> float32 tensor, read when indexed (each lookup reads the file again: keep what you need)."""

    def __init__(self, stored: Mapping[str, StoredTensor]) -> None:
        self._stored = dict(stored)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._stored[name].read()

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor
        return name in self._stored

    def __iter__(self) -> Iterator[str]:
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._stored[name].shape

    def rows(self, name: str) -> StoredRows | None:
        """Where matrix `name` lies row by row, or None when its file does not store it so."""
        stored = self._stored.get(name)
        return None if stored is None else stored.rows

    def blocks(self, name: str) -> FileBlocks | None:
        """Where matrix `name` lies as a GGUF file's blocks, or None when it does not."""
        stored = self._stored.get(name)
        return None if stored is None else stored.blocks

    def with_blocks_of(self, other: TensorSource) -> TensorSource:
        """These tensors, each with `other`'s blocks of the same name (a GGUF file's, beside its float32
        conversion kept in the weight cache)."""
        return TensorSource({name: replace(stored, blocks=other.blocks(name)) for name, stored in self._stored.items()})

    def renamed(self, rename: Callable[[str], str]) -> TensorSource:
        return TensorSource({rename(name): stored for name, stored in self._stored.items()})

    def only(self, names: Collection[str]) -> TensorSource:
        return TensorSource({name: stored for name, stored in self._stored.items() if name in names})


def shapes_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, without reading a TensorSource's tensors."""
    if isinstance(tensors, TensorSource):
        return {name: tensors.shape(name) for name in tensors}
    return {name: tuple(tensor.shape) for name, tensor in tensors.items()}


def safetensors_source(files: Sequence[Path]) -> TensorSource:
    """The tensors of safetensors files, under their stored names. Raises InvalidArgumentError for a
    file that is not safetensors."""
    stored: dict[str, StoredTensor] = {}
    for file in files:
        header, data_start = safetensors_header(file)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            shape = tuple(entry["shape"])
            stored[name] = StoredTensor(shape, _reader(file, name), _rows(file, entry, shape, data_start))
    return TensorSource(stored)


def safetensors_header(file: Path) -> tuple[dict, int]:
    """A safetensors file's JSON header (name -> dtype, shape, data_offsets) and where its data starts."""
    try:
        with file.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            return json.loads(handle.read(size)), 8 + size
    except (OSError, ValueError, struct.error) as error:
        raise InvalidArgumentError(f"{file} is not a readable safetensors file: {error}") from error


def _reader(file: Path, name: str) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        try:
            with safe_open(file, framework="pt") as handle:
                return handle.get_tensor(name).float()
        except (SafetensorError, OSError) as error:
            raise InvalidArgumentError(f"{file} is not a readable safetensors file: {error}") from error

    return read


def _rows(file: Path, entry: dict, shape: tuple[int, ...], data_start: int) -> StoredRows | None:
    decode = _ROW_DECODERS.get(entry["dtype"])
    if decode is None or len(shape) != 2:
        return None
    rows, cols = shape
    start, end = entry["data_offsets"]
    return StoredRows(file, data_start + start, rows, cols, (end - start) // max(rows, 1), decode)

