"""load_model: any model source -> config, fp32 tensors under Hugging Face names, tokenizer, fingerprint.

Sources: a name (kiln/models/catalog.py; None: the embedded Gemma 3 270M), an HF-style directory
(config.json, *.safetensors, possibly sharded, tokenizer.json), or a GGUF file. A GGUF file's description
(config, tokenizer, where each tensor lies) is read once and then from the converted-weight cache (see
weight_cache). Every path returns exactly the tensors the model definition expects, with shapes checked
against the config, so a bad source fails here with a clear message. The tensors are a TensorSource: read
from their files when the engine builds its model, never all held at once (kiln/models/tensor_source.py
says why).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.errors import InvalidArgumentError
from kiln.models import weight_cache
from kiln.models.catalog import resolve
from kiln.models.config import ModelConfig
from kiln.models.file_embedding import StoredRows
from kiln.models.generation_config import GenerationDefaults
from kiln.models.gguf_import import gguf_tensor_source, read_gguf
from kiln.models.hf_config import config_from_hf
from kiln.models.moe import sparse_layer_shapes
from kiln.models.tensor_source import TensorSource, safetensors_source, shapes_of
from kiln.startup import phase
from kiln.tokenizer import Tokenizer

# Files of an HF directory whose bytes decide the model's behaviour, besides the weights.
_HF_DESCRIPTION_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
_SHARD_INDEX = "model.safetensors.index.json"
# Multimodal checkpoints (Gemma 3 4B+) nest the text model; transformers 4 and 5 spell it differently.
_TEXT_MODEL_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}


@dataclass
class LoadedModel:
    """A model ready to build: `tensors` are float32 under HF parameter names (exactly the ones the
    config implies; a TensorSource reads each when asked); `fingerprint` is the SHA-256 hex of the
    source's content and the converter version, stable across machines, and keys KV caches and
    snapshots."""

    config: ModelConfig
    tensors: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    source: Path
    fingerprint: str
    cache_entry: Path | None = None  # where artifacts derived from these weights may be kept (quantised copies)
    generation_defaults: GenerationDefaults = GenerationDefaults()  # an HF directory's generation_config.json
    catalog_name: str | None = None  # the name it was loaded by (kiln/models/catalog.py); None when given by path

    @property
    def display_name(self) -> str:
        """What a banner and the API call it: the name it was loaded by, else its file's name for it, else
        the file's own name."""
        return self.catalog_name or self.config.name or self.source.name

    def stored_rows(self, name: str) -> StoredRows | None:
        """Where matrix `name` lies row by row in its file, when it does (kiln/models/file_embedding.py)."""
        return self.tensors.rows(name) if isinstance(self.tensors, TensorSource) else None

    def keep_converted(self) -> None:
        """Keep the float32 conversion of a GGUF source in its cache entry, for a configuration that
        computes with the weights as they are: later starts then read it instead of dequantising every
        tensor again. Other sources (and a conversion already kept) are left as they are."""
        if self.cache_entry is None or not self.source.is_file() or weight_cache.has_weights(self.cache_entry):
            return
        weight_cache.write_weights(self.cache_entry, self.tensors)
        self.tensors = weight_cache.read_weights(self.cache_entry).with_blocks_of(self.tensors)


def load_model(source: str | Path | None = None, cache_dir: Path | None = None) -> LoadedModel:
    """Load `source`: a model's name or path, as `--model` takes it (kiln/models/catalog.py; None = the
    default embedded model). `cache_dir` defaults to $KILN_CACHE_DIR or ~/.cache/kiln. Raises
    InvalidArgumentError for unknown names, missing paths and unsupported, truncated or incomplete sources."""
    entry = resolve(source)
    path = entry.path()
    cache = Path(cache_dir) if cache_dir is not None else weight_cache.default_cache_dir()
    if path.is_dir():
        loaded = _load_hf_dir(path, cache)
    elif path.is_file():
        loaded = _load_gguf(path, cache)
    else:
        raise InvalidArgumentError(f"model path {path} is neither a GGUF file nor a model directory")
    loaded.catalog_name = None if entry.origin == "path" else entry.name
    return loaded


def _load_gguf(path: Path, cache: Path) -> LoadedModel:
    """Read the cache entry for this file's content, describing the file into it first if there is none.
    Tensors come from the entry's float32 conversion where a configuration kept one, else from the file."""
    # A one-file source: its content, not its name, identifies it.
    key = weight_cache.fingerprint({"model.gguf": weight_cache.file_sha256(path, cache)})
    entry = cache / key
    if entry.is_dir():
        config, table, tokenizer = weight_cache.read_entry(entry)
    else:
        phase(f"describing {path.name} into the weight cache (once: its config, vocabulary and tensor table)")
        config, table, tokenizer = read_gguf(path)
        _checked(gguf_tensor_source(path, table, config), config, path)  # refused before it is cached
        weight_cache.write_entry(cache, key, config, table, tokenizer)
    tensors = gguf_tensor_source(path, table, config)
    if weight_cache.has_weights(entry):  # read faster than dequantised, and still computable as blocks
        tensors = weight_cache.read_weights(entry).with_blocks_of(tensors)
    return LoadedModel(config, _checked(tensors, config, path), tokenizer, path, key, entry)


