"""Model sources of every architecture Kiln runs, beyond the tiny-model parity of test_parity.py.

Kiln computes what llama.cpp computes on a GGUF file of each architecture it reads: tiny float32 files of
the tiny random models (tests/tiny_gguf.py), against llama.cpp's logits on the same bytes, recorded in
tests/fixtures/architectures/llama_cpp_logits.json (record_llama_cpp.py there says how; CI cannot build
llama.cpp). A multimodal Gemma 3 checkpoint (4B and up: Gemma3ForConditionalGeneration) runs its text model.
Files and directories of architectures Kiln does not run are refused, naming what it runs."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Phi3Config
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from kiln.errors import InvalidArgumentError
from kiln.models import build_model
from kiln.models.hf_config import config_from_hf, hf_config_dict
from kiln.models.layers import RotaryEmbedding
from kiln.models.loader import load_model
from tests.models.test_loader import save_hf_dir
from tests.models.test_parity import ATOL as PARITY_ATOL
from tests.models.test_parity import PoisonedCache, max_diff, random_tokens, solo
from tests.tiny_gguf import REFERENCE_ARCHITECTURES, write_gguf, write_reference_gguf
from tests.tiny_models import TINY_CONFIGS, hf_state_dict, tiny_hf_model

FIXTURE = Path(__file__).parents[1] / "fixtures" / "architectures" / "llama_cpp_logits.json"
# Both sides compute in float32 from the same float32 weights with a float32 KV cache: the order of sums and
# llama.cpp's own RoPE sin/cos leave about 2e-6 of the largest logit. ggml's CPU GELU (Gemma) rounds its
# input to float16 and looks the result up in a table (GGML_GELU_FP16 in ggml-cpu/vec.h): 4e-5 there.
RTOL = 1e-4


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("name", list(REFERENCE_ARCHITECTURES))
def test_logits_match_llama_cpp_on_the_same_file(name: str, recorded: dict, tmp_path: Path) -> None:
    record = recorded["models"][name]
    path = write_reference_gguf(name, tmp_path / f"{name}.gguf")
    assert record["architecture"] == REFERENCE_ARCHITECTURES[name]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == record["sha256"], (
        "the seeded file is not the one llama.cpp was recorded on: re-record (record_llama_cpp.py)"
    )
    loaded = load_model(path, cache_dir=tmp_path / "cache")
    model = build_model(loaded.config)
    model.load_weights(loaded.tensors)
    tokens = recorded["tokens"]
    # A prefill chunk, then decode steps and a short append, across 4-token pages.
    ours = solo(PoisonedCache(model, loaded.config, 4, len(tokens)), tokens, [5, 1, 1, 3, 1, 1])
    reference = torch.tensor(record["logits"])
    assert max_diff(ours, reference) <= RTOL * reference.abs().max().item()


_S, _F = "sliding_attention", "full_attention"


@pytest.mark.parametrize(
    ("pattern", "layer_types"),
    [(None, (_S,) * 5 + (_F,)), (3, (_S, _S, _F) * 2), ([True, False, True, True, False, False], (_S, _F, _S, _S, _F, _F))],
)
def test_gemma3_gguf_layer_pattern_as_llama_cpp_reads_it(pattern: object, layer_types: tuple, tmp_path: Path) -> None:
    """No key: every 6th layer global (what llama.cpp assumes); a period; or one flag per layer (true: sliding)."""
    path = tmp_path / "gemma3.gguf"
    extra = {} if pattern is None else {"gemma3.attention.sliding_window_pattern": pattern}
    write_gguf(path, "gemma3", TINY_CONFIGS["gemma3"], hf_state_dict(tiny_hf_model("gemma3")), metadata=extra)
    assert load_model(path, cache_dir=tmp_path / "cache").config.layer_types == layer_types


def test_unsupported_hf_model_type_is_refused_naming_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phimoe", "num_hidden_layers": 2}))
    message = "unsupported model_type 'phimoe'; supported: "
    with pytest.raises(InvalidArgumentError, match=re.escape(message)) as refused:
        load_model(tmp_path, cache_dir=tmp_path / "cache")
    for model_type in ("gemma3", "granite", "llama", "ministral", "mistral", "olmo2", "phi3", "smollm3"):
        assert re.search(rf"\b{model_type}\b", str(refused.value)), model_type


def test_multimodal_gemma3_checkpoint_runs_its_text_model(tmp_path: Path) -> None:
    """Gemma 3 4B and up are Gemma3ForConditionalGeneration: the text model's tensors lie under
    language_model.model.*, beside a vision tower Kiln drops, and its config under text_config."""
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
    config = Gemma3Config(
        text_config=hf_config_dict(TINY_CONFIGS["gemma3"]), vision_config=vision, mm_tokens_per_image=4,
        image_token_index=255, boi_token_index=253, eoi_token_index=254,
    )
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():  # norms away from their identity init, so they matter
            if "norm" in name:
                param.add_(0.3 * torch.randn(param.shape))
    loaded = load_model(save_hf_dir(hf, tmp_path / "gemma3-4b"), cache_dir=tmp_path / "cache")
    assert loaded.config == TINY_CONFIGS["gemma3"]
    model = build_model(loaded.config)
    model.load_weights(loaded.tensors)
    tokens = random_tokens(20, seed=2)
    assert max(tokens) < config.boi_token_index  # text only
    ours = solo(PoisonedCache(model, loaded.config, 4, len(tokens)), tokens, [7, 1, 12])
    with torch.no_grad():
        reference = hf(input_ids=torch.tensor([tokens])).logits[0]
    assert max_diff(ours, reference) <= PARITY_ATOL


def test_phi4_mini_longrope_turns_as_transformers_does_past_the_original_context() -> None:
    """Phi-4-mini's config.json (transformers-4 keys): 3/4 of each head rotated, LongRoPE factors, a context
    of 131072 over an original 4096. Kiln's tables equal transformers' at positions past 4096 (where it, like
    llama.cpp at the trained context, takes the long factors), attention factor included."""
    cfg = {
        "model_type": "phi3",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 2,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "partial_rotary_factor": 0.75,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "longrope",
            "long_factor": [1.0 + 0.5 * i for i in range(48)],
            "short_factor": [1.0 + 0.01 * i for i in range(48)],
        },
        "sliding_window": 262144,
        "tie_word_embeddings": True,
    }
    config = config_from_hf(cfg)
    assert (config.rotary_dim, config.head_dim, config.fused_checkpoint) == (96, 128, True)
    assert config.sliding_window is None  # 262144 > the context: no layer slides
    positions = torch.tensor([0, 7, 4095, 4096, 70000])
    cos, sin = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)(positions, torch.float32, 70001)
    hf_cos, hf_sin = Phi3RotaryEmbedding(Phi3Config(**cfg))(torch.zeros(1), positions[None])
    assert config.rope_scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert max_diff(cos[:, 0], hf_cos[0, :, :48]) <= 1e-6 and max_diff(sin[:, 0], hf_sin[0, :, :48]) <= 1e-6


@pytest.mark.parametrize("name", ["phi3", "smollm3", "granite"])
def test_config_reads_back_from_the_weight_cache(name: str, tmp_path: Path) -> None:
    """LongRoPE factors, NoPE layers and multipliers survive the cache entry's JSON (lists become tuples)."""
    path = write_reference_gguf(name, tmp_path / f"{name}.gguf")
    first = load_model(path, cache_dir=tmp_path / "cache")
    assert load_model(path, cache_dir=tmp_path / "cache").config == first.config
