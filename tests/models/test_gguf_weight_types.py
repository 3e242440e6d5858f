"""GGUF weight types: each type Kiln reads decodes to what ggml's own dequantisation gives, whole and row by
row; a file holding any other type is refused, naming it.

ggml's answers are recorded in tests/fixtures/gguf_types/ggml_rows.json by record.py there (seeded rows
quantised by ggml_quantize_chunk, decoded by the type's to_float, from llama-cpp-python's libggml)."""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path

import gguf
import numpy as np
import pytest

from kiln.errors import InvalidArgumentError
from kiln.models.gguf_import import WEIGHT_TYPES, GGUFTensor, GGUFTensors, gguf_tensor_source
from kiln.models.loader import load_model
from tests.tiny_models import TINY_CONFIGS

FIXTURE = json.loads((Path(__file__).parents[1] / "fixtures" / "gguf_types" / "ggml_rows.json").read_text())
EMBEDDINGS = "model.embed_tokens.weight"  # the one tensor also read row by row


def test_the_fixture_covers_every_type_kiln_reads() -> None:
    assert set(FIXTURE["types"]) == {t.name for t in WEIGHT_TYPES}
    assert len(WEIGHT_TYPES) == 15


@pytest.mark.parametrize("name", sorted(FIXTURE["types"]))
def test_rows_decode_as_ggml_decodes_them(name: str, tmp_path: Path) -> None:
    recorded = FIXTURE["types"][name]
    rows, cols = FIXTURE["rows"], FIXTURE["cols"]
    raw = base64.b64decode(recorded["quantized"])
    expected = np.frombuffer(base64.b64decode(recorded["dequantized_f32"]), dtype=np.float32).reshape(rows, cols)
    path = tmp_path / "tensor.bin"
    path.write_bytes(b"\0" * 96 + raw)  # the tensor at an offset, as in a GGUF file
    table = GGUFTensors("qwen2", {EMBEDDINGS: GGUFTensor(96, len(raw), recorded["ggml_type"], (rows, cols))})
    source = gguf_tensor_source(path, table, TINY_CONFIGS["llama"])

    np.testing.assert_array_equal(source[EMBEDDINGS].numpy(), expected)
    fd = os.open(path, os.O_RDONLY)
    try:
        np.testing.assert_array_equal(source.rows(EMBEDDINGS).read([2, 0], fd), expected[[2, 0]])
    finally:
        os.close(fd)


@pytest.mark.parametrize("refused", ["IQ2_XXS", "TQ1_0", "IQ3_S", "MXFP4"])
def test_a_file_of_another_type_is_refused_naming_it(refused: str, tmp_path: Path) -> None:
    qtype = gguf.GGMLQuantizationType[refused]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((2, 256 // block * size), np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    supported = ", ".join(t.name for t in WEIGHT_TYPES)
    message = f"GGUF tensor blk.0.ffn_down.weight has weight type {refused}, which Kiln does not read; supported: {supported}"
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        load_model(path, cache_dir=tmp_path / "cache")
    assert not any((tmp_path / "cache").glob("*/config.json"))  # refused before anything is cached
