"""Building blocks shared by the model files: RMSNorm, rotary embedding, gated MLP and the attention layer
that projects q/k/v and calls the paged attention kernel.

Projections that read the same input are fused (q/k/v into one matmul, gate/up into another), and q and
k heads share one norm and one RoPE call: fewer, larger ops per layer for CPU decode. Each fused module
says in `hf_sources` which Hugging Face tensors fill which rows of its parameters, so checkpoints load by
their HF names.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kiln.errors import InvalidArgumentError
from kiln.kernels import kernels
from kiln.models.attention import AttentionBatch
from kiln.models.config import ModelConfig, RopeScaling

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}

# Rotary tables are built for this many positions at first and doubled whenever a step goes beyond.
_INITIAL_ROPE_POSITIONS = 4096


@dataclass(frozen=True)
class HFSource:
    """One Hugging Face tensor filling `rows` consecutive rows (dim 0) of a fused parameter. With
    `broadcast`, the HF tensor is one row repeated `rows` times (a per-head norm shared by all heads)."""

    name: str
    rows: int
    broadcast: bool = False


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in fp32.

    offset=False is Llama's `w * x`; offset=True is Gemma's `(1 + w) * x`, with the product taken in fp32
    before casting back, as transformers does. `shape` is the weight's shape: (dim,) normally, or
    (heads, dim) for per-head q/k norms fused across q and k heads.
    """

    def __init__(self, shape: tuple[int, ...], eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))
        self.eps = eps
        self.offset = offset
        self.fused = False  # one C++ call (kernels/norms.cpp) instead of six ops; see CausalLM.use_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return kernels().rms_norm(x, self.weight, self.eps, float(self.offset))
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.offset:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return self.weight * normed.to(x.dtype)


