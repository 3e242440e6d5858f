"""Hugging Face config.json <-> ModelConfig.

Reads both transformers-4 keys (rope_theta, rope_scaling, rope_local_base_freq, sliding_window_pattern,
use_sliding_window/max_window_layers) and transformers-5 keys (rope_parameters, per layer type for Gemma 3;
layer_types). A key missing from config.json takes the default of the matching transformers config class,
because that is what the checkpoint was trained and evaluated with. Pure: no transformers import.
"""

from __future__ import annotations

import math
from typing import Any

from kiln.errors import InvalidArgumentError
from kiln.models.config import LayerType, ModelConfig, MoEConfig, RopeScaling

# Gemma3TextConfig's default RoPE base of sliding-window layers (rope_local_base_freq).
GEMMA3_LOCAL_ROPE_THETA = 10000.0

_COMMON_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": None,
    "head_dim": None,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "rope_theta": 10000.0,
}

# Class defaults of transformers' LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Gemma3TextConfig.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "mistral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": 4096,
    },
    "qwen2": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "gemma3_text": {
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
    },
}
_DEFAULTS["qwen3"] = {**_DEFAULTS["qwen2"], "head_dim": 128}
# MinistralConfig, Phi3Config, SmolLM3Config, Olmo2Config, GraniteConfig.
_DEFAULTS |= {
    "ministral": {**_DEFAULTS["mistral"], "layer_types": None},
    "phi3": {
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 32000,
        "sliding_window": None,
        "partial_rotary_factor": 1.0,
        "original_max_position_embeddings": 4096,
    },
    "smollm3": {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "tie_word_embeddings": True,
        "rope_theta": 2_000_000.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "no_rope_layers": None,
        "no_rope_layer_interval": 4,
    },
    "olmo2": {
        "vocab_size": 50304,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "bos_token_id": None,
        "eos_token_id": 50279,
    },
    "granite": {
        **_DEFAULTS["llama"],
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "attention_multiplier": 1.0,
        "logits_scaling": 1.0,
    },
}
# Qwen2MoeConfig and Qwen3MoeConfig: the mixture-of-experts keys (MoEConfig) beside their dense twins'.
_MOE_DEFAULTS: dict[str, Any] = {
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,
    "mlp_only_layers": None,
}
_DEFAULTS["qwen2_moe"] = {
    **_DEFAULTS["qwen2"],
    **_MOE_DEFAULTS,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4,
    "num_experts": 60,
    "qkv_bias": True,
}
_DEFAULTS["qwen3_moe"] = {
    **_DEFAULTS["qwen2"],
    **_MOE_DEFAULTS,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "num_experts": 128,
}
_MOE_TYPES = ("qwen2_moe", "qwen3_moe")

_FULL: LayerType = "full_attention"
_SLIDING: LayerType = "sliding_attention"


def config_from_hf(cfg: dict) -> ModelConfig:
    """Map a config.json dict (model_type llama, mistral, ministral, qwen2, qwen3, phi3, smollm3, olmo2,
    granite, gemma3_text, or multimodal gemma3, whose `text_config` is used) to a ModelConfig. Raises InvalidArgumentError for anything Kiln's model
    definitions would compute differently from transformers."""
    model_type, c = _resolve(cfg)
    heads = c["num_attention_heads"]
    sliding_window, layer_types = _layers(model_type, c)
    theta, scaling, local_theta = _rope(model_type, c)
    eos = c["eos_token_id"]
    is_gemma = model_type == "gemma3_text"
    head_dim = c["head_dim"] or c["hidden_size"] // heads
    try:
        return ModelConfig(
            architecture="gemma3" if is_gemma else "olmo2" if model_type == "olmo2" else "llama",
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c["num_key_value_heads"] or heads,
            head_dim=head_dim,
            rms_norm_eps=float(c["rms_norm_eps"]),
            rope_theta=theta,
            rope_scaling=scaling,
            rope_local_theta=local_theta,
            max_position_embeddings=c["max_position_embeddings"],
            sliding_window=sliding_window,
            layer_types=layer_types,
            attention_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(c["qkv_bias"])),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            tie_word_embeddings=bool(c["tie_word_embeddings"]),
            hidden_act=c["hidden_activation"] if is_gemma else c["hidden_act"],
            query_pre_attn_scalar=float(c["query_pre_attn_scalar"]) if is_gemma else None,
            rotary_dim=_rotary_dim(model_type, c, head_dim),
            nope_layers=_nope_layers(model_type, c),
            fused_checkpoint=model_type == "phi3",
            **_granite_multipliers(model_type, c),
            bos_token_id=c["bos_token_id"],
            eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
            name=c.get("_name_or_path") or "",
            moe=_moe(c) if model_type in _MOE_TYPES else None,
        )
    except ValueError as error:
        raise InvalidArgumentError(f"inconsistent {model_type} config: {error}") from error


