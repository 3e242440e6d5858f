"""A decoder block stepping as one C++ call (kiln/models/fused_block.py, kernels/decoder_layer.h) computes the
module path's bits: the same logits and the same KV page bytes, for every kind of projection the kernels
hold, every page format they store, sliding and full layers, and steps mixing decode rows with appends;
blocks the kernel does not compute whole keep the modules; a broken contract is a typed error."""

from __future__ import annotations

from collections.abc import Callable
from itertools import zip_longest
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.config import EngineConfig
from kiln.engine.engine import build_engine_model
from kiln.errors import InvariantViolation
from kiln.kernels import kernels, supported
from kiln.models.causal_lm import CausalLM
from kiln.models.fused_block import FusedBlock
from kiln.models.gguf_blocks import BlockLinear
from kiln.models.loader import LoadedModel, load_model
from kiln.models.quant import QuantizedLinear
from tests.conftest import byte_tokenizer
from tests.models.test_parity import PoisonedCache, random_tokens, run
from tests.tiny_gguf import write_gguf
from tests.tiny_models import TINY_CONFIGS, hf_state_dict, tiny_hf_model

pytestmark = pytest.mark.skipif(not supported(), reason="Kiln's CPU kernels do not run on this machine")

# Three sequences: appends of several rows beside decode rows, across pages (of 4) and sliding windows.
TOKENS = {0: random_tokens(30, seed=1), 1: random_tokens(17, seed=2), 2: random_tokens(21, seed=3)}
PLANS = {0: [9, 7] + [1] * 14, 1: [3, 1, 1, 6] + [1] * 6, 2: [0, 5, 12] + [1] * 4}
STEPS = [{seq: n for seq, n in zip(PLANS, counts, strict=True) if n} for counts in zip_longest(*PLANS.values(), fillvalue=0)]

# How the projections are held: nn.Linear (the exact path), the kernels' float32 (the deterministic mode),
# int8, and a GGUF file's blocks.
WEIGHTS: dict[str, dict[str, object]] = {
    "exact": {"quantization": None},
    "float32-kernel": {"quantization": None, "deterministic": True},
    "int8": {"quantization": "int8"},
    "gguf": {},
}
PROJECTION_TYPES = {"exact": nn.Linear, "float32-kernel": QuantizedLinear, "int8": QuantizedLinear, "gguf": BlockLinear}


def engine_model(arch: str, weights: str, tmp_path: Path) -> CausalLM:
    """The tiny model as an engine builds it (fused kernels, layer kernels) with `weights`."""
    if weights == "gguf":
        path = tmp_path / f"{arch}.gguf"
        write_gguf(path, arch, TINY_CONFIGS[arch], hf_state_dict(tiny_hf_model(arch)), quantize="Q4_1")
        loaded = load_model(path, cache_dir=tmp_path / "cache")
    else:
        loaded = LoadedModel(config=TINY_CONFIGS[arch], tensors=hf_state_dict(tiny_hf_model(arch)), tokenizer=byte_tokenizer(),
                             source=Path(f"tiny-{arch}"), fingerprint=f"tiny-{arch}")
    model, _ = build_engine_model(EngineConfig(**WEIGHTS[weights]), loaded)  # type: ignore[arg-type]
    return model


def blocks(model: CausalLM) -> list[FusedBlock]:
    return [m for m in model.modules() if isinstance(m, FusedBlock)]


def forbid_modules(block: FusedBlock) -> None:
    def refuse(*args: object) -> torch.Tensor:
        raise AssertionError("a step the layer kernel takes ran the block's modules")

    block.module_forward = refuse  # type: ignore[method-assign]


def run_both(model: CausalLM, arch: str, page_dtype: torch.dtype, codec: str) -> tuple[list, list]:
    """(logits of every sequence, the pool's bytes) with the layer kernels, then with the modules."""
    results = []
    kernels_ = [block.layer_kernel for block in blocks(model)]
    assert kernels_ and all(k is not None for k in kernels_)
    for use_kernel in (True, False):
        for block, kernel in zip(blocks(model), kernels_, strict=True):
            block.layer_kernel = kernel if use_kernel else None
            if use_kernel:
                forbid_modules(block)
            else:
                del block.module_forward  # the class's again
        paged = PoisonedCache(model, TINY_CONFIGS[arch], 4, sum(map(len, TOKENS.values())), page_dtype, codec=codec)
        outputs = run(paged, TOKENS, STEPS)
        results.append(([outputs[seq] for seq in TOKENS], paged.cache.storage.data.clone()))
    for block, kernel in zip(blocks(model), kernels_, strict=True):
        block.layer_kernel = kernel
    return results[0], results[1]


def assert_same_bits(fused: tuple, modules: tuple) -> None:
    (fused_logits, fused_pool), (module_logits, module_pool) = fused, modules
    for seq, (a, b) in enumerate(zip(fused_logits, module_logits, strict=True)):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b), f"sequence {seq}: logits differ by up to {(a - b).abs().max().item():.3g}"
    assert torch.equal(fused_pool, module_pool), "the KV pages hold different bytes"


# llama: plain; qwen2: q/k/v biases and sliding layers beside a full one; qwen3: per-head q/k norms;
# gemma3: four norms a block, GeGLU, sliding and full layers, a tied head.
@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_the_layer_kernel_gives_the_modules_bits(arch: str, weights: str, tmp_path: Path) -> None:
    model = engine_model(arch, weights, tmp_path)
    attention = blocks(model)[0].self_attn
    assert isinstance(attention.qkv_proj, PROJECTION_TYPES[weights])
    assert_same_bits(*run_both(model, arch, torch.float32, "none"))


