"""The converted-weight cache and content fingerprints of model sources.

Converting a quantised GGUF to fp32 takes tens of seconds; reading the result back from safetensors takes
a second or two. An entry is keyed by the source's fingerprint, so an edited or replaced file misses the
cache instead of loading stale weights.

Layout of a cache directory:

    fingerprints.json            file SHA-256s memoised by (path, size, mtime_ns): a later start stats the
                                 source instead of re-hashing hundreds of megabytes
    <fingerprint>/               one converted model, renamed into place whole (never half-written)
        model.safetensors        fp32 tensors under Hugging Face parameter names
        config.json              the ModelConfig
        tokenizer.json           the tokenizer backend
        tokenizer_kiln.json      BOS/EOS ids and chat template
    .tmp-<key prefix>-<pid>-*    an entry being written; one left by a dead process is removed
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
from safetensors.torch import load_file, save_file

from kiln.errors import InvalidArgumentError
from kiln.models.config import ModelConfig, RopeScaling
from kiln.tokenizer import Tokenizer

# Bump whenever conversion output changes for the same source bytes: it is part of every fingerprint.
CONVERTER_VERSION = 1

_MEMO_FILE = "fingerprints.json"
_WEIGHTS_FILE = "model.safetensors"
_CONFIG_FILE = "config.json"
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


def read_entry(entry: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """(config, tensors, tokenizer) of a complete cache entry."""
    try:
        config, tokenizer = read_description(entry)
        return config, load_file(entry / _WEIGHTS_FILE), tokenizer
    except Exception as error:  # any unreadable part means the entry was damaged outside Kiln
        raise InvalidArgumentError(
            f"converted-weight cache entry {entry} is unreadable ({error}); delete it to reconvert"
        ) from error


def write_entry(
    cache_dir: Path, key: str, config: ModelConfig, tensors: Mapping[str, torch.Tensor], tokenizer: Tokenizer
) -> Path:
    """Write an entry into a temporary directory and rename it into place, so a killed conversion leaves
    no entry at all. If another process finished the same entry first, its copy is kept."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(cache_dir)
    final = cache_dir / key
    staging = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{key[:16]}-{os.getpid()}-", dir=cache_dir))
    try:
        save_file({name: t.contiguous() for name, t in tensors.items()}, staging / _WEIGHTS_FILE)
        (staging / _CONFIG_FILE).write_text(json.dumps(asdict(config), indent=1))
        tokenizer.save(staging)
        staging.chmod(0o755)  # mkdtemp makes it private; entries are as shareable as the cache directory
        os.rename(staging, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _config_from_json(data: dict) -> ModelConfig:
    """Inverse of asdict: JSON lists back to the tuples and RopeScaling the dataclass holds."""
    scaling = data.get("rope_scaling")
    return ModelConfig(
        **{
            **data,
            "rope_scaling": RopeScaling(**scaling) if scaling else None,
            "layer_types": tuple(data["layer_types"]),
            "eos_token_ids": tuple(data["eos_token_ids"]),
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
