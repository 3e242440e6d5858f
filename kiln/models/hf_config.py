"""Hugging Face config.json <-> ModelConfig.

Reads both transformers-4 keys (rope_theta, rope_scaling, rope_local_base_freq, sliding_window_pattern,
use_sliding_window/max_window_layers) and transformers-5 keys (rope_parameters, per layer type for Gemma 3;
layer_types). A key missing from config.json takes the default of the matching transformers config class,
because that is what the checkpoint was trained and evaluated with. Pure: no transformers import.
"""

from __future__ import annotations

from typing import Any

from kiln.errors import InvalidArgumentError
from kiln.models.config import LayerType, ModelConfig, RopeScaling

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

_FULL: LayerType = "full_attention"
_SLIDING: LayerType = "sliding_attention"


def config_from_hf(cfg: dict) -> ModelConfig:
    """Map a config.json dict (model_type llama, mistral, qwen2, qwen3, gemma3_text, or multimodal gemma3,
    whose `text_config` is used) to a ModelConfig. Raises InvalidArgumentError for anything Kiln's model
    definitions would compute differently from transformers."""
    model_type, c = _resolve(cfg)
    heads = c["num_attention_heads"]
    sliding_window, layer_types = _layers(model_type, c)
    theta, scaling, local_theta = _rope(model_type, c)
    eos = c["eos_token_id"]
    is_gemma = model_type == "gemma3_text"
    try:
        return ModelConfig(
            architecture="gemma3" if is_gemma else "llama",
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c["num_key_value_heads"] or heads,
            head_dim=c["head_dim"] or c["hidden_size"] // heads,
            rms_norm_eps=float(c["rms_norm_eps"]),
            rope_theta=theta,
            rope_scaling=scaling,
            rope_local_theta=local_theta,
            max_position_embeddings=c["max_position_embeddings"],
            sliding_window=sliding_window,
            layer_types=layer_types,
            attention_bias=model_type == "qwen2",
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            tie_word_embeddings=bool(c["tie_word_embeddings"]),
            hidden_act=c["hidden_activation"] if is_gemma else c["hidden_act"],
            query_pre_attn_scalar=float(c["query_pre_attn_scalar"]) if is_gemma else None,
            bos_token_id=c["bos_token_id"],
            eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
            name=c.get("_name_or_path") or "",
        )
    except ValueError as error:
        raise InvalidArgumentError(f"inconsistent {model_type} config: {error}") from error


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
        "attention_bias": model_type != "qwen2" and c["attention_bias"],
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
    if model_type == "mistral":  # MistralConfig ignores layer_types: a window applies to every layer
        return window, ((_SLIDING if window else _FULL),) * n
    if model_type == "gemma3_text":
        types = c.get("layer_types") or [
            _FULL if (i + 1) % c["sliding_window_pattern"] == 0 else _SLIDING for i in range(n)
        ]
    elif not (c["use_sliding_window"] and window):
        return None, (_FULL,) * n
    else:
        types = c.get("layer_types") or [_SLIDING if i >= c["max_window_layers"] else _FULL for i in range(n)]
    unknown = set(types) - {_FULL, _SLIDING}
    if unknown:
        raise InvalidArgumentError(f"unsupported layer type {', '.join(map(repr, sorted(unknown)))}")
    return window, tuple(types)


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
    if params.get("partial_rotary_factor", 1.0) != 1.0:
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
    except KeyError as missing:
        raise InvalidArgumentError(f"{kind} RoPE parameters lack {missing}") from missing
    raise InvalidArgumentError(f"unsupported RoPE type {kind!r}; supported: default, linear, llama3")


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """The transformers-5 config.json dict describing `config` (inverse of config_from_hf). The model_type
    is the one transformers family that expresses exactly this architecture; raises InvalidArgumentError
    when none does (e.g. a bias-free llama with mixed sliding and full layers)."""
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
    if model_type == "mistral":
        keys["sliding_window"] = config.sliding_window
    if model_type in ("qwen2", "qwen3"):
        first_sliding = config.layer_types.index(_SLIDING) if _SLIDING in config.layer_types else 0
        keys |= window | {
            "use_sliding_window": config.sliding_window is not None,
            "max_window_layers": first_sliding,
        }
    return keys


def _model_type(config: ModelConfig) -> str:
    """The transformers family whose fixed choices (q/k/v bias, q/k norm, window layout) match `config`."""
    found = None
    if config.architecture == "gemma3":
        found = "gemma3_text" if config.qk_norm and not config.attention_bias else None
    elif config.rope_local_theta is not None or config.query_pre_attn_scalar is not None:
        found = None
    elif config.attention_bias != config.qk_norm:
        found = "qwen2" if config.attention_bias else "qwen3"
    elif not config.attention_bias:
        found = {frozenset({_FULL}): "llama", frozenset({_SLIDING}): "mistral"}.get(
            frozenset(config.layer_types)
        )
    if found is None:
        raise InvalidArgumentError(f"no transformers model_type describes {config}")
    return found


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
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }
