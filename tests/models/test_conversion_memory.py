"""Converting a GGUF model's weights to int8 holds one float32 matrix at a time (issue 33 § 3): a layer
replaced by its int8 copy is garbage at once, and a tied LM head is quantised from the file a block of
rows at a time, never read whole. bench/models.py measures the peak RSS this gives on a 1.7B-shaped file."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.engine import engine as engine_module
from kiln.llm import LLM
from kiln.models.file_embedding import StoredRows
from kiln.models.loader import load_model
from kiln.models.quant import QuantizedLinear
from tests.tiny_gguf import write_gguf
from tests.tiny_models import TINY_CONFIGS, hf_state_dict, tiny_hf_model


@pytest.fixture
def tied_gguf(tmp_path: Path) -> Path:
    """A tiny Gemma 3 (LM head tied to the embeddings) with its matrices in Q8_0."""
    path = tmp_path / "tiny-gemma3.gguf"
    write_gguf(path, "gemma3", TINY_CONFIGS["gemma3"], hf_state_dict(tiny_hf_model("gemma3")), quantize=True)
    return path


def test_a_replaced_layer_is_garbage_before_the_next_is_quantised(
    tied_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[nn.Module] = []
    linears: list[weakref.ref[nn.Linear]] = []
    replaced_alive: list[int] = []
    build, quantize = engine_module.build_model, QuantizedLinear.quantize.__func__

    def tracked_build(*args: object, **kwargs: object) -> nn.Module:
        model = build(*args, **kwargs)
        built.append(model)
        linears.extend(weakref.ref(m) for m in model.modules() if isinstance(m, nn.Linear))
        return model

    def watched(cls: type[QuantizedLinear], weight: torch.Tensor, bias: torch.Tensor | None, fmt: str) -> QuantizedLinear:
        in_model = {id(m) for m in built[0].modules()}
        replaced_alive.append(sum(ref() is not None and id(ref()) not in in_model for ref in linears))
        return quantize(cls, weight, bias, fmt)

    monkeypatch.setattr(engine_module, "build_model", tracked_build)
    monkeypatch.setattr(QuantizedLinear, "quantize", classmethod(watched))
    with LLM(tied_gguf, quantization="int8", cache_dir=str(tmp_path / "cache")):
        pass
    assert len(replaced_alive) == 4 * TINY_CONFIGS["gemma3"].num_layers  # qkv, o, gate_up, down (fused)
    assert replaced_alive == [0] * len(replaced_alive)


def test_a_tied_head_is_quantised_from_the_file_block_by_block(
    tied_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = load_model(tied_gguf, cache_dir=tmp_path / "reference")
    expected = QuantizedLinear.quantize(loaded.tensors["model.embed_tokens.weight"], None, "int8")

    def no_whole_table(self: StoredRows) -> torch.Tensor:
        raise AssertionError("the whole embedding table was read")

    monkeypatch.setattr(StoredRows, "read_all", no_whole_table)
    with LLM(tied_gguf, quantization="int8", cache_dir=str(tmp_path / "cache")) as llm:
        head = llm.engine.model.lm_head
        assert torch.equal(head.weight, expected.weight) and torch.equal(head.scale, expected.scale)
