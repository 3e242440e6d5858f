"""ModelFacts: what `kiln models` and `/v1/models` say about a model, read from its files' headers without
its weights: a GGUF file's metadata and tensor table, an HF directory's config.json and safetensors
headers. Milliseconds per model, where loading one takes seconds: gguf-py's reader builds every value of
the metadata, 20 s for a 262k-token vocabulary, so the GGUF header is walked here instead, skipping arrays.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gguf

from kiln.errors import InvalidArgumentError
from kiln.models.loader import shard_files
from kiln.models.tensor_source import safetensors_header

_GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_FILE_TYPE_PREFIXES = ("MOSTLY_", "ALL_")


@dataclass(frozen=True)
class ModelFacts:
    """`architecture`: the file's own name for it (GGUF general.architecture, HF model_type); `parameters`:
    elements of every stored tensor; `weight_type`: the file's quantisation (GGUF file type) or the dtype
    holding most parameters; `context_length`: tokens the model was trained for; `size_bytes`: on disk."""

    architecture: str
    parameters: int
    weight_type: str
    context_length: int | None
    chat_template: bool
    size_bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def model_facts(path: Path) -> ModelFacts:
    """The facts of a GGUF file or an HF directory. InvalidArgumentError for anything else, or unreadable."""
    if path.is_dir():
        return _hf_facts(path)
    return _gguf_facts(path)


def _hf_facts(path: Path) -> ModelFacts:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise InvalidArgumentError(f"{path}: no readable config.json: {error}") from error
    text = config.get("text_config") or config  # a multimodal checkpoint nests its text model's
    by_dtype: Counter[str] = Counter()
    for shard in shard_files(path):
        header, _ = safetensors_header(shard)
        for name, entry in header.items():
            if name != "__metadata__":
                by_dtype[entry["dtype"]] += math.prod(entry["shape"])
    tokenizer_config = path / "tokenizer_config.json"
    template = (path / "chat_template.jinja").is_file() or (
        tokenizer_config.is_file() and bool(json.loads(tokenizer_config.read_text()).get("chat_template")))
    return ModelFacts(
        architecture=str(config.get("model_type") or (config.get("architectures") or ["unknown"])[0]),
        parameters=sum(by_dtype.values()),
        weight_type=by_dtype.most_common(1)[0][0] if by_dtype else "none",
        context_length=text.get("max_position_embeddings"),
        chat_template=template,
        size_bytes=sum(file.stat().st_size for file in path.rglob("*") if file.is_file()),
    )


def _gguf_facts(path: Path) -> ModelFacts:
    try:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            metadata, tensors = _GGUFHeader(data).read()
    except (OSError, ValueError, KeyError, struct.error) as error:
        raise InvalidArgumentError(f"{path} is not a readable GGUF file (truncated or corrupt?): {error}") from error
    arch = str(metadata.get("general.architecture", "unknown"))
    by_type: Counter[str] = Counter()
    for dims, ggml_type in tensors:
        by_type[_type_name(ggml_type)] += math.prod(dims)
    context = metadata.get(f"{arch}.context_length")
    return ModelFacts(
        architecture=arch,
        parameters=sum(by_type.values()),
        weight_type=_file_type(metadata.get("general.file_type"), by_type),
        context_length=int(context) if context is not None else None,
        chat_template=bool(metadata.get("tokenizer.chat_template")),
        size_bytes=path.stat().st_size,
    )


def _file_type(file_type: int | None, by_type: Counter[str]) -> str:
    """llama.cpp's name of the file type (Q4_K_M), else the tensor type holding most parameters."""
    try:
        name = gguf.LlamaFileType(file_type).name
    except ValueError:
        return by_type.most_common(1)[0][0] if by_type else "none"
    return next((name.removeprefix(prefix) for prefix in _FILE_TYPE_PREFIXES if name.startswith(prefix)), name)


def _type_name(ggml_type: int) -> str:
    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


class _GGUFHeader:
    """GGUF's header (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic, version, tensor
    and key counts, then each key's typed value, then each tensor's name, dims, type and offset. Scalars
    and strings are kept; arrays (the vocabulary, merges, scores) are skipped without being decoded."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.offset = 0

    def read(self) -> tuple[dict[str, Any], list[tuple[tuple[int, ...], int]]]:
        if self.data[:4] != _GGUF_MAGIC:
            raise ValueError("no GGUF magic")
        self.offset = 4
        version, tensor_count, key_count = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old")
        metadata = {}
        for _ in range(key_count):
            key = self._string()
            metadata[key] = self._value(self._unpack("<I"))
        return metadata, list(self._tensors(tensor_count))

    def _tensors(self, count: int) -> Iterator[tuple[tuple[int, ...], int]]:
        for _ in range(count):
            self._string()
            dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            ggml_type = self._unpack("<I")
            self._unpack("<Q")  # offset
            yield dims, ggml_type

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            self._skip_array()
            return None
        return self._unpack(_SCALARS[kind])  # KeyError: no such type

    def _skip_array(self) -> None:
        item, count = self._unpack("<I"), self._unpack("<Q")
        if item in _SCALARS:
            self._skip(count * struct.calcsize(_SCALARS[item]))
        elif item == _STRING:
            for _ in range(count):
                self._skip(self._unpack("<Q"))
        else:
            for _ in range(count):
                self._value(item)

    def _string(self) -> str:
        size = self._unpack("<Q")
        start = self.offset
        self._skip(size)
        return self.data[start : self.offset].decode("utf-8", errors="replace")

    def _skip(self, size: int) -> None:
        if size > len(self.data) - self.offset:
            raise ValueError(f"a length of {size} bytes at offset {self.offset} runs past the end of the file")
        self.offset += size

    def _unpack(self, layout: str) -> Any:
        (value,) = struct.unpack_from(layout, self.data, self.offset)
        self.offset += struct.calcsize(layout)
        return value
