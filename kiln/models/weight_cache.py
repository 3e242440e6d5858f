"""The converted-weight cache and content fingerprints of model sources.

Parsing a GGUF file's metadata takes seconds (its vocabulary), and converting its quantised tensors to
fp32 tens of seconds, so an entry keeps what a start needs to skip both: the description (config,
tokenizer, where each tensor lies in the file), written once, and what the configurations that ran
compute with, each written the first time one needs it: the fp32 conversion for exact weights
(LoadedModel.keep_converted), the quantised copy for int8 (kiln/models/quant.py). A default (int8)
server's entry so holds the 270 MB int8 copy and no fp32 weights; token embeddings are read from the
GGUF file itself. An entry is keyed by the source's fingerprint, so an edited or replaced file misses the
cache instead of loading stale weights. Deleting the directory (or one entry) is always safe: it is
rebuilt on the next start.

Layout of a cache directory ($KILN_CACHE_DIR, default ~/.cache/kiln):

    fingerprints.json            file SHA-256s memoised by (path, size, mtime_ns): a later start stats the
                                 source instead of re-hashing hundreds of megabytes
    <fingerprint>/               one model, its description renamed into place whole (never half-written)
        config.json              the ModelConfig
        gguf_tensors.json        where each tensor lies in the GGUF file (GGUFTensors)
        tokenizer.json           the tokenizer backend
        tokenizer_kiln.json      BOS/EOS ids and chat template
        model.safetensors        fp32 tensors under Hugging Face parameter names (exact weights only)
        quantized-int8-v2.safetensors   the int8 copy (int8 weights only)
    .tmp-*                       a file or entry being written; one left by a dead process is removed
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from kiln.errors import InvalidArgumentError
from kiln.models.config import ModelConfig, MoEConfig, RopeScaling
from kiln.models.gguf_import import GGUFTensors
from kiln.models.tensor_source import TensorSource, safetensors_source
from kiln.startup import progress
from kiln.tokenizer import Tokenizer

# Bump whenever conversion output changes for the same source bytes: it is part of every fingerprint.
# 2: a byte-pair GGUF tokenizer keeps llama.cpp's encoder (special tokens, pre-tokenizer) beside tokenizer.json.
CONVERTER_VERSION = 2

_MEMO_FILE = "fingerprints.json"
_WEIGHTS_FILE = "model.safetensors"
_CONFIG_FILE = "config.json"
_TENSORS_FILE = "gguf_tensors.json"
_TMP_PREFIX = ".tmp-"
_BLOCK = 1 << 20


def default_cache_dir() -> Path:
    """$KILN_CACHE_DIR, else ~/.cache/kiln."""
    return Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln").expanduser()


def fingerprint(file_hashes: Mapping[str, str]) -> str:
    """SHA-256 hex naming a model: its files' content hashes (keyed by their names within the source)
    and the converter version. Stable across machines and paths."""
    payload = json.dumps({"converter": CONVERTER_VERSION, "files": dict(sorted(file_hashes.items()))})
    return hashlib.sha256(payload.encode()).hexdigest()


def file_sha256(path: Path, cache_dir: Path) -> str:
    """SHA-256 hex of a file's bytes, hashed in 1 MiB blocks once and then memoised in the cache
    directory for as long as the file keeps its size and mtime."""
    stat = path.stat()
    key = str(path.resolve())
    memo = _read_memo(cache_dir)
    known = memo.get(key)
    if known and known["size"] == stat.st_size and known["mtime_ns"] == stat.st_mtime_ns:
        return known["sha256"]
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(_BLOCK):
            digest.update(block)
    memo[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest.hexdigest()}
    _write_atomically(cache_dir / _MEMO_FILE, json.dumps(memo, indent=1))
    return digest.hexdigest()


def read_description(entry: Path) -> tuple[ModelConfig, Tokenizer]:
    """(config, tokenizer) of a cache entry: everything but the weights."""
    return _config_from_json(json.loads((entry / _CONFIG_FILE).read_text())), Tokenizer.load(entry)


def read_entry(entry: Path) -> tuple[ModelConfig, GGUFTensors | None, Tokenizer]:
    """(config, tensor table, tokenizer) of a complete cache entry. The table is None in an entry an
    earlier Kiln wrote (it always kept the fp32 conversion instead)."""
    try:
        config, tokenizer = read_description(entry)
        tables = entry / _TENSORS_FILE
        table = GGUFTensors.from_json(json.loads(tables.read_text())) if tables.is_file() else None
        if table is None and not has_weights(entry):
            raise FileNotFoundError(f"neither {_TENSORS_FILE} nor {_WEIGHTS_FILE}")
        return config, table, tokenizer
    except Exception as error:  # any unreadable part means the entry was damaged outside Kiln
        raise InvalidArgumentError(
            f"converted-weight cache entry {entry} is unreadable ({error}); delete it to reconvert"
        ) from error


def write_entry(cache_dir: Path, key: str, config: ModelConfig, table: GGUFTensors, tokenizer: Tokenizer) -> Path:
    """Write an entry's description into a temporary directory and rename it into place, so a killed
    start leaves no entry at all. If another process finished the same entry first, its copy is kept."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(cache_dir)
    final = cache_dir / key
    staging = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{key[:16]}-{os.getpid()}-", dir=cache_dir))
    try:
        (staging / _CONFIG_FILE).write_text(json.dumps(asdict(config), indent=1))
        (staging / _TENSORS_FILE).write_text(json.dumps(table.to_json()))
        tokenizer.save(staging)
        staging.chmod(0o755)  # mkdtemp makes it private; entries are as shareable as the cache directory
        os.rename(staging, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def has_weights(entry: Path) -> bool:
    """Whether the entry keeps the fp32 conversion."""
    return (entry / _WEIGHTS_FILE).is_file()


def read_weights(entry: Path) -> TensorSource:
    """The entry's fp32 conversion."""
    return safetensors_source([entry / _WEIGHTS_FILE])


def write_weights(entry: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Keep `tensors` as the entry's fp32 conversion, written whole then renamed into place."""
    converted = progress(tensors.items(), len(tensors), f"converting the weights to float32 (once: kept in {entry})",
                         "tensors")
    save_atomically(entry / _WEIGHTS_FILE, {name: tensor.contiguous() for name, tensor in converted})


def save_atomically(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write a safetensors file under a temporary name, then rename it: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f"{_TMP_PREFIX}{os.getpid()}-")
    os.close(fd)
    try:
        save_file(dict(tensors), temporary)
        os.chmod(temporary, 0o644)  # mkstemp makes it private; cache files are as shareable as the directory
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _config_from_json(data: dict) -> ModelConfig:
    """Inverse of asdict: JSON lists back to the tuples, RopeScaling and MoEConfig the dataclass holds."""
    scaling, moe = data.get("rope_scaling"), data.get("moe")
    return ModelConfig(
        **{
            **data,
            "rope_scaling": RopeScaling(**scaling) if scaling else None,
            "layer_types": tuple(data["layer_types"]),
            "eos_token_ids": tuple(data["eos_token_ids"]),
            "moe": MoEConfig(**{**moe, "mlp_only_layers": tuple(moe["mlp_only_layers"])}) if moe else None,
        }
    )


def _read_memo(cache_dir: Path) -> dict:
    try:
        return json.loads((cache_dir / _MEMO_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
    with os.fdopen(handle, "w") as file:
        file.write(text)
    os.replace(temporary, path)


def _remove_abandoned(cache_dir: Path) -> None:
    """Delete staging directories whose writer process no longer exists."""
    for staging in cache_dir.glob(f"{_TMP_PREFIX}*-*-*"):
        pid = staging.name.split("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True
