"""Packed weight formats (kiln/models/packed.py): fp16 tracks the fp32 logits closely and int8 loosely on
every tiny architecture, run as the engine runs them; packing frees the fp32 matrices; engines generate
with them end to end; bad formats and combinations are refused."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from kiln import cli
from kiln.config import EngineConfig
from kiln.errors import InvalidArgumentError
from kiln.llm import LLM
from kiln.models import build_model, pack_weights
from kiln.models.causal_lm import CausalLM
from kiln.models.packed import PackedLinear
from tests.models.test_parity import PoisonedCache, random_tokens, solo
from tests.tiny_models import TINY_CONFIGS

# Largest |logit difference| over the largest |fp32 logit|, prefill and decode rows of 24 tokens.
# Measured on the tiny models: fp16 <= 4.7e-4 (weights rounded to 11 bits); int8 <= 3.8e-2, and <= 3.7e-2
# as relative RMS error (7-bit weights per row, activations quantized per tensor).
FP16_MAX_REL = 1e-3
INT8_MAX_REL = 0.08
INT8_RMS_REL = 0.08


def packed_model(loaded, fmt: str) -> CausalLM:
    model = build_model(loaded.config)
    model.load_weights(loaded.tensors)
    return pack_weights(model, fmt)


def state_bytes(model: nn.Module) -> int:
    return sum(t.nbytes for t in [*model.parameters(), *model.buffers()])


def logits(model: CausalLM, loaded, tokens: list[int]) -> torch.Tensor:
    """Every position's logits, prefilled in one chunk then decoded token by token through the runner."""
    return solo(PoisonedCache(model, loaded.config, 8, len(tokens)), tokens, [len(tokens) - 4, 1, 1, 1, 1])


@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
def test_packed_logits_track_float32(tiny_loaded, arch: str) -> None:
    loaded = tiny_loaded(arch)
    tokens = random_tokens(24, seed=1)
    reference = logits(packed_model(loaded, "float32"), loaded, tokens)
    scale = reference.abs().max()
    fp16 = logits(packed_model(loaded, "fp16"), loaded, tokens)
    assert (fp16 - reference).abs().max() / scale <= FP16_MAX_REL
    assert torch.equal(fp16.argmax(-1), reference.argmax(-1))
    int8 = logits(packed_model(loaded, "int8"), loaded, tokens)
    assert (int8 - reference).abs().max() / scale <= INT8_MAX_REL
    assert (int8 - reference).norm() / reference.norm() <= INT8_RMS_REL


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # untied and tied LM head
@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_packing_frees_the_float32_matrices(tiny_loaded, arch: str, fmt: str) -> None:
    loaded = tiny_loaded(arch)
    model = packed_model(loaded, fmt)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 4 * loaded.config.num_layers + 1  # qkv, o, gate_up, down per layer; the head
    # What is left as parameters or buffers: the fp32 embedding table (tied lookups) and the norms.
    kept = {name for name, _ in [*model.named_parameters(), *model.named_buffers()]}
    assert all(name == "model.embed_tokens.weight" or "norm" in name for name in kept)
    fp32 = packed_model(loaded, "float32")
    linear_bytes = sum(p.nbytes for m in fp32.modules() if isinstance(m, nn.Linear) for p in m.parameters())
    assert state_bytes(model) == state_bytes(fp32) - linear_bytes
    assert model.model.embed_tokens.weight.dtype == torch.float32
    model.logits(torch.randn(1, loaded.config.hidden_size))  # batch 1 builds no transposed head copy
    assert model._head_t is None
    per_weight = {"fp16": 2, "int8": 1}[fmt]
    head = loaded.config.vocab_size * loaded.config.hidden_size
    assert model.lm_head.nbytes == head * per_weight


def test_cli_flag_mirrors_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}
    monkeypatch.setattr(cli, "LLM", lambda model, **options: seen.update(options))
    parser = argparse.ArgumentParser()
    cli._engine_args(parser)
    cli._llm(parser.parse_args(["--weight-format", "int8"]))
    assert seen["weight_format"] == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--weight-format", "int4"])


def test_packing_refuses_bad_formats_and_combinations(tiny_loaded) -> None:
    with pytest.raises(InvalidArgumentError, match=r"weight_format must be one of \['float32', 'fp16', 'int8'\]"):
        EngineConfig(weight_format="int4")
    with pytest.raises(InvalidArgumentError, match="needs dtype 'float32' and device 'cpu'"):
        EngineConfig(weight_format="fp16", dtype="bfloat16")
    with pytest.raises(InvalidArgumentError, match="needs dtype 'float32' and device 'cpu'"):
        EngineConfig(weight_format="int8", device="cuda")
    with pytest.raises(InvalidArgumentError, match="weight_format must be one of"):
        pack_weights(build_model(tiny_loaded("llama").config), "q4")
    with pytest.raises(InvalidArgumentError, match="float32 CPU weight"):
        PackedLinear(torch.zeros(4, 4, dtype=torch.bfloat16), None, "fp16")
    with pytest.raises(InvalidArgumentError):
        LLM(loaded=tiny_loaded("llama"), weight_format="fp16", dtype="float16")


@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_sessions_generate_with_packed_weights(tiny_llm, fmt: str) -> None:
    params = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    expected = tiny_llm("gemma3").generate([list(range(3, 15))], **params)[0].token_ids
    llm = tiny_llm("gemma3", weight_format=fmt)
    session = llm.create_session(list(range(3, 15)))
    first = session.generate(**params).result()
    session.append([20, 21, 22])
    second = session.generate(**params).result()
    assert len(first.token_ids) == len(second.token_ids) == 8
    assert second.usage.reused_tokens == 12 + 8 - 1  # the history's K/V stayed resident between turns
    if fmt == "fp16":
        assert first.token_ids == expected


def leading_agreement(ours: list[int], reference: list[int]) -> int:
    """Tokens generated before the first that differs from the reference's."""
    return next((i for i, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b), len(reference))


@pytest.mark.embedded
def test_embedded_greedy_tokens() -> None:
    """fp16 keeps the embedded model's greedy tokens on test_embedded's prompts. int8 only has to agree on
    the first token: its per-matmul error (up to ~10 % on Gemma's outlier-heavy activations) moves
    near-tied logits, and once one greedy token differs the continuations part (measured: 4, 5 and 1
    tokens before the first difference). The assertion message reports the agreement."""
    from tests.test_embedded import NEW_TOKENS, PROMPTS

    params = {"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    with LLM(kv_budget_bytes=64 * 1024**2) as reference:
        prompts = [reference.tokenizer.encode(p) for p in PROMPTS]
        expected = [out.token_ids for out in reference.generate(prompts, **params)]
        loaded = reference.loaded
    agreement = {}
    for fmt in ("fp16", "int8"):
        with LLM(loaded=loaded, weight_format=fmt, kv_budget_bytes=64 * 1024**2) as llm:
            outputs = [out.token_ids for out in llm.generate(prompts, **params)]
        agreement[fmt] = [leading_agreement(o, e) for o, e in zip(outputs, expected, strict=True)]
    report = f"tokens until the first difference from fp32, of {NEW_TOKENS}: {agreement}"
    assert agreement["fp16"] == [NEW_TOKENS] * len(PROMPTS), report
    assert min(agreement["int8"]) >= 1, report
