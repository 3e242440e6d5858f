"""load_model on HF directories and GGUF files, the converted-weight cache, and bad sources.

Tiny GGUF files are written here the way llama.cpp's converter writes them (llama q/k rows permuted for
its RoPE layout, Gemma norms stored as 1 + w, shapes innermost first), from the tiny random transformers
models of tests/tiny_models.py; loading must give back those models' tensors.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, PreTrainedModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kiln.errors import InvalidArgumentError
from kiln.models import loader, weight_cache
from kiln.models.config import ModelConfig, RopeScaling
from kiln.models.gguf_import import SUPPORTED_ARCHITECTURES
from kiln.models.loader import load_model
from kiln.tokenizer import Tokenizer
from tests.tiny_gguf import spm_metadata, write_gguf
from tests.tiny_models import TINY_CONFIGS, hf_state_dict, tiny_hf_model

# ---------------------------------------------------------------- writing tiny sources


def save_hf_dir(model: PreTrainedModel, directory: Path, **save_options: object) -> Path:
    """save_pretrained plus a tokenizer.json and tokenizer_config.json naming BOS/EOS."""
    model.save_pretrained(directory, **save_options)
    Tokenizer.from_gguf(spm_metadata(gemma=False)).backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": "{{ x }}"})
    )
    return directory


def gguf_config(name: str) -> ModelConfig:
    """TINY_CONFIGS[name] as a GGUF of it reads back: llama.cpp stores no sliding window for llama/qwen
    and hard-codes Gemma 3's layer pattern and attention scale; names and BOS/EOS come from the file."""
    config = TINY_CONFIGS[name]
    if config.architecture == "gemma3":
        pattern = tuple(
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(config.num_layers)
        )
        config = dataclasses.replace(
            config, layer_types=pattern, query_pre_attn_scalar=float(config.head_dim)
        )
    else:
        config = dataclasses.replace(config, sliding_window=None, layer_types=())
    metadata = spm_metadata(gemma=config.architecture == "gemma3")
    eos = (
        (metadata["tokenizer.ggml.eos_token_id"], 5)
        if config.architecture == "gemma3"
        else (metadata["tokenizer.ggml.eos_token_id"],)
    )
    return dataclasses.replace(
        config, name="", bos_token_id=metadata["tokenizer.ggml.bos_token_id"], eos_token_ids=eos
    )


def assert_same_tensors(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = 0.0
) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == torch.float32, name
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=atol, msg=name)


def entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.is_dir()) if cache.is_dir() else []


# ---------------------------------------------------------------- HF directories


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3"])
def test_hf_dir_loads_back_identical_tensors_and_config(name: str, tmp_path: Path) -> None:
    model = tiny_hf_model(name)
    source = save_hf_dir(model, tmp_path / "model")
    loaded = load_model(source, cache_dir=tmp_path / "cache")
    assert_same_tensors(loaded.tensors, hf_state_dict(model))
    assert dataclasses.replace(loaded.config, name="") == TINY_CONFIGS[name]
    assert loaded.source == source
    assert loaded.tokenizer.bos_token_id == 1 and 2 in loaded.tokenizer.eos_token_ids
    assert loaded.tokenizer.chat_template == "{{ x }}"
    assert len(loaded.fingerprint) == 64 and entries(tmp_path / "cache") == []


