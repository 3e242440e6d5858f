"""Decoder blocks that step as one C++ call where the kernels compute all of them (kernels/decoder_layer.h).

A small model's decode step spent about a fifth of its time between kernels: each layer reached its twelve
kernel calls through Python module calls and tensor views. A block whose every part is a kernel's (fused
norms, q/k norm + RoPE, gated activation, projections the kernels hold) gets a DecoderLayer that makes the
same calls in C++, and steps through it whenever its attention runs in place on pages the kernels store;
other steps (gathered attention for long appends, a tier streamed) take the modules as before. The layer
holds the modules' own tensors, so it computes what they compute, bit for bit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.kernels import kernels
from kiln.models.attention import AttentionBatch
from kiln.models.gguf_blocks import BlockLinear
from kiln.models.layers import Attention, GatedMLP, RMSNorm, norm_args
from kiln.models.quant import QuantizedLinear
from kiln.platform import Platform


@dataclass(frozen=True)
class BlockNorms:
    """A pre-norm block's RMSNorms: on its input, on the attention's output before the residual add (Gemma 3
    has one, Llama none), on the MLP's input, and on the MLP's output (Gemma 3)."""

    input: RMSNorm
    attention_out: RMSNorm | None
    mlp_in: RMSNorm
    mlp_out: RMSNorm | None


class FusedBlock(nn.Module, ABC):
    """x + attention(input(x)), normed as BlockNorms says, then + mlp(mlp_in(...)). Subclasses hold
    `self_attn` (an Attention) and `mlp`, say which norms sit where (`block_norms`: None where the block
    computes something the kernel does not) and compute the block with their modules (`module_forward`)."""

    self_attn: Attention
    layer_kernel: Any = None  # kernels().DecoderLayer, once use_layer_kernel built one

    @abstractmethod
    def block_norms(self) -> BlockNorms | None: ...

    @abstractmethod
    def module_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch) -> torch.Tensor: ...

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        if self.layer_kernel is not None:
            attn = self.self_attn
            args = batch.layer_kernel_args(attn.layer, x.shape[0] * attn.heads * attn.head_dim)
            if args is not None:
                return self.layer_kernel.run(x, cos, sin, *args)
        return self.module_forward(x, cos, sin, batch)

    def use_layer_kernel(self) -> None:
        """Step through a DecoderLayer from now on where the kernels compute every part of the block (after
        CausalLM.use_kernels fused its norms and activations; with the weights final: the layer holds these
        tensors); `layer_kernel` stays None where they do not."""
        self.layer_kernel = _decoder_layer(self)


def _decoder_layer(block: FusedBlock) -> Any:
    attn, mlp, norms = block.self_attn, getattr(block, "mlp", None), block.block_norms()
    if norms is None or not isinstance(mlp, GatedMLP) or not (attn.fused and mlp.fused):
        return None
    if not all(norm is None or norm.fused for norm in (norms.input, norms.attention_out, norms.mlp_in, norms.mlp_out)):
        return None
    projections = [_projection(layer) for layer in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if None in projections:
        return None
    qkv, o_proj, gate_up, down = projections
    return kernels().DecoderLayer(
        input_norm=norm_args(norms.input), qkv=qkv, qk_norm=norm_args(attn.qk_norm), heads=attn.heads,
        kv_heads=attn.kv_heads, head_dim=attn.head_dim, scale=attn.scale, o_proj=o_proj,
        attention_out_norm=norm_args(norms.attention_out), mlp_in_norm=norm_args(norms.mlp_in), gate_up=gate_up,
        activation=mlp.activation, down=down, mlp_out_norm=norm_args(norms.mlp_out),
    )


def _projection(layer: nn.Module) -> Any:
    """The layer as the kernels take it; None for a layer they do not compute (not float32 on the CPU)."""
    if isinstance(layer, QuantizedLinear | BlockLinear):
        return layer.kernel_projection()
    if isinstance(layer, nn.Linear) and layer.weight.dtype == torch.float32 and Platform.of(layer.weight.device).kernels:
        return kernels().Projection.matrix(layer.weight.detach(), None if layer.bias is None else layer.bias.detach())
    return None
