"""Llama 2/3, Mistral, Qwen2 and Qwen3: pre-norm decoder blocks of RoPE attention and a SwiGLU MLP.

The family differs only in config: Qwen2 puts a bias on q/k/v (`attention_bias`), Qwen3 RMS-norms each
q/k head before RoPE (`qk_norm`), Llama 3 scales RoPE frequencies (`rope_scaling`), and Mistral/Qwen2
sliding windows live in `layer_types`, which the batch mask applies.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.models.attention import AttentionBatch
from kiln.models.causal_lm import CausalLM, Decoder
from kiln.models.config import ModelConfig
from kiln.models.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding, add_normed


class LlamaBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm((config.hidden_size,), config.rms_norm_eps)
        self.self_attn = Attention(config, layer, norm_offset=False)
        self.post_attention_layernorm = RMSNorm((config.hidden_size,), config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        x, h = add_normed(x, self.self_attn(self.input_layernorm(x), cos, sin, batch), None, self.post_attention_layernorm)
        return x + self.mlp(h)


class Llama(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        layers = [LlamaBlock(config, i) for i in range(config.num_layers)]
        super().__init__(config, Decoder(config, layers, norm_offset=False))
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, hidden.dtype)
        for block in self.model.layers:
            hidden = block(hidden, cos, sin, batch)
        return self.model.norm(hidden)