def test_sharded_hf_dir_and_content_fingerprint(tmp_path: Path) -> None:
    model = tiny_hf_model("gemma3")
    sharded = save_hf_dir(model, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    loaded = load_model(sharded, cache_dir=tmp_path / "cache")
    assert_same_tensors(loaded.tensors, hf_state_dict(model))
    copy = shutil.copytree(sharded, tmp_path / "elsewhere")
    assert load_model(copy, cache_dir=tmp_path / "cache").fingerprint == loaded.fingerprint
    single = save_hf_dir(model, tmp_path / "single")
    assert load_model(single, cache_dir=tmp_path / "cache").fingerprint != loaded.fingerprint


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sharded_half_precision_hf_dir_loads_its_values(dtype: torch.dtype, tmp_path: Path) -> None:
    """A bf16 / fp16 checkpoint in shards (as released models are) loads to float32 of exactly its stored
    values: the shard index names the files, and the stored dtype is what each tensor is decoded from."""
    model = tiny_hf_model("qwen3").to(dtype)
    sharded = save_hf_dir(model, tmp_path / "sharded", max_shard_size="20KB")
    shards = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values()
    assert len(set(shards)) > 2
    loaded = load_model(sharded, cache_dir=tmp_path / "cache")
    assert_same_tensors(loaded.tensors, {name: t.float() for name, t in hf_state_dict(model).items()})


def test_hf_dir_missing_tensor_or_config_is_invalid(tmp_path: Path) -> None:
    source = save_hf_dir(tiny_hf_model("llama"), tmp_path / "model")
    weights = load_file(source / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, source / "model.safetensors")
    with pytest.raises(InvalidArgumentError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(source, cache_dir=tmp_path / "cache")
    (source / "config.json").unlink()
    with pytest.raises(InvalidArgumentError, match="no config.json"):
        load_model(source, cache_dir=tmp_path / "cache")


# ---------------------------------------------------------------- GGUF files


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma3", "phi3", "smollm3", "olmo2", "granite"])
def test_f32_gguf_loads_back_the_source_weights(name: str, tmp_path: Path) -> None:
    model = tiny_hf_model(name)
    path = tmp_path / f"{name}.gguf"
    write_gguf(path, name, TINY_CONFIGS[name], hf_state_dict(model))
    loaded = load_model(path, cache_dir=tmp_path / "cache")
    # Exact, except Gemma norms: llama.cpp rounds 1 + w to float32 before we subtract 1 again.
    assert_same_tensors(loaded.tensors, hf_state_dict(model), atol=1e-6 if name == "gemma3" else 0.0)
    assert dataclasses.replace(loaded.config, name="") == gguf_config(name)
    assert loaded.config.name == f"tiny {name}"


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_q8_0_gguf_is_close_to_the_source_weights(name: str, tmp_path: Path) -> None:
    model = tiny_hf_model(name)
    path = tmp_path / f"{name}.gguf"
    write_gguf(path, name, TINY_CONFIGS[name], hf_state_dict(model), quantize=True)
    loaded = load_model(path, cache_dir=tmp_path / "cache")
    for tensor_name, tensor in hf_state_dict(model).items():
        # Q8_0: 8-bit codes scaled per block of 32 by max|x| / 127, so the error is at most half a step.
        step = tensor.abs().max().item() / 127
        torch.testing.assert_close(loaded.tensors[tensor_name], tensor, rtol=0, atol=step, msg=tensor_name)


def llama3_divisors(scaling: RopeScaling, theta: float, head_dim: int) -> np.ndarray:
    """rope_freqs as llama.cpp writes it: transformers' unscaled inverse frequencies over its llama3 ones."""
    parameters = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters=parameters)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    unscaled = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (unscaled / scaled.double()).numpy()


@pytest.mark.parametrize(
    "theta, scaling",
    [
        (500000.0, TINY_CONFIGS["llama3_rope"].rope_scaling),  # no frequency inside the blend band
        (10000.0, RopeScaling("llama3", 8.0, 2.0, 16.0, 4096)),  # two inside: the band is fitted
    ],
)
def test_llama3_rope_freqs_become_rope_scaling(theta: float, scaling: RopeScaling, tmp_path: Path) -> None:
    config = dataclasses.replace(TINY_CONFIGS["llama"], rope_theta=theta, rope_scaling=scaling)
    path = tmp_path / "llama3.gguf"
    divisors = llama3_divisors(scaling, theta, config.head_dim)
    tensors = hf_state_dict(tiny_hf_model("llama"))
    write_gguf(
        path,
        "llama",
        config,
        tensors,
        rope_freqs=divisors,
        original_context=scaling.original_max_position_embeddings,
    )
    loaded = load_model(path, cache_dir=tmp_path / "cache")
    assert loaded.config.rope_scaling == scaling
    assert loaded.config.rope_theta == theta
    assert "rope_freqs.weight" not in loaded.tensors and sorted(loaded.tensors) == sorted(tensors)


# ---------------------------------------------------------------- the converted-weight cache


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", TINY_CONFIGS["llama"], hf_state_dict(tiny_hf_model("llama")))
    return path


def test_second_load_reads_the_cache(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    first = load_model(tiny_gguf, cache_dir=cache)
    assert entries(cache) == [first.fingerprint]
    entry = cache / first.fingerprint
    # The description only: weights are read from the GGUF file until a configuration keeps a conversion.
    assert sorted(p.name for p in entry.iterdir()) == [
        "config.json",
        "gguf_tensors.json",
        "tokenizer.json",
        "tokenizer_kiln.json",
    ]

    def no_conversion(path: Path) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "read_gguf", no_conversion)
    second = load_model(tiny_gguf, cache_dir=cache)
    assert second.fingerprint == first.fingerprint and second.config == first.config
    assert_same_tensors(second.tensors, first.tensors)
    text = "ab cd"
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert second.tokenizer.eos_token_ids == first.tokenizer.eos_token_ids


def test_env_var_sets_the_default_cache_dir(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "from-env"))
    loaded = load_model(tiny_gguf)
    assert entries(tmp_path / "from-env") == [loaded.fingerprint]