@pytest.mark.parametrize(("page_dtype", "codec"), [(torch.float16, "none"), (torch.float32, "int8"), (torch.float32, "int4")])
def test_every_page_format_the_kernels_store(page_dtype: torch.dtype, codec: str, tmp_path: Path) -> None:
    model = engine_model("gemma3", "int8", tmp_path)
    assert_same_bits(*run_both(model, "gemma3", page_dtype, codec))


def test_the_layer_kernel_changes_the_output_when_a_weight_changes(tmp_path: Path) -> None:
    """The bit comparisons above can fail: the kernel holds the modules' own tensors, so a changed norm weight
    changes its logits too (a layer holding copies would not follow)."""
    model = engine_model("llama", "int8", tmp_path)
    before, _ = run_both(model, "llama", torch.float32, "none")
    with torch.no_grad():
        blocks(model)[1].post_attention_layernorm.weight.mul_(1.5)
    after, modules = run_both(model, "llama", torch.float32, "none")
    assert not torch.equal(before[0][0], after[0][0])
    assert_same_bits(after, modules)


@pytest.mark.parametrize(
    ("arch", "with_kernel"),
    [
        ("granite", []),  # sublayer outputs scaled by its residual multiplier
        ("qwen3_moe", []),  # sparse expert feed-forwards
        ("olmo2", []),  # post-norm blocks of its own
        ("phi3", []),  # half of each head rotated
        ("smollm3", [0, 1, 2]),  # layer 3 has no RoPE
    ],
)
def test_blocks_the_kernel_does_not_compute_whole_keep_their_modules(arch: str, with_kernel: list[int], tmp_path: Path) -> None:
    model = engine_model(arch, "int8", tmp_path)
    layers = list(model.model.layers)
    assert [i for i, block in enumerate(layers) if getattr(block, "layer_kernel", None) is not None] == with_kernel


def random_layer(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> object:
    """A DecoderLayer of random float32 kernel weights, Llama's norms (none on the sublayer outputs)."""
    def projection(rows: int, cols: int) -> object:
        return QuantizedLinear.quantize(torch.randn(rows, cols) / cols**0.5, None, "float32").kernel_projection()

    norm = (torch.rand(hidden) + 0.5, 1e-6, 0.0)
    none = (None, 0.0, 0.0)
    return kernels().DecoderLayer(
        input_norm=norm, qkv=projection((heads + 2 * kv_heads) * head_dim, hidden), qk_norm=none, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, scale=head_dim**-0.5, o_proj=projection(hidden, heads * head_dim), attention_out_norm=none,
        mlp_in_norm=norm, gate_up=projection(2 * intermediate, hidden), activation="silu", down=projection(hidden, intermediate),
        mlp_out_norm=none,
    )


def one_sequence_step(rows: int, kv_heads: int, head_dim: int, page_size: int = 16) -> tuple[list, Callable[[], torch.Tensor]]:
    """The arguments after (x, cos, sin) of a step appending `rows` tokens to an empty sequence on raw float32
    pages, and the pages."""
    pages = -(-rows // page_size)
    k, v = torch.zeros(pages, page_size, kv_heads, head_dim), torch.zeros(pages, page_size, kv_heads, head_dim)
    positions = torch.arange(rows)
    none = torch.empty(0)
    args = [k, none, none, v, none, none, positions // page_size, positions % page_size,
            torch.arange(pages).view(1, -1), (torch.arange(pages) * page_size).view(1, -1), torch.zeros(rows, dtype=torch.long),
            positions, 0]
    return args, lambda: k


def rope(rows: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(rows)[:, None, None] * torch.rand(head_dim // 2)
    return angles.cos(), angles.sin()


def test_a_broken_contract_is_a_typed_error_and_writes_nothing() -> None:
    with pytest.raises(InvariantViolation, match="qkv"):
        kernels().DecoderLayer(
            input_norm=(torch.ones(64), 1e-6, 0.0), qkv=QuantizedLinear.quantize(torch.randn(64, 64), None, "int8").kernel_projection(),
            qk_norm=(None, 0.0, 0.0), heads=4, kv_heads=2, head_dim=16, scale=0.25,
            o_proj=QuantizedLinear.quantize(torch.randn(64, 64), None, "int8").kernel_projection(), attention_out_norm=(None, 0.0, 0.0),
            mlp_in_norm=(torch.ones(64), 1e-6, 0.0), gate_up=QuantizedLinear.quantize(torch.randn(256, 64), None, "int8").kernel_projection(),
            activation="silu", down=QuantizedLinear.quantize(torch.randn(64, 128), None, "int8").kernel_projection(),
            mlp_out_norm=(None, 0.0, 0.0),
        )
    layer = random_layer(64, 4, 2, 16, 128)
    args, pages = one_sequence_step(5, 2, 16)
    args[6] = args[6] + 100  # write pages past the pool
    with pytest.raises(InvariantViolation, match="pages"):
        layer.run(torch.randn(5, 64), *rope(5, 16), *args)  # type: ignore[attr-defined]
    assert not pages().any()
    with pytest.raises(InvariantViolation, match="x"):
        layer.run(torch.randn(5, 32), *rope(5, 16), *one_sequence_step(5, 2, 16)[0])  # type: ignore[attr-defined]

