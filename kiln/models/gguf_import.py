"""GGUF -> Kiln: a llama.cpp model file as a ModelConfig, its tokenizer, and its tensors under Hugging Face
names: a table of where each lies (GGUFTensors, kept in the weight cache) and a TensorSource that reads
one as fp32 when asked (dequantised and restored), the token embeddings also row by row.

llama.cpp's converter changes some weights on the way in; each change is undone here so the tensors are
what the transformers checkpoint held:

- Gemma norm weights are stored as 1 + w (HF Gemma's RMSNorm scales by 1 + w): 1 is subtracted.
- Llama q/k projection rows are permuted into llama.cpp's RoPE layout: they are permuted back.
  (qwen2, qwen3 and gemma3 files are not permuted.)
- Llama 3 RoPE scaling is stored as one divisor per frequency (rope_freqs): it is fitted back to
  transformers' llama3 parameters.
- Gemma 3 facts llama.cpp hard-codes rather than stores (layer pattern, local RoPE base, attention scale)
  are filled in the way llama.cpp does.

GGUF lists a tensor's shape innermost dimension first; torch order is the reverse.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from kiln.errors import InvalidArgumentError
from kiln.models.config import LayerType, ModelConfig, RopeScaling
from kiln.models.file_embedding import StoredRows
from kiln.models.hf_config import GEMMA3_LOCAL_ROPE_THETA
from kiln.models.tensor_source import StoredTensor, TensorSource
from kiln.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("gemma3", "llama", "qwen2", "qwen3")

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
}
_LLAMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "post_attention_layernorm"}
# Gemma puts a norm on both sides of attention and of the MLP.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_EMBEDDINGS = "model.embed_tokens.weight"  # stored as the checkpoint held it: readable row by row
_ROPE_FREQS = "rope_freqs.weight"  # folded into ModelConfig.rope_scaling, not a model tensor

# llama.cpp: every 6th Gemma 3 layer is global; the 27B model (62 layers) scales scores by hidden / heads.
_GEMMA3_GLOBAL_EVERY = 6
_GEMMA3_27B_LAYERS = 62
_LLAMA3_DEFAULT_ORIGINAL_CONTEXT = 8192
_LLAMA3_DEFAULT_BAND = (1.0, 4.0)  # low/high frequency factors of every Llama 3.x release
# Released factors are short decimals (8, 32, 1, 4); float32 divisors carry noise below this many digits.
_LLAMA3_DIGITS = 3


def read_gguf(path: Path) -> tuple[ModelConfig, GGUFTensors, Tokenizer]:
    """Config, where each tensor lies (under HF names) and tokenizer of a GGUF file; `gguf_tensor_source`
    reads the tensors. Raises InvalidArgumentError for files that are not GGUF, are truncated or
    damaged, or describe an unsupported architecture."""
    reader = _open(path)
    metadata = _metadata(reader)
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise InvalidArgumentError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
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
        stored[name] = StoredTensor(tensor.shape, read, rows)
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
        architecture="gemma3" if gemma else "llama",
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=value("feed_forward_length"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=value("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=_f32(value("attention.layer_norm_rms_epsilon")),
        rope_theta=theta,
        rope_scaling=_rope_scaling(value, tensors.get(_ROPE_FREQS), head_dim, theta),
        rope_local_theta=_f32(value("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA)) if gemma else None,
        max_position_embeddings=value("context_length"),
        sliding_window=value("attention.sliding_window") if gemma else None,
        layer_types=_gemma3_layer_types(layers) if gemma else (),
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        tie_word_embeddings="output.weight" not in tensors,
        hidden_act="gelu_pytorch_tanh" if gemma else "silu",
        query_pre_attn_scalar=_gemma3_query_scale(layers, hidden, heads, head_dim) if gemma else None,
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


def _gemma3_layer_types(layers: int) -> tuple[LayerType, ...]:
    return tuple(
        "full_attention" if (i + 1) % _GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention"
        for i in range(layers)
    )


def _gemma3_query_scale(layers: int, hidden: int, heads: int, head_dim: int) -> float:
    return float(hidden // heads if layers == _GEMMA3_27B_LAYERS else head_dim)


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
    layer_names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LLAMA_LAYER_NAMES
    table = {}
    for tensor in tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        shape = tuple(reversed(tensor.shape.tolist()))
        table[_hf_name(tensor.name, layer_names)] = GGUFTensor(
            int(tensor.data_offset), int(tensor.n_bytes), int(tensor.tensor_type), shape
        )
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
    qtype = gguf.GGMLQuantizationType(ggml_type)
    try:
        return gguf.quants.dequantize(raw, qtype)
    except NotImplementedError as error:
        raise InvalidArgumentError(
            f"GGUF tensor {name} has type {qtype.name}, which cannot be dequantised"
        ) from error


def _restore(name: str, weight: np.ndarray, arch: str, config: ModelConfig) -> np.ndarray:
    """Undo llama.cpp's converter for one tensor (see the module docstring)."""
    if arch == "gemma3" and name.endswith("norm.weight"):
        return weight - np.float32(1.0)
    if arch == "llama" and ".q_proj." in name:
        return _unpermute_rope(weight, config.num_heads)
    if arch == "llama" and ".k_proj." in name:
        return _unpermute_rope(weight, config.num_kv_heads)
    return weight


def _unpermute_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`, which interleaved the two rotary halves of each head's rows."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )
