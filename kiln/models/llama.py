"""Llama 2/3, Mistral, Qwen2 and Qwen3: pre-norm decoder blocks of RoPE attention and a SwiGLU MLP.

The family differs only in config: Qwen2 puts a bias on q/k/v (`attention_bias`), Qwen3 RMS-norms each
q/k head before RoPE (`qk_norm`), Llama 3 scales RoPE frequencies (`rope_scaling`), and Mistral/Qwen2
sliding windows live in `layer_types`, which the batch mask applies. Qwen3-MoE and Qwen2-MoE are Qwen3 and
Qwen2 with sparse expert feed-forwards (`moe`, kiln/models/moe.py). Phi-3 rotates part of each head
(`rotary_dim`), SmolLM3 skips RoPE in some layers (`nope_layers`), and Granite scales embeddings, sublayer
outputs, scores and logits by constants (its multipliers).
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.models.attention import AttentionBatch
from kiln.models.causal_lm import CausalLM, Decoder
from kiln.models.config import ModelConfig
from kiln.models.fused_block import BlockNorms, FusedBlock
from kiln.models.layers import Attention, RMSNorm, RotaryEmbedding, add_normed
from kiln.models.moe import feed_forward


class LlamaBlock(FusedBlock):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm((config.hidden_size,), config.rms_norm_eps)
        self.self_attn = Attention(config, layer, norm_offset=False)
        self.post_attention_layernorm = RMSNorm((config.hidden_size,), config.rms_norm_eps)
        self.mlp = feed_forward(config, layer)  # a SparseMoE in a mixture-of-experts model's sparse layers
        self.residual_multiplier = config.residual_multiplier

    def block_norms(self) -> BlockNorms | None:
        """None for Granite, whose sublayer outputs are scaled (the layer kernel does not scale them)."""
        return BlockNorms(self.input_layernorm, None, self.post_attention_layernorm, None) if self.residual_multiplier == 1.0 else None

    def module_forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        attended = _times(self.self_attn(self.input_layernorm(x), cos, sin, batch), self.residual_multiplier)
        x, h = add_normed(x, attended, None, self.post_attention_layernorm)
        return x + _times(self.mlp(h), self.residual_multiplier)


class Llama(CausalLM):
    block: type[nn.Module] = LlamaBlock  # OLMo 2 (kiln/models/olmo2.py) runs its own blocks in this frame

    def __init__(self, config: ModelConfig) -> None:
        layers = [self.block(config, i) for i in range(config.num_layers)]
        super().__init__(config, Decoder(config, layers, norm_offset=False))
        self.rotary = RotaryEmbedding(config.rotary_dim or config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """Granite's logits_scaling divides the normed hidden states: the LM head is linear, so the logits
        come out divided, whichever head (float or quantised) computes them."""
        hidden = _times(self.model.embed_tokens(input_ids), self.config.embedding_multiplier)
        cos, sin = self.rotary(positions, hidden.dtype, batch.kv.last_position + 1)
        for block in self.model.layers:
            hidden = block(hidden, cos, sin, batch)
        return _times(self.model.norm(hidden), 1.0 / self.config.logits_scaling)


def _times(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    """x * multiplier, skipping the op for the 1.0 of every model but Granite."""
    return x if multiplier == 1.0 else x * multiplier
