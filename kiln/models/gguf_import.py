"""GGUF -> Kiln: a llama.cpp model file as a ModelConfig, its tokenizer, and its tensors under Hugging Face
names: a table of where each lies (GGUFTensors, kept in the weight cache) and a TensorSource that reads
one as fp32 when asked (dequantised and restored), the token embeddings also row by row.

llama.cpp's converter changes some weights on the way in; each change is undone here so the tensors are
what the transformers checkpoint held:

- Gemma norm weights are stored as 1 + w (HF Gemma's RMSNorm scales by 1 + w): 1 is subtracted.
- Llama q/k projection rows are permuted into llama.cpp's RoPE layout: they are permuted back (in llama,
  smollm3 and granite files; qwen2, qwen3, gemma3, phi3 and olmo2 files are not permuted).
- A mixture of experts' experts are stacked into one tensor per projection (blk.N.ffn_gate_exps): each
  expert is its own tensor again, a byte range of the stack.
- Llama 3 RoPE scaling is stored as one divisor per frequency (rope_freqs): it is fitted back to
  transformers' llama3 parameters.
- Gemma 3 facts llama.cpp hard-codes rather than stores (layer pattern, local RoPE base, attention scale)
  are filled in the way llama.cpp does; so are SmolLM3's NoPE layers (every 4th).

GGUF lists a tensor's shape innermost dimension first; torch order is the reverse.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from kiln.errors import InvalidArgumentError
from kiln.models.config import LayerType, ModelConfig, MoEConfig, RopeScaling
from kiln.models.file_embedding import StoredRows
from kiln.models.hf_config import GEMMA3_LOCAL_ROPE_THETA
from kiln.models.tensor_source import FileBlocks, StoredTensor, TensorSource
from kiln.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = (
    "gemma3", "granite", "llama", "olmo2", "phi3", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "smollm3"
)

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router (kiln/models/moe.py)
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# A layer's experts stacked into one [experts, rows, cols] tensor per projection.
_EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_SHARED_EXPERT_GATE = "ffn_gate_inp_shexp"  # a vector in GGUF, a [1, hidden] matrix in HF
_LLAMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "post_attention_layernorm"}
# Gemma puts a norm on both sides of attention and of the MLP.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# OLMo 2 norms sublayer outputs only; Phi-3 stores q/k/v and gate/up fused, as Kiln's modules hold them.
_OLMO2_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER_NAMES = {
    **_LLAMA_LAYER_NAMES,
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
_LAYER_NAMES_BY_ARCH = {"gemma3": _GEMMA3_LAYER_NAMES, "olmo2": _OLMO2_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES}
# Architectures whose converter permutes q/k rows for llama.cpp's interleaved RoPE (LLAMA_ROPE_TYPE_NORM).
_ROPE_PERMUTED = ("granite", "llama", "smollm3")
# The weight types llama.cpp writes for dense models (its converter's and llama-quantize's usual outputs),
# decoded by gguf-py to what ggml's own dequantisation gives (tests/models/test_gguf_weight_types.py).
# Others (the 1-3-bit IQ and TQ types, MXFP4, ...) are refused by name.
WEIGHT_TYPES = tuple(
    gguf.GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                 "Q6_K", "IQ4_NL", "IQ4_XS")
)
_EMBEDDINGS = "model.embed_tokens.weight"  # stored as the checkpoint held it: readable row by row
_ROPE_FREQS = "rope_freqs.weight"  # folded into ModelConfig.rope_scaling, not a model tensor
_LONGROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's, folded likewise

# llama.cpp: every 6th Gemma 3 layer is global; the 27B model (62 layers) scales scores by hidden / heads.
_GEMMA3_GLOBAL_EVERY = 6
_SMOLLM3_NOPE_EVERY = 4  # llama.cpp: n_no_rope_layer_step
_GEMMA3_27B_LAYERS = 62
_LLAMA3_DEFAULT_ORIGINAL_CONTEXT = 8192
_LLAMA3_DEFAULT_BAND = (1.0, 4.0)  # low/high frequency factors of every Llama 3.x release
# Released factors are short decimals (8, 32, 1, 4); float32 divisors carry noise below this many digits.
_LLAMA3_DIGITS = 3


def read_gguf(path: Path) -> tuple[ModelConfig, GGUFTensors, Tokenizer]:
    """Config, where each tensor lies (under HF names) and tokenizer of a GGUF file; `gguf_tensor_source`
    reads the tensors. Raises InvalidArgumentError for files that are not GGUF, are truncated or
    damaged, describe an unsupported architecture or hold a tensor of a type not in WEIGHT_TYPES."""
    reader = _open(path)
    metadata = _metadata(reader)
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise InvalidArgumentError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    for tensor in reader.tensors:
        _weight_type(int(tensor.tensor_type), tensor.name)
    tokenizer = Tokenizer.from_gguf(metadata)
    by_name = {tensor.name: tensor for tensor in reader.tensors}
    config = _config(metadata, arch, by_name, tokenizer)
    return config, _tensor_table(reader.tensors, arch), tokenizer


@dataclass(frozen=True)
class GGUFTensor:
    """Where one tensor lies in a GGUF file: `n_bytes` bytes from `offset`, in GGML type `ggml_type`,
    of torch shape `shape`."""

    offset: int
    n_bytes: int
    ggml_type: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class GGUFTensors:
    """A GGUF file's tensors by HF name, and the llama.cpp architecture whose converter changes to undo
    (see the module docstring). Plain data: the weight cache keeps it, so a later start reads tensors
    without parsing the file's metadata again (seconds and hundreds of megabytes on a 262k vocabulary)."""

    architecture: str
    tensors: dict[str, GGUFTensor]

    def to_json(self) -> dict[str, Any]:
        return {"architecture": self.architecture, "tensors": {name: asdict(t) for name, t in self.tensors.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GGUFTensors:
        tensors = {name: GGUFTensor(**{**t, "shape": tuple(t["shape"])}) for name, t in data["tensors"].items()}
        return cls(data["architecture"], tensors)


def gguf_tensor_source(path: Path, table: GGUFTensors, config: ModelConfig) -> TensorSource:
    """The tensors of GGUF file `path` (whose table is `table`) as float32 under HF names, each
    dequantised and restored when read. Matrices llama.cpp stores unchanged (the token embeddings) can
    also be read row by row."""
    stored = {}
    for name, tensor in table.tensors.items():
        read = partial(_read_tensor, path, name, tensor, table.architecture, config)
        rows = None
        if name == _EMBEDDINGS and len(tensor.shape) == 2:
            decode = partial(_dequantize_rows, ggml_type=tensor.ggml_type)
            rows = StoredRows(path, tensor.offset, tensor.shape[0], tensor.shape[1], tensor.n_bytes // tensor.shape[0], decode)
        blocks = None
        if len(tensor.shape) == 2:
            order = _stored_row_order(name, tensor.shape[0], table.architecture, config)
            blocks = FileBlocks(path, tensor.offset, tensor.shape[0], tensor.ggml_type, order)
        stored[name] = StoredTensor(tensor.shape, read, rows, blocks)
    return TensorSource(stored)


def read_metadata(path: Path) -> dict[str, Any]:
    """A GGUF file's key/value metadata as plain Python values (what Tokenizer.from_gguf takes)."""
    return _metadata(_open(path))


def _metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {key: field.contents() for key, field in reader.fields.items()}


def _open(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    # The reader raises assorted errors (ValueError, IndexError, ...) for bad bytes.
    except Exception as error:
        raise InvalidArgumentError(
            f"{path} is not a readable GGUF file (truncated or corrupt?): {error}"
        ) from error


def _config(
    metadata: Mapping[str, Any], arch: str, tensors: Mapping[str, gguf.ReaderTensor], tokenizer: Tokenizer
) -> ModelConfig:
    """ModelConfig from `<arch>.*` metadata; what GGUF does not store comes from the tensors present."""
    value = _metadata_reader(metadata, arch)
    hidden, heads, layers = value("embedding_length"), value("attention.head_count"), value("block_count")
    head_dim = value("attention.key_length", hidden // heads)
    theta = _f32(value("rope.freq_base", 10000.0))
    gemma = arch == "gemma3"
    if "token_embd.weight" not in tensors:
        raise InvalidArgumentError(f"GGUF file has no token_embd.weight tensor ({arch})")
    return ModelConfig(
        architecture="gemma3" if gemma else "olmo2" if arch == "olmo2" else "llama",
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=value("feed_forward_length"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=value("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=_f32(value("attention.layer_norm_rms_epsilon")),
        rope_theta=theta,
        rope_scaling=_longrope_scaling(value, tensors) or _rope_scaling(value, tensors.get(_ROPE_FREQS), head_dim, theta),
        rope_local_theta=_f32(value("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA)) if gemma else None,
        max_position_embeddings=value("context_length"),
        sliding_window=value("attention.sliding_window") if gemma else None,
        layer_types=_swa_layer_types(metadata, arch, layers, _GEMMA3_GLOBAL_EVERY) if gemma else (),
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors and arch != "olmo2",  # OLMo 2's norm whole projections
        tie_word_embeddings="output.weight" not in tensors,
        hidden_act="gelu_pytorch_tanh" if gemma else "silu",
        query_pre_attn_scalar=_gemma3_query_scale(layers, hidden, heads, head_dim) if gemma else None,
        **_family_fields(value, arch, layers, head_dim, tensors),
        moe=_moe(value, arch, layers, tensors) if arch in ("qwen2moe", "qwen3moe") else None,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=metadata.get("general.name", ""),
    )


_MISSING = object()


def _metadata_reader(metadata: Mapping[str, Any], arch: str) -> Callable[..., Any]:
    """`value(key, default)` for `<arch>.<key>`; without a default a missing key is an error."""

    def value(key: str, default: Any = _MISSING) -> Any:
        found = metadata.get(f"{arch}.{key}", default)
        if found is _MISSING:
            raise InvalidArgumentError(f"GGUF metadata lacks {arch}.{key}")
        if isinstance(found, list):
            raise InvalidArgumentError(
                f"GGUF metadata {arch}.{key} varies per layer, which Kiln does not support"
            )
        return found

    return value


def _f32(value: float) -> float:
    """GGUF stores floats as float32; read 1e-6, not 9.99999997e-07, as the source config said."""
    return float(str(np.float32(value)))


def _swa_layer_types(metadata: Mapping[str, Any], arch: str, layers: int, every: int) -> tuple[LayerType, ...]:
    """llama.cpp's load_swa_pattern: `<arch>.attention.sliding_window_pattern` is one flag per layer (true:
    sliding) or a period n (every n-th layer global; 0: none), else the architecture's period `every`."""
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", every)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise InvalidArgumentError(f"GGUF sliding_window_pattern has {len(pattern)} flags for {layers} layers")
        sliding = [bool(flag) for flag in pattern]
    else:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    return tuple("sliding_attention" if flag else "full_attention" for flag in sliding)


def _family_fields(
    value: Callable[..., Any], arch: str, layers: int, head_dim: int, tensors: Mapping[str, gguf.ReaderTensor]
) -> dict[str, Any]:
    """ModelConfig fields of Phi-3 (fused tensors, partial rotary), SmolLM3 (NoPE layers), Granite
    (multipliers; llama.cpp reads a missing or zero scale as none) and OLMo 2, as llama.cpp computes them."""
    rotary_dim = value("rope.dimension_count", head_dim)
    if rotary_dim != head_dim and arch != "phi3":
        raise InvalidArgumentError(f"GGUF {arch} rotates {rotary_dim} of {head_dim} dims per head, which Kiln does not support")
    if arch == "olmo2" and value("attention.sliding_window", 0):
        raise InvalidArgumentError("GGUF olmo2 with a sliding window (OLMo 3) is not supported")
    if arch == "phi3":
        return {"fused_checkpoint": True, "rotary_dim": rotary_dim if rotary_dim != head_dim else None}
    if arch == "smollm3":
        return {"nope_layers": tuple(i for i in range(layers) if (i + 1) % _SMOLLM3_NOPE_EVERY == 0)}
    if arch == "granite":
        return {
            "embedding_multiplier": _f32(value("embedding_scale", 0.0) or 1.0),
            "residual_multiplier": _f32(value("residual_scale", 0.0) or 1.0),
            "attention_multiplier": _f32(value("attention.scale", 0.0)) or None,
            "logits_scaling": _f32(value("logit_scale")),
        }
    return {}


def _moe(
    value: Callable[..., Any], arch: str, layers: int, tensors: Mapping[str, gguf.ReaderTensor]
) -> MoEConfig:
    """The experts of a qwen3moe / qwen2moe file as llama.cpp reads them: a layer is sparse where it has a
    router (ffn_gate_inp); qwen3moe renormalises the top-k weights and qwen2moe does not (llama.cpp
    hard-codes both, as transformers' configs of those models set them); widths missing from the
    metadata default as llama.cpp's do."""
    sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    dense_width, used = value("feed_forward_length"), value("expert_used_count")
    shared = any(f"blk.{i}.ffn_up_shexp.weight" in tensors for i in sparse)
    try:
        return MoEConfig(
            num_experts=value("expert_count"),
            experts_per_token=used,
            expert_intermediate_size=value("expert_feed_forward_length", dense_width // max(used, 1)),
            norm_topk_prob=arch == "qwen3moe",
            shared_expert_intermediate_size=value("expert_shared_feed_forward_length", dense_width) if shared else 0,
            mlp_only_layers=tuple(i for i in range(layers) if i not in sparse),
        )
    except ValueError as error:
        raise InvalidArgumentError(f"GGUF {arch} experts: {error}") from error


def _moe_entries(name: str, entry: GGUFTensor) -> dict[str, GGUFTensor]:
    """A mixture of experts' tensors llama.cpp stores otherwise than the HF checkpoint, under HF names; {}
    for any other tensor. A stack of experts (blk.N.ffn_gate_exps, experts outermost) becomes one entry
    per expert, each its byte range of the stack, so an expert is read (and dequantised) alone."""
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return {}
    _, layer, kind, suffix = parts
    prefix = f"model.layers.{layer}.mlp"
    if kind == _SHARED_EXPERT_GATE:
        return {f"{prefix}.shared_expert_gate.{suffix}": replace(entry, shape=(1, entry.shape[-1]))}
    if kind not in _EXPERT_STACKS or len(entry.shape) != 3:
        return {}
    experts, projection = entry.shape[0], _EXPERT_STACKS[kind]
    size = entry.n_bytes // experts
    return {
        f"{prefix}.experts.{expert}.{projection}.{suffix}": GGUFTensor(
            entry.offset + expert * size, size, entry.ggml_type, entry.shape[1:]
        )
        for expert in range(experts)
    }


def _gemma3_query_scale(layers: int, hidden: int, heads: int, head_dim: int) -> float:
    return float(hidden // heads if layers == _GEMMA3_27B_LAYERS else head_dim)


def _longrope_scaling(value: Callable[..., Any], tensors: Mapping[str, gguf.ReaderTensor]) -> RopeScaling | None:
    """Phi-3's LongRoPE: per-frequency divisors for long and short contexts, and the factor llama.cpp
    multiplies cos and sin by; llama.cpp picks the long ones when its context exceeds the original one."""
    long, short = (tensors.get(name) for name in _LONGROPE_FACTORS)
    if long is None and short is None:
        return None
    if long is None or short is None:
        raise InvalidArgumentError("GGUF has only one of rope_factors_long and rope_factors_short")
    original = value("rope.scaling.original_context_length")
    return RopeScaling(
        "longrope",
        value("context_length") / original,
        original_max_position_embeddings=original,
        long_factor=tuple(map(_f32, _dequantize(long))),
        short_factor=tuple(map(_f32, _dequantize(short))),
        attention_factor=_f32(value("rope.scaling.attn_factor", 1.0)),
    )


def _rope_scaling(
    value: Callable[..., Any], rope_freqs: gguf.ReaderTensor | None, head_dim: int, theta: float
) -> RopeScaling | None:
    if rope_freqs is not None:
        original = value("rope.scaling.original_context_length", _LLAMA3_DEFAULT_ORIGINAL_CONTEXT)
        return _llama3_scaling(_dequantize(rope_freqs).astype(np.float64), head_dim, theta, original)
    kind = value("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling("linear", _f32(value("rope.scaling.factor")))
    raise InvalidArgumentError(f"unsupported GGUF RoPE scaling {kind!r}; supported: none, linear, llama3")


def _llama3_scaling(divisors: np.ndarray, head_dim: int, theta: float, original: int) -> RopeScaling | None:
    """transformers' llama3 parameters that reproduce llama.cpp's per-frequency divisors. Between the
    two wavelength thresholds the unscaled share of a frequency is linear in original / wavelength, so
    a line through those points gives the low and high frequency factors."""
    if np.allclose(divisors, 1.0):
        return None
    factor = round(float(divisors.max()), _LLAMA3_DIGITS)
    ratio = original / (2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim))
    unscaled = (1 / divisors - 1 / factor) / (1 - 1 / factor)
    band = (unscaled > 1e-6) & (unscaled < 1 - 1e-6)
    low, high = _LLAMA3_DEFAULT_BAND
    if band.sum() >= 2:
        slope, intercept = np.polyfit(ratio[band], unscaled[band], 1)
        low, high = round(-intercept / slope, _LLAMA3_DIGITS), round((1 - intercept) / slope, _LLAMA3_DIGITS)
    scaling = RopeScaling("llama3", factor, low, high, original)
    share = np.clip((ratio - low) / (high - low), 0.0, 1.0)
    if not np.allclose(1 / ((1 - share) / factor + share), divisors, rtol=1e-4):
        raise InvalidArgumentError("GGUF rope_freqs does not follow Llama 3 RoPE scaling; cannot load it")
    return scaling


def _tensor_table(tensors: Sequence[gguf.ReaderTensor], arch: str) -> GGUFTensors:
    layer_names = _LAYER_NAMES_BY_ARCH.get(arch, _LLAMA_LAYER_NAMES)
    table = {}
    for tensor in tensors:
        if tensor.name in (_ROPE_FREQS, *_LONGROPE_FACTORS):
            continue
        shape = tuple(reversed(tensor.shape.tolist()))
        entry = GGUFTensor(int(tensor.data_offset), int(tensor.n_bytes), int(tensor.tensor_type), shape)
        table |= _moe_entries(tensor.name, entry) or {_hf_name(tensor.name, layer_names): entry}
    return GGUFTensors(arch, table)


def _read_tensor(path: Path, name: str, tensor: GGUFTensor, arch: str, config: ModelConfig) -> torch.Tensor:
    with path.open("rb") as file:
        file.seek(tensor.offset)
        raw = np.frombuffer(file.read(tensor.n_bytes), dtype=np.uint8)
    if raw.size != tensor.n_bytes:
        raise InvalidArgumentError(f"{path} is truncated: tensor {name} lies beyond its end")
    rows = math.prod(tensor.shape[:-1])
    values = _dequantize_rows(raw.reshape(rows, -1), tensor.ggml_type, name).reshape(tensor.shape)
    return torch.from_numpy(np.array(_restore(name, values, arch, config), np.float32))


def _hf_name(name: str, layer_names: Mapping[str, str]) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; `output.weight` -> `lm_head.weight`."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise InvalidArgumentError(f"unexpected GGUF tensor {name!r} for this architecture")


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """float32 values in torch order."""
    values = _dequantize_rows(tensor.data, int(tensor.tensor_type), tensor.name)
    return values.reshape(tuple(reversed(tensor.shape.tolist())))


def _dequantize_rows(raw: np.ndarray, ggml_type: int, name: str = "") -> np.ndarray:
    """float32 rows of GGML type `ggml_type` stored in `raw` ([rows, bytes per row]): each row decodes on
    its own, so a few rows decode to what the whole tensor would hold there."""
    return gguf.quants.dequantize(raw, _weight_type(ggml_type, name))


def _weight_type(ggml_type: int, name: str) -> gguf.GGMLQuantizationType:
    """The GGML type of tensor `name`, when it is one of WEIGHT_TYPES; InvalidArgumentError naming it if not."""
    qtype = gguf.GGMLQuantizationType(ggml_type)  # GGUFReader refused a file of a type gguf-py does not know
    if qtype not in WEIGHT_TYPES:
        raise InvalidArgumentError(
            f"GGUF tensor {name} has weight type {qtype.name}, which Kiln does not read; "
            f"supported: {', '.join(t.name for t in WEIGHT_TYPES)}"
        )
    return qtype


def _restore(name: str, weight: np.ndarray, arch: str, config: ModelConfig) -> np.ndarray:
    """Undo llama.cpp's converter for one tensor (see the module docstring)."""
    if arch == "gemma3" and name.endswith("norm.weight"):
        return weight - np.float32(1.0)
    if arch in _ROPE_PERMUTED and ".q_proj." in name:
        return _unpermute_rope(weight, config.num_heads)
    if arch in _ROPE_PERMUTED and ".k_proj." in name:
        return _unpermute_rope(weight, config.num_kv_heads)
    return weight


def _stored_row_order(name: str, rows: int, arch: str, config: ModelConfig) -> tuple[int, ...] | None:
    """For each checkpoint row of matrix `name`, the stored row holding it (None: stored in order)."""
    if arch not in _ROPE_PERMUTED or not (".q_proj." in name or ".k_proj." in name):
        return None
    heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
    return tuple(_unpermute_rope(np.arange(rows).reshape(rows, 1), heads).ravel().tolist())


def _unpermute_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`, which interleaved the two rotary halves of each head's rows."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )
