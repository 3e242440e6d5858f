"""ModelConfig: the architecture facts a model definition and the KV cache need, whatever the source format."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

LayerType = Literal["full_attention", "sliding_attention"]


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "linear" (positions divided by factor) or "llama3" (band-wise)."""

    kind: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only transformer. `architecture` selects the model file: "llama" (Llama 2/3, Mistral,
    Qwen2, Qwen3) or "gemma3". Layer types decide which layers see only a sliding window of keys."""

    architecture: Literal["llama", "gemma3"]
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
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
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
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def fingerprint_fields(self) -> dict:
        """Fields that change what K/V a token produces; hashed into the model fingerprint."""
        from dataclasses import asdict

        return asdict(self)