def test_fingerprint_is_memoised_until_the_file_changes(tiny_gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = load_model(tiny_gguf, cache_dir=cache)
    memo_file = cache / "fingerprints.json"
    memo = json.loads(memo_file.read_text())
    (record,) = memo.values()
    assert record["size"] == tiny_gguf.stat().st_size
    # A forged memo is believed while size and mtime match: the file was not hashed again.
    record["sha256"] = "0" * 64
    memo_file.write_text(json.dumps(memo))
    assert load_model(tiny_gguf, cache_dir=cache).fingerprint == weight_cache.fingerprint(
        {"model.gguf": "0" * 64}
    )
    # A new mtime forces a re-hash; the content is the same, so is the fingerprint.
    os.utime(tiny_gguf, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert load_model(tiny_gguf, cache_dir=cache).fingerprint == first.fingerprint
    # A copy elsewhere has the same content fingerprint; changed content has a new one.
    copy = shutil.copy(tiny_gguf, tmp_path / "copy.gguf")
    assert load_model(copy, cache_dir=cache).fingerprint == first.fingerprint
    write_gguf(tiny_gguf, "llama", TINY_CONFIGS["llama"], hf_state_dict(tiny_hf_model("llama", seed=1)))
    assert load_model(tiny_gguf, cache_dir=cache).fingerprint != first.fingerprint


def test_failed_conversion_leaves_no_entry(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"

    def killed(tokenizer: Tokenizer, directory: Path) -> None:
        (directory / "tokenizer.json").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(Tokenizer, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        load_model(tiny_gguf, cache_dir=cache)
    assert entries(cache) == []
    monkeypatch.undo()
    # Staging left by a writer that died (its pid no longer exists) is swept by the next conversion.
    abandoned = cache / ".tmp-0123456789abcdef-999999999-x1y2z3"
    abandoned.mkdir()
    loaded = load_model(tiny_gguf, cache_dir=cache)
    assert entries(cache) == [loaded.fingerprint]


# ---------------------------------------------------------------- bad sources


def truncate(path: Path, keep: int) -> Path:
    path.write_bytes(path.read_bytes()[:keep])
    return path


def test_missing_path_is_invalid(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        load_model(tmp_path / "nope.gguf", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("keep", [2, 64, 2000, -100])
def test_truncated_gguf_is_invalid(keep: int, tiny_gguf: Path, tmp_path: Path) -> None:
    size = tiny_gguf.stat().st_size
    truncate(tiny_gguf, keep % size)
    with pytest.raises(InvalidArgumentError, match="not a readable GGUF"):
        load_model(tiny_gguf, cache_dir=tmp_path / "cache")
    assert entries(tmp_path / "cache") == []


def test_not_a_gguf_is_invalid(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 definitely a zip file" * 10)
    with pytest.raises(InvalidArgumentError, match="not a readable GGUF"):
        load_model(path, cache_dir=tmp_path / "cache")


def test_unsupported_architecture_is_invalid(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    write_gguf(path, "phi2", TINY_CONFIGS["llama"], hf_state_dict(tiny_hf_model("llama")))
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    assert {"granite", "llama", "olmo2", "phi3", "smollm3", "gemma3"} <= set(SUPPORTED_ARCHITECTURES)
    message = f"unsupported GGUF architecture 'phi2'; supported: {supported}"
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        load_model(path, cache_dir=tmp_path / "cache")


def test_gguf_missing_tensor_is_invalid(tmp_path: Path) -> None:
    tensors = hf_state_dict(tiny_hf_model("llama"))
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    path = tmp_path / "holey.gguf"
    write_gguf(path, "llama", TINY_CONFIGS["llama"], tensors)
    with pytest.raises(InvalidArgumentError, match="model.layers.0.self_attn.v_proj.weight"):
        load_model(path, cache_dir=tmp_path / "cache")
    assert entries(tmp_path / "cache") == []


# ---------------------------------------------------------------- the embedded model


@pytest.mark.embedded
def test_embedded_model_converts_once_then_loads_from_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    started = time.perf_counter()
    first = load_model(cache_dir=cache)
    converted = time.perf_counter() - started
    c = first.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("gemma3", 18, 640, 2048)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (4, 1, 256, 262144)
    assert (c.rope_theta, c.rope_local_theta, c.sliding_window, c.max_position_embeddings) == (
        1e6,
        1e4,
        512,
        32768,
    )
    assert (c.rms_norm_eps, c.query_pre_attn_scalar, c.tie_word_embeddings, c.qk_norm) == (
        1e-6,
        256.0,
        True,
        True,
    )
    assert [i for i, kind in enumerate(c.layer_types) if kind == "full_attention"] == [5, 11, 17]
    assert (c.bos_token_id, c.eos_token_ids) == (2, (1, 106))
    assert "lm_head.weight" not in first.tensors
    assert first.tensors["model.embed_tokens.weight"].shape == (262144, 640)
    # llama.cpp stored 1 + w; the HF weight is w (attn_norm's stored mean is about 13.5).
    assert 10 < first.tensors["model.layers.0.input_layernorm.weight"].mean().item() < 14

    monkeypatch.setattr(loader, "read_gguf", lambda path: pytest.fail("converted again"))
    started = time.perf_counter()
    second = load_model(cache_dir=cache)
    cached = time.perf_counter() - started
    assert second.fingerprint == first.fingerprint
    assert torch.equal(
        second.tensors["model.layers.3.mlp.down_proj.weight"],
        first.tensors["model.layers.3.mlp.down_proj.weight"],
    )
    assert cached < converted
