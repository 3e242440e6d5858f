"""Tiny randomly initialised transformers models, one per architecture Kiln implements, for parity tests.

Each comes from a ModelConfig via `hf_config_dict`, is built in fp32 with eager attention, and gets
weights drawn so that every parameter matters (norm weights away from their identity init, biases
nonzero, projections scaled to keep activations O(1)), so a wrong formula shows up in the logits.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from kiln.models.config import ModelConfig, MoEConfig, RopeScaling
from kiln.models.hf_config import hf_config_dict

_BASE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,  # room for prompts longer than Gemma's 512-token window
    "bos_token_id": 1,
    "eos_token_ids": (2,),
}
_SLIDING, _FULL = "sliding_attention", "full_attention"

TINY_CONFIGS: dict[str, ModelConfig] = {
    "llama": ModelConfig("llama", num_layers=2, **_BASE),
    "llama3_rope": ModelConfig(
        "llama",
        num_layers=2,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, original_max_position_embeddings=32),
        **_BASE,
    ),
    "mistral": ModelConfig("llama", num_layers=2, sliding_window=7, **_BASE),
    "qwen2": ModelConfig(
        "llama",
        num_layers=3,
        attention_bias=True,
        sliding_window=10,
        layer_types=(_FULL, _SLIDING, _SLIDING),
        **_BASE,
    ),
    "qwen3": ModelConfig(
        "llama", num_layers=2, qk_norm=True, tie_word_embeddings=True, rope_theta=1e6, **_BASE
    ),
    # 8 experts, 2 per token: rows of a step take different experts. Every layer is sparse, as llama.cpp
    # requires of qwen3moe and qwen2moe files (test_parity's test_dense_layers_between_sparse_ones mixes).
    "qwen3_moe": ModelConfig(
        "llama",
        num_layers=2,
        qk_norm=True,
        rope_theta=1e6,
        moe=MoEConfig(8, 2, expert_intermediate_size=32, norm_topk_prob=True),
        **_BASE,
    ),
    # Qwen2-MoE: a shared expert beside the routed ones, top-k weights not renormalised.
    "qwen2_moe": ModelConfig(
        "llama",
        num_layers=2,
        attention_bias=True,
        moe=MoEConfig(8, 3, expert_intermediate_size=32, norm_topk_prob=False, shared_expert_intermediate_size=64),
        **_BASE,
    ),
    "gemma3": ModelConfig(
        "gemma3",
        num_layers=6,
        sliding_window=8,
        layer_types=(_SLIDING, _SLIDING, _FULL) * 2,
        qk_norm=True,
        tie_word_embeddings=True,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=24.0,
        rope_theta=1e6,
        rope_scaling=RopeScaling("linear", 2.0),
        rope_local_theta=10000.0,
        **_BASE,
    ),
    # Ministral: Mistral with sliding and full layers interleaved.
    "ministral": ModelConfig(
        "llama", num_layers=3, sliding_window=7, layer_types=(_SLIDING, _FULL, _SLIDING), **_BASE
    ),
    # Phi-3 / Phi-4-mini: fused checkpoint tensors, half of each head rotated, one window for all layers,
    # LongRoPE with a context (1024) past the original (16): the long factors turn.
    "phi3": ModelConfig(
        "llama",
        num_layers=2,
        fused_checkpoint=True,
        rotary_dim=8,
        sliding_window=9,
        rope_scaling=RopeScaling(
            "longrope",
            64.0,
            original_max_position_embeddings=16,
            long_factor=(1.0, 1.5, 3.0, 6.0),
            short_factor=(1.0, 1.25, 1.5, 2.0),
            attention_factor=1.25,
        ),
        **_BASE,
    ),
    # SmolLM3: every 4th layer without RoPE.
    "smollm3": ModelConfig(
        "llama", num_layers=4, nope_layers=(3,), tie_word_embeddings=True, rope_theta=2e6, **_BASE
    ),
    "olmo2": ModelConfig("olmo2", num_layers=2, rms_norm_eps=1e-5, **_BASE),
    "granite": ModelConfig(
        "llama",
        num_layers=2,
        embedding_multiplier=4.0,
        residual_multiplier=0.5,
        attention_multiplier=0.1,
        logits_scaling=2.0,
        **_BASE,
    ),
}


def tiny_hf_model(name: str, seed: int = 0) -> PreTrainedModel:
    """The transformers model for TINY_CONFIGS[name], fp32, eager attention, deterministic weights."""
    return random_hf_model(TINY_CONFIGS[name], seed)


def random_hf_model(config: ModelConfig, seed: int = 0) -> PreTrainedModel:
    """The transformers model for `config`, as `tiny_hf_model`: configs that differ only in what has no
    weights (a window, the RoPE) get the same weights for the same seed."""
    hf_config = AutoConfig.for_model(**hf_config_dict(config))
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    _randomize(model, torch.Generator().manual_seed(seed))
    return model.eval()


def hf_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Parameters by HF name as a checkpoint stores them: a tied lm_head is not saved, and the experts
    transformers fuses into 3-D tensors (mlp.experts.gate_up_proj [experts, 2 * inner, hidden]) are one
    tensor per expert and projection (mlp.experts.3.gate_proj.weight), as save_pretrained writes them."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        prefix = name.removesuffix("gate_up_proj").removesuffix("down_proj")
        if not prefix.endswith(".experts."):
            tensors[name] = tensor
        elif name.endswith("gate_up_proj"):
            for expert, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1), strict=True)):
                tensors |= {f"{prefix}{expert}.gate_proj.weight": gate, f"{prefix}{expert}.up_proj.weight": up}
        else:
            tensors |= {f"{prefix}{expert}.down_proj.weight": down for expert, down in enumerate(tensor)}
    if model.config.tie_word_embeddings:
        del tensors["lm_head.weight"]
    return tensors


@torch.no_grad()
def _randomize(model: PreTrainedModel, generator: torch.Generator) -> None:
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if "norm" in name:
            param.add_(0.3 * noise)  # around 1 for w * x norms, around 0 for Gemma's (1 + w) * x
        elif name.endswith("bias"):
            param.copy_(0.3 * noise)
        elif "embed_tokens" in name:
            param.copy_(noise)
        else:
            param.copy_(noise * param.shape[-1] ** -0.5)  # fan-in: a 3-D expert tensor's too
