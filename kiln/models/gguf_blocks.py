"""The weight format of GGUF block types: linear layers that compute a GGUF file's quantised tensors in
the file's own blocks (kernels/blocks.cpp), from the file mapped into memory.

Why: decoding reads every weight once per token, and on a CPU that read is the bound. Re-quantising a
Q4_K file to int8 read 1.7x the bytes llama.cpp reads, rounded the weights a second time (SmolLM2's
greedy output left llama.cpp's at the first token of a code prompt), and kept a converted copy in the
weight cache and in memory. Here nothing is converted, written or cached: the blocks are the file's.

How: every type is repacked at load, eight rows to a group (kernels/repack.cpp, the layouts
kernels/blocks.h describes), so that a vector lane holds a row; the layer's own memory holds its parts (a
part that does not fill whole groups of eight rows copied as stored beside them), on 2 MiB pages where the
OS gives them (kiln/huge_pages.py), and the file's pages they came from are handed back, so the process
still holds about the file's size. A layer none of whose parts fills whole groups computes them where they
lie in the mapping, whose pages are shared with every other process that maps the file.

Which layers: every linear layer (a fused q/k/v or gate/up layer: each of its tensors) whose tensors are
all in BLOCK_TYPES with its width whole blocks of them, and the LM head (a tied head computes with the
token embedding table's blocks, still looked up row by row: kiln/models/file_embedding.py). Rows that
llama.cpp's converter reordered (llama's q/k, for its RoPE layout) are written back to the checkpoint's
places by the kernel's column map. Other layers (float tensors, the 2- and 3-bit types) keep the int8
path (kiln/models/quant.py); EngineConfig's quantization "auto" chooses this format, "int8" re-quantises
every layer as before.
"""

from __future__ import annotations

import itertools
import mmap
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from gguf import GGMLQuantizationType as GGML
from gguf.constants import GGML_QUANT_SIZES
from torch import nn

from kiln.huge_pages import huge_page_buffer
from kiln.kernels import kernels
from kiln.models.tensor_source import FileBlocks, TensorSource

if TYPE_CHECKING:
    from kiln.models.causal_lm import CausalLM

# The types kernels/blocks.h computes.
BLOCK_TYPES = frozenset(
    GGML[name] for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
)
_EMBEDDINGS = "model.embed_tokens.weight"
GROUP_ROWS = 8  # kernels/blocks.h kGroupRows: rows repacked into one group