def _rotary_dim(model_type: str, c: dict[str, Any], head_dim: int) -> int | None:
    """Phi-3's partial rotary (Phi-4-mini turns 3/4 of each head); None: whole heads."""
    factor = (c.get("rope_parameters") or {}).get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if model_type != "phi3" or factor == 1.0:
        return None
    return int(head_dim * factor)


def _nope_layers(model_type: str, c: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: no_rope_layers[i] == 0, else every no_rope_layer_interval-th."""
    if model_type != "smollm3":
        return ()
    return tuple(i for i, uses_rope in enumerate(_smollm3_rope_layers(c)) if not uses_rope)


def _smollm3_rope_layers(c: dict[str, Any]) -> list[int]:
    interval = c["no_rope_layer_interval"]
    return c["no_rope_layers"] or [int((i + 1) % interval != 0) for i in range(c["num_hidden_layers"])]


def _granite_multipliers(model_type: str, c: dict[str, Any]) -> dict[str, float]:
    return {key: float(c[key]) for key in _GRANITE_MULTIPLIERS} if model_type == "granite" else {}


def _resolve(cfg: dict) -> tuple[str, dict[str, Any]]:
    """The text model's type and its keys merged over the transformers class defaults."""
    model_type = cfg.get("model_type")
    if model_type == "gemma3":
        text = dict(cfg.get("text_config") or {})
        for key in ("bos_token_id", "eos_token_id", "_name_or_path"):
            if cfg.get(key) is not None:
                text[key] = cfg[key]
        cfg, model_type = text, "gemma3_text"
    if model_type not in _DEFAULTS:
        raise InvalidArgumentError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted([*_DEFAULTS, 'gemma3']))}"
        )
    c = {**_COMMON_DEFAULTS, **_DEFAULTS[model_type], **cfg}
    unsupported = {
        "mlp_bias": c["mlp_bias"],
        "final_logit_softcapping": c.get("final_logit_softcapping"),
        "attn_logit_softcapping": c.get("attn_logit_softcapping"),
        "use_bidirectional_attention": c.get("use_bidirectional_attention"),
        # Outside Qwen2 (q/k/v bias only) this flag also puts a bias on o_proj, which Kiln does not have.
        "attention_bias": model_type not in ("qwen2", "qwen2_moe") and c["attention_bias"],
    }
    for key, value in unsupported.items():
        if value:
            raise InvalidArgumentError(
                f"{model_type} config sets {key}={value!r}, which Kiln does not support"
            )
    return model_type, c


