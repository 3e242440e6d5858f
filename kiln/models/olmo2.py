"""OLMo 2: Llama's attention and SwiGLU MLP in post-norm blocks.

Differences from Llama, as in transformers: a block norms each sublayer's output before its residual add
(`x + norm(attn(x))`, `x + norm(mlp(x))`) and its inputs not at all, and q and k are RMS-normed over their
whole projection width (all heads together, one weight per channel) before RoPE.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.models.attention import AttentionBatch
from kiln.models.config import ModelConfig
from kiln.models.layers import Attention, GatedMLP, RMSNorm, add_normed, apply_rotary
from kiln.models.llama import Llama


class Olmo2Attention(Attention):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer, norm_offset=False)
        self.q_norm = RMSNorm((self.heads * self.head_dim,), config.rms_norm_eps)
        self.k_norm = RMSNorm((self.kv_heads * self.head_dim,), config.rms_norm_eps)

    @property
    def kernel_ready(self) -> bool:
        return False  # the fused kernel norms each head; OLMo 2 norms whole projections

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        n, q_rows, kv_rows = x.shape[0], self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_rows, kv_rows, kv_rows], dim=-1)
        q = apply_rotary(self.q_norm(q).view(n, self.heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_norm(k).view(n, self.kv_heads, self.head_dim), cos, sin)
        out = batch.attend(q, k, v.view(n, self.kv_heads, self.head_dim), self.layer, self.scale)
        return self.o_proj(out.reshape(n, q_rows))


class Olmo2Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer)
        self.post_attention_layernorm = RMSNorm((config.hidden_size,), config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.post_feedforward_layernorm = RMSNorm((config.hidden_size,), config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        x = add_normed(x, self.self_attn(x, cos, sin, batch), self.post_attention_layernorm, None)[0]
        return add_normed(x, self.mlp(x), self.post_feedforward_layernorm, None)[0]


class Olmo2(Llama):
    block = Olmo2Block
