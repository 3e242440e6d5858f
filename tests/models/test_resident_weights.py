"""What a running model holds of its weights and what the converted-weight cache keeps (issue 29 § 4).

Token embeddings are looked up in the weight file, row by row, with the very values a resident table
holds (Q8_0 GGUF rows, bfloat16 safetensors rows), so the tokens and logprobs are those of a resident
table; an int8 engine holds no float32 matrix; a GGUF model's cache entry keeps only what the
configurations that ran compute with, and later starts read that instead of the GGUF tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kiln.llm import LLM
from kiln.models import gguf_import
from kiln.models.file_embedding import FileEmbedding
from kiln.models.layers import RMSNorm
from kiln.models.loader import LoadedModel, load_model
from kiln.models.tensor_source import safetensors_source
from tests.tiny_gguf import write_gguf
from tests.tiny_models import TINY_CONFIGS, hf_state_dict, tiny_hf_model

EMBEDDINGS = "model.embed_tokens.weight"
PROMPT = [2, 17, 42, 9, 77, 5]


@pytest.fixture
def q8_gguf(tmp_path: Path) -> Path:
    """A tiny Gemma 3 (tied embeddings) with its matrices in Q8_0, as the embedded model's table is."""
    path = tmp_path / "tiny-gemma3.gguf"
    write_gguf(path, "gemma3", TINY_CONFIGS["gemma3"], hf_state_dict(tiny_hf_model("gemma3")), quantize=True)
    return path


def greedy(llm: LLM) -> tuple[list[int], list[float]]:
    output = llm.generate(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)[0]
    return output.token_ids, output.logprobs


def test_rows_read_from_the_file_are_the_table_s_rows(q8_gguf: Path, tmp_path: Path) -> None:
    ids = torch.tensor([5, 0, 255, 5, 31])
    loaded = load_model(q8_gguf, cache_dir=tmp_path / "cache")
    gguf_rows = FileEmbedding(loaded.stored_rows(EMBEDDINGS))
    assert torch.equal(gguf_rows(ids), loaded.tensors[EMBEDDINGS][ids])
    table = torch.randn(256, 16).to(torch.bfloat16)
    save_file({"table": table}, tmp_path / "bf16.safetensors")
    bf16_rows = FileEmbedding(safetensors_source([tmp_path / "bf16.safetensors"]).rows("table"))
    assert torch.equal(bf16_rows(ids.view(1, -1)), table.float()[ids].view(1, -1, 16))


def test_file_embeddings_generate_what_a_resident_table_does(q8_gguf: Path, tmp_path: Path) -> None:
    loaded = load_model(q8_gguf, cache_dir=tmp_path / "cache")
    resident = LoadedModel(loaded.config, dict(loaded.tensors), loaded.tokenizer, loaded.source, loaded.fingerprint)
    with LLM(loaded=loaded, quantization="int8") as from_file, LLM(loaded=resident, quantization="int8") as in_memory:
        model = from_file.engine.model
        assert isinstance(model.model.embed_tokens, FileEmbedding)
        assert not isinstance(in_memory.engine.model.model.embed_tokens, FileEmbedding)
        # Norm weights are all the float32 it holds: no projection, head or embedding matrix.
        holders = {type(module) for module in model.modules() if list(module.parameters(recurse=False))}
        assert holders == {RMSNorm}
        assert greedy(from_file) == greedy(in_memory)


def test_the_cache_keeps_what_the_configurations_compute_with(
    q8_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    options = {"cache_dir": str(cache)}
    with LLM(q8_gguf, quantization="int8", **options) as llm:
        entry = cache / llm.loaded.fingerprint
        int8 = greedy(llm)
    described = {"config.json", "gguf_tensors.json", "tokenizer.json", "tokenizer_kiln.json"}
    assert {p.name for p in entry.iterdir()} == described | {"quantized-int8-v2.safetensors"}
    with LLM(q8_gguf, quantization=None, **options) as llm:  # exact weights: their conversion is kept now
        exact = greedy(llm)
    assert {p.name for p in entry.iterdir()} == described | {"quantized-int8-v2.safetensors", "model.safetensors"}

    def no_gguf_reads(*args: object) -> None:
        raise AssertionError("a GGUF tensor was converted again")

    monkeypatch.setattr(gguf_import, "_read_tensor", no_gguf_reads)
    for quantization, expected in (("int8", int8), (None, exact)):
        with LLM(q8_gguf, quantization=quantization, **options) as llm:
            assert greedy(llm) == expected