def _layers(model_type: str, c: dict[str, Any]) -> tuple[int | None, tuple[LayerType, ...]]:
    """(sliding_window, layer_types) as transformers' attention masks apply them."""
    n = c["num_hidden_layers"]
    window = c.get("sliding_window")
    if model_type == "llama":
        return None, (_FULL,) * n
    if model_type in ("mistral", "phi3"):  # these ignore layer_types: a window applies to every layer
        if window and window >= c["max_position_embeddings"]:  # Phi-4-mini's 262144 of 131072: none in effect
            window = None
        return window, ((_SLIDING if window else _FULL),) * n
    if model_type in ("granite", "olmo2"):
        return None, (_FULL,) * n
    if model_type == "ministral":
        return _windowed(window, c.get("layer_types") or [_SLIDING if window else _FULL] * n)
    if model_type == "smollm3":
        windowed = c["use_sliding_window"] and window
        return _windowed(window, c.get("layer_types") or [
            _SLIDING if windowed and not uses_rope else _FULL for uses_rope in _smollm3_rope_layers(c)
        ])
    if model_type == "qwen3_moe":  # one window for every layer when use_sliding_window is set
        window = window if c["use_sliding_window"] else None
        return window, ((_SLIDING if window else _FULL),) * n
    elif model_type == "gemma3_text":
        types = c.get("layer_types") or [
            _FULL if (i + 1) % c["sliding_window_pattern"] == 0 else _SLIDING for i in range(n)
        ]
    elif not (c["use_sliding_window"] and window):
        return None, (_FULL,) * n
    else:
        types = c.get("layer_types") or [_SLIDING if i >= c["max_window_layers"] else _FULL for i in range(n)]
    return _windowed(window, types)


def _windowed(window: int | None, types: list[str]) -> tuple[int | None, tuple[LayerType, ...]]:
    """(window, types) once every type is known; no window where no layer slides."""
    unknown = set(types) - {_FULL, _SLIDING}
    if unknown:
        raise InvalidArgumentError(f"unsupported layer type {', '.join(map(repr, sorted(unknown)))}")
    return (window if _SLIDING in types else None), tuple(types)  # type: ignore[return-value]


def _moe(c: dict[str, Any]) -> MoEConfig:
    """The experts of a Qwen2-MoE / Qwen3-MoE config (Qwen3MoeConfig has no shared expert). transformers 5
    serialises num_experts as num_local_experts."""
    return MoEConfig(
        num_experts=c.get("num_local_experts", c["num_experts"]),
        experts_per_token=c["num_experts_per_tok"],
        expert_intermediate_size=c["moe_intermediate_size"],
        norm_topk_prob=bool(c["norm_topk_prob"]),
        shared_expert_intermediate_size=c.get("shared_expert_intermediate_size", 0),
        decoder_sparse_step=c["decoder_sparse_step"],
        mlp_only_layers=tuple(c["mlp_only_layers"] or ()),
    )


def _rope(model_type: str, c: dict[str, Any]) -> tuple[float, RopeScaling | None, float | None]:
    """(theta, scaling of full-attention layers, Gemma's sliding-layer theta or None)."""
    params = c.get("rope_parameters") or {}
    legacy = {**(c.get("rope_scaling") or {}), "rope_theta": c["rope_theta"]}
    if model_type != "gemma3_text":
        full, local = params or legacy, None
    else:
        full = params.get(_FULL) or legacy
        local = params.get(_SLIDING) or {"rope_theta": c["rope_local_base_freq"]}
        if _scaling(local, c) is not None:
            raise InvalidArgumentError("gemma3 RoPE scaling on sliding-window layers is not supported")
    theta = float(full.get("rope_theta", c["rope_theta"]))
    local_theta = None if local is None else float(local.get("rope_theta", c["rope_local_base_freq"]))
    return theta, _scaling(full, c), local_theta


def _scaling(params: dict[str, Any], c: dict[str, Any]) -> RopeScaling | None:
    """RopeScaling from one rope_parameters / rope_scaling dict (transformers-4 named the kind "type")."""
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0 and c.get("model_type") != "phi3":  # Phi-3: rotary_dim
        raise InvalidArgumentError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    try:
        if kind == "default":
            return None
        if kind == "linear":
            return RopeScaling("linear", float(params["factor"]))
        if kind == "llama3":
            return RopeScaling(
                "llama3",
                float(params["factor"]),
                float(params["low_freq_factor"]),
                float(params["high_freq_factor"]),
                # transformers falls back to max_position_embeddings, as here.
                int(params.get("original_max_position_embeddings", c["max_position_embeddings"])),
            )
        if kind in ("longrope", "su"):  # "su": Phi-3's first name for it
            return _longrope(params, c)
    except KeyError as missing:
        raise InvalidArgumentError(f"{kind} RoPE parameters lack {missing}") from missing
    raise InvalidArgumentError(f"unsupported RoPE type {kind!r}; supported: default, linear, llama3, longrope")


