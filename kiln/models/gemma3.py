"""Gemma 3 text model: sliding-window and global layers, q/k norms, sandwich norms, GeGLU, tied head.

Differences from Llama, all as in transformers: embeddings are scaled by sqrt(hidden) (the scale first
cast to the weight dtype); every RMSNorm scales by (1 + w); each block norms the attention and MLP
outputs as well as their inputs; scores are scaled by query_pre_attn_scalar**-0.5; global layers use
RoPE base `rope_theta` with optional scaling, sliding layers base `rope_local_theta` without scaling.
"""

from __future__ import annotations

from functools import cache

import torch

from kiln.models.attention import AttentionBatch
from kiln.models.causal_lm import CausalLM, Decoder
from kiln.models.config import ModelConfig
from kiln.models.fused_block import BlockNorms, FusedBlock
from kiln.models.hf_config import GEMMA3_LOCAL_ROPE_THETA
from kiln.models.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding, add_normed


class Gemma3Block(FusedBlock):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        hidden, eps = (config.hidden_size,), config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, offset=True)
        self.self_attn = Attention(config, layer, norm_offset=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset=True)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset=True)

    def block_norms(self) -> BlockNorms:
        return BlockNorms(self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                          self.post_feedforward_layernorm)

    def module_forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, batch)
        x, h = add_normed(x, attended, self.post_attention_layernorm, self.pre_feedforward_layernorm)
        return add_normed(x, self.mlp(h), self.post_feedforward_layernorm, None)[0]


class Gemma3(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        layers = [Gemma3Block(config, i) for i in range(config.num_layers)]
        super().__init__(config, Decoder(config, layers, norm_offset=True))
        local_theta = config.rope_local_theta or GEMMA3_LOCAL_ROPE_THETA
        self.rotary = {
            "full_attention": RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling),
            "sliding_attention": RotaryEmbedding(config.head_dim, local_theta),
        }

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        hidden = hidden * _embed_scale(self.config.hidden_size, hidden.dtype)
        needed = batch.kv.last_position + 1
        tables = {kind: rotary(positions, hidden.dtype, needed) for kind, rotary in self.rotary.items()}
        for block, kind in zip(self.model.layers, self.config.layer_types, strict=True):
            hidden = block(hidden, *tables[kind], batch)
        return self.model.norm(hidden)


@cache
def _embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden) rounded to `dtype` first, as transformers computes it (matters in bf16/fp16)."""
    return float(torch.tensor(hidden_size**0.5, dtype=torch.float32, device="cpu").to(dtype))
