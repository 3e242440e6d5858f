"""ModelConfig: the architecture facts a model definition and the KV cache need, whatever the source format."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

LayerType = Literal["full_attention", "sliding_attention"]


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "linear" (positions divided by factor), "llama3" (band-wise) or
    "longrope" (Phi-3 / Phi-4-mini: each frequency divided by its own factor, cos and sin multiplied by
    `attention_factor`). A LongRoPE model uses `long_factor` when its context exceeds the original one
    (`factor`, their ratio, above 1), else `short_factor`: Kiln keeps keys rotated once, so one set serves
    every position, the one llama.cpp picks at the trained context (transformers switches per forward)."""

    kind: Literal["linear", "llama3", "longrope"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    long_factor: tuple[float, ...] = ()
    short_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("long_factor", "short_factor"):  # lists when read back from JSON
            object.__setattr__(self, name, tuple(getattr(self, name)))


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts feed-forward (Qwen3-MoE, Qwen2-MoE): a router picks each token's
    `experts_per_token` of `num_experts` SwiGLU experts, softmax weights renormalised over the picked ones
    when `norm_topk_prob`; a shared expert (`shared_expert_intermediate_size` > 0) runs for every token,
    scaled by a sigmoid gate. Layer i is sparse unless listed in `mlp_only_layers` or (i + 1) is not a
    multiple of `decoder_sparse_step` (transformers' rule); dense layers use ModelConfig.intermediate_size."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"{self.experts_per_token} experts per token of {self.num_experts} experts")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be at least 1, got {self.decoder_sparse_step}")

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only transformer. `architecture` selects the model file: "llama" (Llama 2/3, Mistral,
    Qwen2, Qwen3, and with `moe` Qwen3-MoE and Qwen2-MoE) or "gemma3". Layer types decide which layers
    see only a sliding window of keys. "llama" also runs Ministral, Phi-3, SmolLM3 and Granite; "olmo2" is
    OLMo 2 (post-norm blocks)."""

    architecture: Literal["llama", "gemma3", "olmo2"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Gemma 3 uses a separate RoPE base for its sliding-window layers.
    rope_local_theta: float | None = None
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    layer_types: tuple[LayerType, ...] = field(default=())
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3 and Gemma 3: RMSNorm over each head of q and k
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    # Gemma scales attention scores by query_pre_attn_scalar**-0.5 instead of head_dim**-0.5.
    query_pre_attn_scalar: float | None = None
    # Phi-3 / Phi-4-mini rotate only the first rotary_dim dims of each head (None: all of them).
    rotary_dim: int | None = None
    # SmolLM3: layers that apply no position embedding at all (NoPE).
    nope_layers: tuple[int, ...] = field(default=())
    # Granite: embeddings times embedding_multiplier, each sublayer's output times residual_multiplier
    # before its residual add, scores scaled by attention_multiplier (not head_dim**-0.5), logits divided
    # by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Phi-3 checkpoints store q/k/v as one qkv_proj and gate/up as one gate_up_proj (Kiln's own layout).
    fused_checkpoint: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    moe: MoEConfig | None = None  # sparse expert feed-forwards (Qwen3-MoE, Qwen2-MoE); None: dense

    def __post_init__(self) -> None:
        object.__setattr__(self, "nope_layers", tuple(self.nope_layers))  # a list when read back from JSON
        if not self.layer_types:
            kind: LayerType = "sliding_attention" if self.sliding_window else "full_attention"
            object.__setattr__(self, "layer_types", (kind,) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")

    def window_of(self, layer: int) -> int | None:
        """Number of most recent keys (the query's own included) a layer may attend to; None = all."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def attention_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def fingerprint_fields(self) -> dict:
        """Fields that change what K/V a token produces; hashed into the model fingerprint."""
        from dataclasses import asdict

        return asdict(self)