def _longrope(params: dict[str, Any], c: dict[str, Any]) -> RopeScaling:
    """As transformers' _compute_longrope_parameters: the attention factor from `factor` (default: the
    context over the original one), unless given. A config's own original_max_position_embeddings (Phi-3's)
    overrides the RoPE parameters' one, as transformers' standardize_rope_params does."""
    fallback = params.get("original_max_position_embeddings", c["max_position_embeddings"])
    original = int(c.get("original_max_position_embeddings") or fallback)
    context_ratio = c["max_position_embeddings"] / original
    factor = params.get("factor") or context_ratio
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        "longrope",
        context_ratio,
        original_max_position_embeddings=original,
        long_factor=tuple(map(float, params["long_factor"])),
        short_factor=tuple(map(float, params["short_factor"])),
        attention_factor=float(attention),
    )


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """The transformers-5 config.json dict describing `config` (inverse of config_from_hf). The model_type
    is the one transformers family that expresses exactly this architecture; raises InvalidArgumentError
    when none does (e.g. q/k/v bias with q/k norms)."""
    eos = config.eos_token_ids
    d: dict[str, Any] = {
        "model_type": _model_type(config),
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else list(eos),
        "pad_token_id": None,  # Kiln pads with no token; some families' class default lies outside small vocabularies
        "rope_parameters": _rope_dict(config.rope_theta, config.rope_scaling),
    }
    if config.name:
        d["_name_or_path"] = config.name
    return d | _family_keys(d["model_type"], config)


def _family_keys(model_type: str, config: ModelConfig) -> dict[str, Any]:
    """The keys whose names or meaning differ between transformers families."""
    window = {"sliding_window": config.sliding_window, "layer_types": list(config.layer_types)}
    if model_type == "gemma3_text":
        local_theta = config.rope_local_theta or GEMMA3_LOCAL_ROPE_THETA
        rope = {
            _FULL: _rope_dict(config.rope_theta, config.rope_scaling),
            _SLIDING: _rope_dict(local_theta, None),
        }
        return window | {
            "hidden_activation": config.hidden_act,
            "query_pre_attn_scalar": _whole(config.query_pre_attn_scalar or config.head_dim),
            "rope_parameters": rope,
        }
    keys: dict[str, Any] = {"hidden_act": config.hidden_act}
    if model_type in ("mistral", "phi3"):
        keys["sliding_window"] = config.sliding_window
    keys |= _newer_family_keys(model_type, config, window)
    if config.moe is not None:
        keys |= _moe_keys(model_type, config.moe)
    if model_type == "qwen3_moe":
        keys |= {"use_sliding_window": config.sliding_window is not None, "sliding_window": config.sliding_window}
    if model_type in ("qwen2", "qwen3", "qwen2_moe"):
        first_sliding = config.layer_types.index(_SLIDING) if _SLIDING in config.layer_types else 0
        keys |= window | {
            "use_sliding_window": config.sliding_window is not None,
            "max_window_layers": first_sliding,
        }
    return keys


def _moe_keys(model_type: str, moe: MoEConfig) -> dict[str, Any]:
    keys = {
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.experts_per_token,
        "moe_intermediate_size": moe.expert_intermediate_size,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": moe.decoder_sparse_step,
        "mlp_only_layers": list(moe.mlp_only_layers),
    }
    if model_type == "qwen2_moe":
        keys |= {"shared_expert_intermediate_size": moe.shared_expert_intermediate_size, "qkv_bias": True}
    return keys