def _load_hf_dir(path: Path, cache: Path) -> LoadedModel:
    """An HF directory is read in place (safetensors already load fast); only its hashes are cached."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise InvalidArgumentError(f"{path} is not a model directory: it has no config.json")
    try:
        raw_config = json.loads(config_file.read_text())
    except ValueError as error:
        raise InvalidArgumentError(f"{config_file} is not valid JSON: {error}") from error
    config = config_from_hf(raw_config)
    shards = shard_files(path)
    tensors = safetensors_source(shards).renamed(_text_model_name)
    described = [path / name for name in (*_HF_DESCRIPTION_FILES, _SHARD_INDEX) if (path / name).is_file()]
    hashes = {file.name: weight_cache.file_sha256(file, cache) for file in [*described, *shards]}
    key = weight_cache.fingerprint(hashes)
    return LoadedModel(
        config,
        _checked(tensors, config, path),
        Tokenizer.from_hf_dir(path),
        path,
        key,
        cache / key,
        GenerationDefaults.from_hf_dir(path),
    )


def shard_files(path: Path) -> list[Path]:
    """The safetensors files holding the weights: those the shard index names, else all in the directory."""
    index = path / _SHARD_INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in names if not (path / name).is_file()]
        if missing:
            raise InvalidArgumentError(
                f"{path}: shards named in {_SHARD_INDEX} are missing: {', '.join(missing)}"
            )
        return [path / name for name in names]
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise InvalidArgumentError(
            f"{path} has no *.safetensors weights (other weight formats are not supported)"
        )
    return shards


def _text_model_name(name: str) -> str:
    """A multimodal checkpoint's text-model tensor name as a text-only model names it."""
    prefix = next((p for p in _TEXT_MODEL_PREFIXES if name.startswith(p)), None)
    return name if prefix is None else _TEXT_MODEL_PREFIXES[prefix] + name[len(prefix) :]


def _checked(tensors: TensorSource, config: ModelConfig, source: Path) -> TensorSource:
    """Exactly the tensors `config` implies, each of the implied shape (checked without reading them).
    Extra tensors (a tied lm_head saved anyway, a vision tower, rotary buffers) are dropped; missing or
    misshapen ones are an error."""
    shapes = shapes_of(tensors)
    expected = _expected_shapes(config)
    missing = sorted(set(expected) - shapes.keys())
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise InvalidArgumentError(f"{source} lacks tensors the config requires: {shown}")
    wrong = [f"{name} {tuple(shapes[name])} != {shape}" for name, shape in expected.items() if tuple(shapes[name]) != shape]
    if wrong:
        raise InvalidArgumentError(f"{source} has tensors of the wrong shape: {'; '.join(wrong[:5])}")
    return tensors.only(expected)


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> torch shape for a decoder-only model of this config."""
    hidden, q_rows, kv_rows = (
        config.hidden_size,
        config.num_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
    )
    layer: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
        "mlp.gate_proj.weight": (config.intermediate_size, hidden),
        "mlp.up_proj.weight": (config.intermediate_size, hidden),
        "mlp.down_proj.weight": (hidden, config.intermediate_size),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    if config.attention_bias:
        layer |= {
            "self_attn.q_proj.bias": (q_rows,),
            "self_attn.k_proj.bias": (kv_rows,),
            "self_attn.v_proj.bias": (kv_rows,),
        }
    if config.qk_norm:
        layer |= {
            "self_attn.q_norm.weight": (config.head_dim,),
            "self_attn.k_norm.weight": (config.head_dim,),
        }
    if config.architecture == "gemma3":
        layer |= {
            "pre_feedforward_layernorm.weight": (hidden,),
            "post_feedforward_layernorm.weight": (hidden,),
        }
    if config.architecture == "olmo2":  # post-norms only; q/k normed over the whole projection
        del layer["input_layernorm.weight"]
        layer |= {
            "self_attn.q_norm.weight": (q_rows,),
            "self_attn.k_norm.weight": (kv_rows,),
            "post_feedforward_layernorm.weight": (hidden,),
        }
    if config.fused_checkpoint:  # Phi-3
        for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"):
            del layer[name]
        layer |= {
            "self_attn.qkv_proj.weight": (q_rows + 2 * kv_rows, hidden),
            "mlp.gate_up_proj.weight": (2 * config.intermediate_size, hidden),
        }
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    dense_mlp = {name: layer.pop(name) for name in [*layer] if name.startswith("mlp.")}
    for index in range(config.num_layers):
        moe = config.moe if config.moe is not None and config.moe.is_sparse(index) else None
        mlp = dense_mlp if moe is None else sparse_layer_shapes(hidden, moe)
        shapes |= {f"model.layers.{index}.{name}": shape for name, shape in (layer | mlp).items()}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes
