"""The default weight path of a GGUF file of block types (kiln/models/gguf_blocks.py): every layer computes
the file's blocks where they lie, generation follows the exact path (the same weights dequantised) within
the input's rounding, nothing is converted into the weight cache, and what the blocks do not serve takes
the int8 path."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from kiln.config import EngineConfig
from kiln.engine.engine import build_engine_model
from kiln.huge_pages import HUGE_PAGE
from kiln.kernels import supported
from kiln.models.gguf_blocks import BlockLinear, mapped_file
from kiln.models.loader import load_model
from kiln.models.quant import QuantizedLinear
from kiln.models.tensor_source import FileBlocks
from tests.kernels.test_blocks import random_blocks, rounded_like_the_kernel
from tests.models.test_parity import PoisonedCache, solo
from tests.tiny_gguf import write_gguf
from tests.tiny_models import TINY_CONFIGS, hf_state_dict, tiny_hf_model

pytestmark = pytest.mark.skipif(not supported(), reason="Kiln's CPU kernels do not run on this machine")
PROMPT = [2, 17, 42, 9, 77, 5, 130, 64]


def kernel_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, BlockLinear | QuantizedLinear | nn.Linear)}


def prompt_logits(path: Path, cache: Path, **options: object) -> torch.Tensor:
    """[len(PROMPT), vocab]: the logits of every prompt position, from the weights EngineConfig(**options)
    gives, with float32 KV pages (what differs is the weights alone)."""
    loaded = load_model(path, cache_dir=cache)
    model, _ = build_engine_model(EngineConfig(kv_dtype="float32", **options), loaded)
    return solo(PoisonedCache(model, loaded.config, 16, len(PROMPT)), PROMPT, [len(PROMPT)])


def relative_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    centred = reference - reference.mean(dim=-1, keepdim=True)
    return float((logits - reference).norm() / centred.norm())


# llama: q/k rows stored permuted; qwen2: biases; phi3: q/k/v and gate/up stored fused; gemma3: a tied head.
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gemma3"])
@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_1", "Q5_0"])
def test_every_layer_computes_the_file_s_blocks_and_follows_the_exact_path(arch: str, weight_type: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    write_gguf(path, arch, TINY_CONFIGS[arch], hf_state_dict(tiny_hf_model(arch)), quantize=weight_type)
    cache = tmp_path / "cache"
    model, weights = build_engine_model(EngineConfig(), load_model(path, cache_dir=cache))

    assert weights == "float32/gguf/fused"
    layers = kernel_layers(model)
    assert layers and all(isinstance(m, BlockLinear) and m.types[0] == weight_type for m in layers.values())
    assert isinstance(model.lm_head, BlockLinear)
    # Only the inputs' rounding to int8 per 32 values differs from the exact path: 0.7-1.6 % of these tiny
    # random models' logits (the int8 path, re-quantising the weights, 0.5-1.8 %); a wrong decoding of a
    # format, a row out of place or a lost bias moves them by their whole size.
    assert relative_error(prompt_logits(path, cache), prompt_logits(path, cache, quantization=None)) < 0.03
    assert not list((cache / load_model(path, cache_dir=cache).fingerprint).glob("quantized-*"))  # the file is the copy


def test_a_layer_the_blocks_do_not_serve_takes_the_int8_path_cached_apart(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    float_layer = "model.layers.1.mlp.down_proj"  # a float tensor among block types
    write_gguf(path, "llama", TINY_CONFIGS["llama"], hf_state_dict(tiny_hf_model("llama")), quantize="Q4_0",
               keep_float={f"{float_layer}.weight"})
    cache = tmp_path / "cache"
    loaded = load_model(path, cache_dir=cache)
    model, weights = build_engine_model(EngineConfig(), loaded)

    assert weights == "float32/gguf+int8/fused"
    layers = kernel_layers(model)
    assert isinstance(layers[float_layer], QuantizedLinear) and layers[float_layer].fmt == "int8"
    assert sum(isinstance(m, BlockLinear) for m in layers.values()) == len(layers) - 1
    assert [p.name for p in (cache / loaded.fingerprint).glob("quantized-*")] == ["quantized-int8-beside-blocks-v2.safetensors"]


def test_int8_still_re_quantises_every_layer_and_an_exact_run_s_conversion_leaves_blocks_computable(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    write_gguf(path, "gemma3", TINY_CONFIGS["gemma3"], hf_state_dict(tiny_hf_model("gemma3")), quantize="Q8_0")
    cache = tmp_path / "cache"
    model, weights = build_engine_model(EngineConfig(quantization="int8"), load_model(path, cache_dir=cache))
    assert weights == "float32/int8/fused"
    assert all(isinstance(m, QuantizedLinear) for m in kernel_layers(model).values())
    prompt_logits(path, cache, quantization=None)  # keeps the float32 conversion in the weight cache
    model, weights = build_engine_model(EngineConfig(), load_model(path, cache_dir=cache))
    assert weights == "float32/gguf/fused" and isinstance(model.lm_head, BlockLinear)


def test_a_layer_reads_the_file_s_bytes_in_place(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    write_gguf(path, "qwen2", TINY_CONFIGS["qwen2"], hf_state_dict(tiny_hf_model("qwen2")), quantize="Q4_1")
    model, _ = build_engine_model(EngineConfig(), load_model(path, cache_dir=tmp_path / "cache"))
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    qkv = model.model.layers[0].self_attn.qkv_proj
    parts = ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.attn_q.bias", "blk.0.attn_k.bias",
             "blk.0.attn_v.bias")
    assert qkv.nbytes == sum(int(stored[name].n_bytes) for name in parts)
    x = torch.randn(3, qkv.in_features)
    weight = torch.cat([torch.from_numpy(gguf.quants.dequantize(stored[name].data, stored[name].tensor_type)) for name in parts[:3]])
    bias = torch.cat([torch.from_numpy(np.array(stored[name].data, np.float32)) for name in parts[3:]])
    rounded = torch.from_numpy(rounded_like_the_kernel(x.numpy()))  # the inputs as the kernel rounds them
    torch.testing.assert_close(qkv(x), rounded @ weight.T + bias, rtol=1e-4, atol=1e-5)


def test_parts_in_whole_groups_compute_from_a_repacked_copy_and_other_parts_as_stored(tmp_path: Path) -> None:
    """A fused layer as K-quant files hold them: Q4_K and Q6_K parts in whole groups of eight rows, then
    one that is not, and one that does not start on a group. The whole groups are repacked into the
    layer's own bytes, the rest copied as stored, and the layer computes what the file's blocks
    dequantised give."""
    shapes = [("Q4_K", 16), ("Q6_K", 8), ("Q4_K", 4), ("Q5_K", 8)]
    raws = [random_blocks(name, rows, 512, seed=i) for i, (name, rows) in enumerate(shapes)]
    path = tmp_path / "blocks.bin"
    path.write_bytes(bytes(100) + b"".join(raw.tobytes() for raw in raws))
    offsets = np.cumsum([100, *(raw.nbytes for raw in raws)])[:-1]
    parts = [FileBlocks(path, int(offset), rows, int(gguf.GGMLQuantizationType[name]))
             for offset, (name, rows) in zip(offsets, shapes, strict=True)]
    layer = BlockLinear(mapped_file({}, path), parts, 512, None)

    types = [int(gguf.GGMLQuantizationType[name]) for name, _ in shapes]
    assert layer.segments[:, 2].tolist() == [1000 + types[0], 1000 + types[1], types[2], types[3]]  # blocks.h kRepacked
    assert layer.data.numel() == 16 * 2 * 148 + sum(raw.nbytes for raw in raws[1:])  # Q4_K: 148 bytes a row-block
    assert layer.data.data_ptr() % HUGE_PAGE == 0  # its own buffer, for huge pages (kiln/huge_pages.py)
    x = np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32)
    weight = np.concatenate([gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
                             for raw, (name, _) in zip(raws, shapes, strict=True)])
    torch.testing.assert_close(layer(torch.from_numpy(x)), torch.from_numpy(rounded_like_the_kernel(x, 256) @ weight.T),
                               rtol=1e-4, atol=1e-4)