class BlockLinear(nn.Module):
    """y = x @ W^T + b: x [..., in_features] float32 -> [..., out_features] float32, W's rows being the
    `parts` (each a tensor's blocks in `data`, the file's bytes) one after another."""

    def __init__(self, file: MappedFile, parts: Sequence[FileBlocks], in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(part.rows for part in parts)
        self.types = tuple(GGML(part.ggml_type).name for part in parts)
        self.bias = bias
        self.nbytes = sum(part.rows * row_bytes(part.ggml_type, in_features) for part in parts) + (0 if bias is None else bias.nbytes)
        self.data, self.segments = _layer_data(file, parts, in_features)  # the bytes it computes with: (offset, rows, type)
        self.columns = columns = _columns(parts)
        n = self.out_features
        # Bound once, as QuantizedLinear does: forward runs for every projection of every step.
        self._apply_kernel = lambda x: kernels().linear_blocks(x, self.data, self.segments, columns, bias, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply_kernel(x)

    def kernel_projection(self) -> Any:
        """The layer as kernels/decoder_layer.h's Projection: what a fused block's kernel computes it with."""
        return kernels().Projection.blocks(self.data, self.segments, self.columns, self.bias, self.out_features, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, types={'+'.join(self.types)}"


def row_bytes(ggml_type: int, cols: int) -> int:
    values, size = GGML_QUANT_SIZES[GGML(ggml_type)]
    return cols // values * size


def computable(blocks: FileBlocks | None, cols: int) -> bool:
    """Whether the kernels compute this matrix's blocks: a type they know, its rows whole blocks."""
    return blocks is not None and blocks.ggml_type in BLOCK_TYPES and cols % GGML_QUANT_SIZES[GGML(blocks.ggml_type)][0] == 0


def use_file_blocks(model: CausalLM, tensors: Mapping[str, torch.Tensor]) -> int:
    """Swap every linear layer of `model` whose tensors the kernels compute as stored for a BlockLinear
    over them, and give the model such a head when its head matrix is one; in place. Returns how many
    layers (the head included) now compute blocks: 0 for a source that is not a GGUF file of block types."""
    if not isinstance(tensors, TensorSource):
        return 0
    plan = model.hf_plan()
    files: dict[Path, MappedFile] = {}
    swapped = 0
    for name in [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]:
        linear = model.get_submodule(name)
        parts = [tensors.blocks(source.name) for source in plan[f"{name}.weight"]]
        if not all(computable(part, linear.in_features) for part in parts):
            continue
        bias = None
        if linear.bias is not None:
            model.load_parameters(tensors, [f"{name}.bias"])
            bias = linear.bias.detach().contiguous()
        layer = BlockLinear(mapped_file(files, parts[0].path), parts, linear.in_features, bias)
        if name == "lm_head":
            model.use_head(layer)
        else:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, layer)
        swapped += 1
    table = tensors.blocks(_EMBEDDINGS)
    if model.lm_head is None and computable(table, model.config.hidden_size):
        model.use_head(BlockLinear(mapped_file(files, table.path), [table], model.config.hidden_size, None))
        swapped += 1
    return swapped


@dataclass
class MappedFile:
    """A GGUF file's bytes as a uint8 tensor over a read-only shared mapping. Read-only: the mapping is
    never charged to the machine's commit (a private writable one would be, kiln/kv/storage.py says what
    that costs), and nothing writes weights."""

    mapping: mmap.mmap
    data: torch.Tensor

    def release(self, offset: int, size: int) -> None:
        """Hands back the pages of [offset, offset + size) this process holds: read again, they come back
        from the file (a neighbour sharing an edge page loses nothing)."""
        start = offset - offset % mmap.PAGESIZE
        self.mapping.madvise(mmap.MADV_DONTNEED, start, offset + size - start)


def mapped_file(files: dict[Path, MappedFile], path: Path) -> MappedFile:
    """The file's mapping, one per file."""
    if path not in files:
        with path.open("rb") as file:
            mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():  # "non-writable buffer": the kernels only read it
            warnings.simplefilter("ignore", UserWarning)
            files[path] = MappedFile(mapping, torch.frombuffer(mapping, dtype=torch.uint8))
    return files[path]


def _layer_data(file: MappedFile, parts: Sequence[FileBlocks], cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes a layer computes with and its segments (byte offset, rows, type) in them: the file's own
    when no part repacks; else the layer's own copy, its parts that start and end on a group of eight
    rows repacked, the rest as stored, and the file's pages of every part handed back."""
    firsts = itertools.accumulate([0, *(part.rows for part in parts)])
    repacked = [kernels().repacked_row_bytes(part.ggml_type, cols) if part.rows % GROUP_ROWS == first % GROUP_ROWS == 0 else 0
                for part, first in zip(parts, firsts, strict=False)]
    if not any(repacked):
        return file.data, torch.tensor([[part.offset, part.rows, part.ggml_type] for part in parts], dtype=torch.long)
    sizes = [part.rows * (row or row_bytes(part.ggml_type, cols)) for part, row in zip(parts, repacked, strict=True)]
    data = huge_page_buffer(sum(sizes))  # read whole every step (kiln/huge_pages.py)
    segments, offset = [], 0
    for part, row, size in zip(parts, repacked, sizes, strict=True):
        stored_size = part.rows * row_bytes(part.ggml_type, cols)
        stored, out = file.data[part.offset : part.offset + stored_size], data[offset : offset + size]
        ggml_type = part.ggml_type
        if row:
            ggml_type = kernels().repack_blocks(stored.view(part.rows, -1), part.ggml_type, out)
        else:
            out.copy_(stored)
        file.release(part.offset, stored_size)
        segments.append([offset, part.rows, ggml_type])
        offset += size
    return data, torch.tensor(segments, dtype=torch.long)


def _columns(parts: Sequence[FileBlocks]) -> torch.Tensor | None:
    """Each stored row's output column: parts one after another, a reordered part's rows put back."""
    if all(part.row_order is None for part in parts):
        return None
    columns, first = [], 0
    for part in parts:
        placed = list(range(part.rows))
        for checkpoint_row, stored_row in enumerate(part.row_order or range(part.rows)):
            placed[stored_row] = checkpoint_row
        columns.extend(first + column for column in placed)
        first += part.rows
    return torch.tensor(columns, dtype=torch.long)