def add_normed(
    x: torch.Tensor, y: torch.Tensor, y_norm: RMSNorm | None, out_norm: RMSNorm | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual stream after a sublayer, x + y_norm(y) (x + y without a norm), and out_norm of it (the
    next sublayer's input; None without a norm); at least one of the norms is given. One C++ call when the
    norms are fused: a decode step of a small model pays more for separate adds and norms' dispatch than
    for their arithmetic."""
    if (y_norm is None or y_norm.fused) and (out_norm is None or out_norm.fused):
        return kernels().residual_norm(x, y, *norm_args(y_norm), *norm_args(out_norm))
    total = x + (y if y_norm is None else y_norm(y))
    return total, None if out_norm is None else out_norm(total)


def norm_args(norm: RMSNorm | None) -> tuple[torch.Tensor | None, float, float]:
    return (None, 0.0, 0.0) if norm is None else (norm.weight, norm.eps, float(norm.offset))


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies on the CPU, bit-identical to transformers' rope init."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "longrope":  # RopeScaling says which factors
        factors = scaling.long_factor if scaling.factor > 1.0 else scaling.short_factor
        if len(factors) != len(exponents):
            raise InvalidArgumentError(f"LongRoPE has {len(factors)} factors for {len(exponents)} frequencies")
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * theta**exponents)
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate the band between.
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables of rotary position embedding (HF rotate_half convention: the two halves of a head
    are the rotated pairs). Tables hold the first half of head_dim only, since HF duplicates it; they
    grow on demand and are rebuilt when the device or dtype changes. Not weights, so not a Module."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        self.inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)
        self.attention_factor = scaling.attention_factor if scaling is not None else 1.0  # LongRoPE's
        self._cos = self._sin = torch.empty(0, device="cpu")

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [N] long, each below `needed` -> (cos, sin), each [N, 1, head_dim / 2] in `dtype`, to
        broadcast over heads. `needed` comes from the host (the step's KVStep knows its last position), so
        that whether the tables must grow is decided without reading a device tensor back: a decode step
        on a GPU makes no host read (docs/architecture.md § Layers)."""
        if needed > self._cos.shape[0] or self._cos.dtype != dtype or self._cos.device != positions.device:
            self._build(max(needed, _INITIAL_ROPE_POSITIONS, 2 * self._cos.shape[0]), positions.device, dtype)
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)

    def _build(self, num_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        # The same fp32 product as transformers (position * inv_freq), cast like its cos/sin outputs.
        freqs = (
            torch.arange(num_positions, device=device).float()[:, None] * self.inv_freq.to(device)[None, :]
        )
        scale = self.attention_factor  # 1.0 but for LongRoPE: exact either way
        self._cos, self._sin = (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim]; cos/sin: [N, 1, rotary_dim / 2]. Equals HF's x*cos + rotate_half(x)*sin
    over the first rotary_dim dims of each head; the rest pass unchanged (Phi-3's partial rotary)."""
    half = cos.shape[-1]
    if 2 * half == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one [2 * intermediate, hidden] matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise InvalidArgumentError(
                f"unsupported activation {activation!r}; supported: {sorted(ACTIVATIONS)}"
            )
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.fused = False  # act(gate) * up in one C++ call (kernels/activations.cpp); see CausalLM.use_kernels
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused:
            return self.down_proj(kernels().gated_activation(gate_up, self.activation))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def hf_sources(self) -> dict[str, tuple[HFSource, ...]]:
        rows = self.down_proj.in_features
        return {"gate_up_proj.weight": (HFSource("gate_proj.weight", rows), HFSource("up_proj.weight", rows))}


class Attention(nn.Module):
    """Self-attention of one layer over the paged KV cache.

    q/k/v come from one fused projection; with `config.qk_norm` every q and k head is RMS-normed (Qwen3,
    Gemma 3) before RoPE. `norm_offset` selects Gemma's (1 + w) norm. RoPE turns the first
    `config.rotary_dim` dims of each head, and none in `config.nope_layers`. Scores are scaled by
    `config.attention_scale`; which keys a query sees (causal, window, padding) is the batch mask's job.
    """

    def __init__(self, config: ModelConfig, layer: int, norm_offset: bool) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = config.attention_scale
        self.uses_rope = layer not in config.nope_layers
        self.rotary_dim = config.rotary_dim or self.head_dim
        qkv_rows = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_rows, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.qk_norm = (
            RMSNorm((self.heads + self.kv_heads, self.head_dim), config.rms_norm_eps, norm_offset)
            if config.qk_norm
            else None
        )
        self.fused = False  # q/k norms and RoPE in one C++ call (kernels/norms.cpp); see CausalLM.use_kernels

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """x: [N, hidden]; cos/sin from RotaryEmbedding for these N rows. Returns [N, hidden]."""
        n = x.shape[0]
        qkv = self.qkv_proj(x).view(n, -1, self.head_dim)
        if self.fused:  # reads q and k out of qkv itself
            q, k = kernels().qk_norm_rope(qkv, *norm_args(self.qk_norm), cos.view(n, -1), sin.view(n, -1), self.heads)
            v = qkv[:, self.heads + self.kv_heads :]
        else:
            qk, v = qkv.split([self.heads + self.kv_heads, self.kv_heads], dim=1)
            qk = qk if self.qk_norm is None else self.qk_norm(qk)
            q, k = (apply_rotary(qk, cos, sin) if self.uses_rope else qk).split([self.heads, self.kv_heads], dim=1)
        out = batch.attend(q, k, v, self.layer, self.scale)
        return self.o_proj(out.reshape(n, self.heads * self.head_dim))

    @property
    def kernel_ready(self) -> bool:
        """Whether the fused q/k norm + RoPE kernel computes this layer: it rotates whole heads always."""
        return self.head_dim % 16 == 0 and self.uses_rope and self.rotary_dim == self.head_dim

    def hf_sources(self) -> dict[str, tuple[HFSource, ...]]:
        q_rows, kv_rows = self.heads * self.head_dim, self.kv_heads * self.head_dim
        sources = {}
        for kind in ("weight", "bias") if self.qkv_proj.bias is not None else ("weight",):
            sources[f"qkv_proj.{kind}"] = (
                HFSource(f"q_proj.{kind}", q_rows),
                HFSource(f"k_proj.{kind}", kv_rows),
                HFSource(f"v_proj.{kind}", kv_rows),
            )
        if self.qk_norm is not None:
            sources["qk_norm.weight"] = (
                HFSource("q_norm.weight", self.heads, broadcast=True),
                HFSource("k_norm.weight", self.kv_heads, broadcast=True),
            )
        return sources
