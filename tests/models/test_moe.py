"""Mixture-of-experts models (kiln/models/moe.py) beyond what every tiny architecture gets (HF parity in
test_parity.py, llama.cpp's logits in test_gguf_architectures.py, int8 and determinism in test_quant.py and
test_deterministic.py): the experts load from HF checkpoints (one tensor per expert) and from GGUF files
(one stack per projection, read an expert at a time), the engine builds int8 experts from a GGUF file, and
the rows of a batched engine step are routed each on its own."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import pytest
import torch

from kiln import SamplingParams
from kiln.config import EngineConfig
from kiln.engine.engine import build_engine_model
from kiln.errors import InvalidArgumentError
from kiln.llm import LLM
from kiln.models.gguf_import import read_gguf
from kiln.models.loader import load_model
from kiln.models.moe import RoutingProjection, SparseMoE
from kiln.models.quant import QuantizedLinear
from tests.models.test_loader import assert_same_tensors, gguf_config, save_hf_dir
from tests.models.test_parity import PoisonedCache, random_tokens, solo
from tests.models.test_quant import MAX_REL
from tests.tiny_gguf import REFERENCE_ARCHITECTURES, write_gguf, write_reference_gguf
from tests.tiny_models import TINY_CONFIGS, hf_state_dict, tiny_hf_model

MOE = [name for name, config in TINY_CONFIGS.items() if config.moe]


@pytest.mark.parametrize("name", MOE)
def test_hf_dir_loads_one_tensor_per_expert(name: str, tmp_path: Path) -> None:
    """transformers 5 fuses a layer's experts into 3-D parameters but saves them one per expert, as the
    released checkpoints hold them; those are the names Kiln loads."""
    model = tiny_hf_model(name)
    loaded = load_model(save_hf_dir(model, tmp_path / "model"), cache_dir=tmp_path / "cache")
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in loaded.tensors
    assert_same_tensors(loaded.tensors, hf_state_dict(model))
    assert dataclasses.replace(loaded.config, name="") == TINY_CONFIGS[name]


@pytest.mark.parametrize("quantize", [False, True], ids=["f32", "q8_0"])
@pytest.mark.parametrize("name", MOE)
def test_gguf_expert_stacks_load_an_expert_at_a_time(name: str, quantize: bool, tmp_path: Path) -> None:
    """Each expert of a stack (blk.N.ffn_gate_exps, experts outermost) is its own byte range of it, so
    the int8 conversion reads and dequantises one expert at a time; F32 files give back the checkpoint's
    tensors exactly, Q8_0 within half a step of each block."""
    path = tmp_path / "moe.gguf"
    tensors = hf_state_dict(tiny_hf_model(name))
    write_gguf(path, REFERENCE_ARCHITECTURES[name], TINY_CONFIGS[name], tensors, quantize=quantize)
    loaded = load_model(path, cache_dir=tmp_path / "cache")
    assert dataclasses.replace(loaded.config, name="") == gguf_config(name)
    if quantize:
        for tensor_name, tensor in tensors.items():
            step = tensor.abs().max().item() / 127
            torch.testing.assert_close(loaded.tensors[tensor_name], tensor, rtol=0, atol=step, msg=tensor_name)
    else:
        assert_same_tensors(loaded.tensors, tensors)
    table = read_gguf(path)[1].tensors
    experts = [table[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] for e in range(TINY_CONFIGS[name].moe.num_experts)]
    assert all(b.offset == a.offset + a.n_bytes for a, b in zip(experts, experts[1:], strict=False))


def test_gguf_of_another_architecture_is_refused_naming_the_mixtures_of_experts(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(path, "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InvalidArgumentError, match="unsupported GGUF architecture 'mamba'.*qwen2moe.*qwen3moe"):
        load_model(path, cache_dir=tmp_path / "cache")


def test_engine_builds_int8_experts_from_a_gguf_that_track_the_exact_path(tmp_path: Path) -> None:
    """The default weight format: every expert's projections become int8 kernel layers (read from the
    file an expert at a time, kept in the cache entry), the routers stay float32; logits track the exact
    path's but where int8 rounding flips a near tie in a token's top-k (one row allowed, as test_quant)."""
    loaded = load_model(write_reference_gguf("qwen2_moe", tmp_path / "moe.gguf"), cache_dir=tmp_path / "cache")
    int8, _ = build_engine_model(EngineConfig(quantization="int8"), loaded)
    exact, _ = build_engine_model(EngineConfig(quantization=None), loaded)
    moe = int8.model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and isinstance(moe.experts[5].down_proj, QuantizedLinear)
    assert moe.experts[5].down_proj.fmt == "int8" and isinstance(moe.gate, RoutingProjection)
    assert moe.gate.weight.dtype == torch.float32
    tokens = random_tokens(24, seed=1)
    ours, reference = (solo(PoisonedCache(m, loaded.config, 8, 24), tokens, [20, 1, 1, 1, 1]) for m in (int8, exact))
    row_errors = (ours - reference).abs().amax(dim=-1) / reference.abs().max()
    assert (row_errors > MAX_REL).sum().item() <= 1


def test_rows_of_a_batched_step_are_routed_each_on_its_own(tmp_path: Path) -> None:
    """Several sequences share the engine's steps (prefill chunks beside decode rows): a sequence's tokens
    and log-probabilities are bit-identical generated alone or batched, in the deterministic mode."""
    loaded = load_model(write_reference_gguf("qwen3_moe", tmp_path / "moe.gguf"), cache_dir=tmp_path / "cache")
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=True, ignore_eos=True)
    prompt, others = random_tokens(30, seed=5), [random_tokens(20 + 7 * i, seed=6 + i) for i in range(3)]
    options = {"deterministic": True, "kv_budget_bytes": 16 * 1024**2, "prefill_chunk_tokens": 16}
    with LLM(loaded=loaded, **options) as llm:
        alone = llm.generate([prompt], params)[0]
    with LLM(loaded=loaded, **options) as llm:
        batched = llm.generate([others[0], prompt, *others[1:]], params)[1]
    assert alone.logprobs is not None and len(alone.token_ids) == 10
    assert batched.token_ids == alone.token_ids and batched.logprobs == alone.logprobs