def _model_type(config: ModelConfig) -> str:
    """The transformers family whose fixed choices (q/k/v bias, q/k norm, window layout) match `config`."""
    found = None
    if config.architecture == "gemma3":
        found = "gemma3_text" if config.qk_norm and not config.attention_bias else None
    elif config.rope_local_theta is not None or config.query_pre_attn_scalar is not None:
        found = None
    elif (newer := _newer_family(config)) is not None:
        found = newer
    elif config.moe is not None:  # Qwen2-MoE: q/k/v bias and a shared expert; Qwen3-MoE: q/k norm, one window
        shared = config.moe.shared_expert_intermediate_size > 0
        if config.attention_bias and not config.qk_norm and shared:
            found = "qwen2_moe"
        elif config.qk_norm and not config.attention_bias and not shared and len(set(config.layer_types)) == 1:
            found = "qwen3_moe"
    elif config.attention_bias != config.qk_norm:
        found = "qwen2" if config.attention_bias else "qwen3"
    elif not config.attention_bias:
        found = {frozenset({_FULL}): "llama", frozenset({_SLIDING}): "mistral", frozenset({_FULL, _SLIDING}): "ministral"}.get(
            frozenset(config.layer_types)
        )
    if found is None:
        raise InvalidArgumentError(f"no transformers model_type describes {config}")
    return found


_GRANITE_MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def _newer_family(config: ModelConfig) -> str | None:
    """OLMo 2, Phi-3, SmolLM3 or Granite: each a plain Llama (no q/k/v bias or head norms) with one
    feature of its own, of which `config` must have exactly one; None when it has none."""
    features = {
        "olmo2": config.architecture == "olmo2",
        "phi3": config.fused_checkpoint,
        "smollm3": bool(config.nope_layers),
        "granite": config.attention_multiplier is not None,
    }
    present = [name for name, has in features.items() if has]
    multiplied = (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling) != (1.0,) * 3
    if not present and config.rotary_dim is None and not multiplied:
        return None
    types = set(config.layer_types)
    windows_fit = {"olmo2": types == {_FULL}, "phi3": len(types) == 1, "smollm3": True, "granite": types == {_FULL}}
    plain = not (config.attention_bias or config.qk_norm or config.moe)
    if len(present) == 1 and plain and windows_fit[present[0]] and (config.rotary_dim is None or present == ["phi3"]):
        return present[0]
    raise InvalidArgumentError(f"no transformers model_type describes {config}")


def _newer_family_keys(model_type: str, config: ModelConfig, window: dict[str, Any]) -> dict[str, Any]:
    if model_type == "ministral":
        return window
    if model_type == "phi3":
        factor = (config.rotary_dim or config.head_dim) / config.head_dim
        keys = {"rope_parameters": _rope_dict(config.rope_theta, config.rope_scaling) | {"partial_rotary_factor": factor}}
        if config.rope_scaling is not None:
            keys["original_max_position_embeddings"] = config.rope_scaling.original_max_position_embeddings
        return keys
    if model_type == "smollm3":
        rope_layers = [int(i not in config.nope_layers) for i in range(config.num_layers)]
        return window | {"no_rope_layers": rope_layers, "use_sliding_window": config.sliding_window is not None}
    if model_type == "granite":
        return {key: getattr(config, key) for key in _GRANITE_MULTIPLIERS}
    return {}


def _whole(value: float) -> int:
    """transformers types query_pre_attn_scalar as int (Gemma 3 checkpoints use whole numbers)."""
    if not float(value).is_integer():
        raise InvalidArgumentError(f"query_pre_attn_scalar {value} is not a whole number")
    return int(value)


def _rope_dict(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    if scaling.kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": scaling.factor}
    if scaling.kind == "longrope":
        return {
            "rope_type": "longrope",
            "rope_theta": theta,
            "factor": scaling.factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
            "long_factor": list(scaling.long_factor),
            "short_factor": list(scaling.short_factor),
            "attention_factor": scaling.attention_factor,
        }
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }
