"""Models by name: what `--model NAME` loads, for every command that takes it (`kiln serve`, `chat`,
`generate`, `fleet`, `LLM(NAME)`), and what `kiln models` lists.

A name resolves, in this order, to
1. an embedded model (kiln/models/embedded.py: `gemma3-270m`, `smollm2-135m-instruct`);
2. a model in the models directory ($KILN_MODELS_DIR, default <data>/kiln/models, see kiln/paths.py): a
   `*.gguf` file named by its stem, or an HF directory (one holding config.json) named by its folder name;
3. a path to a GGUF file or an HF directory.
Anything else is refused with UnknownModelError, which lists the names there are. No `--model` is the
default embedded model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kiln.errors import InvalidArgumentError
from kiln.models.embedded import DEFAULT_MODEL, EMBEDDED_MODELS, EmbeddedModel
from kiln.paths import data_directory

MODELS_DIR_ENV = "KILN_MODELS_DIR"
HF_CONFIG = "config.json"  # what makes a directory an HF model directory
Origin = Literal["embedded", "models directory", "path"]


class UnknownModelError(InvalidArgumentError):
    """`--model` names no embedded model, no model of the models directory and no existing path;
    `available` holds the names that would resolve."""

    def __init__(self, model: str, available: list[str], directory: Path) -> None:
        listed = ", ".join(available) if available else "none"
        super().__init__(f"no model named {model!r}: not an embedded model, not in the models directory {directory} "
                         f"(${MODELS_DIR_ENV}), and the path {Path(model).expanduser()} does not exist; available: "
                         f"{listed} (`kiln models` describes them)", "model")
        self.available = available


@dataclass(frozen=True)
class CatalogEntry:
    """A model `--model` can name: `embedded` for an embedded one (its file is found, or assembled, only
    when `path()` is asked), else `location`, a GGUF file or an HF directory."""

    name: str
    origin: Origin
    embedded: EmbeddedModel | None = None
    location: Path | None = None

    def path(self) -> Path:
        return self.embedded.path() if self.embedded is not None else self.location


def models_directory() -> Path:
    """$KILN_MODELS_DIR, else <data>/kiln/models (it need not exist)."""
    configured = os.environ.get(MODELS_DIR_ENV)
    return Path(configured).expanduser() if configured else data_directory() / "models"


def available_models() -> list[CatalogEntry]:
    """Every model a name reaches: the embedded ones, then the models directory's, sorted by name (one
    shadowed by an embedded name is left out: the embedded model is what that name serves)."""
    embedded = [CatalogEntry(model.name, "embedded", embedded=model) for model in EMBEDDED_MODELS.values()]
    directory = [entry for entry in _directory_entries() if entry.name not in EMBEDDED_MODELS]
    return embedded + directory


def resolve(model: str | Path | None) -> CatalogEntry:
    """The model `--model` names (None: the default embedded one), in the order of the module docstring.
    A name two entries of the models directory share (`x.gguf` beside `x/`) is refused: give the path."""
    if model is None:
        return CatalogEntry(DEFAULT_MODEL, "embedded", embedded=EMBEDDED_MODELS[DEFAULT_MODEL])
    text = str(model)
    if text in EMBEDDED_MODELS:
        return CatalogEntry(text, "embedded", embedded=EMBEDDED_MODELS[text])
    named = [entry for entry in _directory_entries() if entry.name == text]
    if len(named) > 1:
        paths = ", ".join(str(entry.location) for entry in named)
        raise InvalidArgumentError(f"{len(named)} models of the models directory are named {text!r}: {paths}; "
                                   "give the path of one", "model")
    if named:
        return named[0]
    path = Path(text).expanduser()
    if path.exists():
        return CatalogEntry(path.name if path.is_dir() else path.stem, "path", location=path)
    raise UnknownModelError(text, [entry.name for entry in available_models()], models_directory())


def _directory_entries() -> list[CatalogEntry]:
    """The models directory's GGUF files and HF directories, sorted by name; other files are ignored."""
    directory = models_directory()
    if not directory.is_dir():
        return []
    entries = [CatalogEntry(child.stem, "models directory", location=child) for child in directory.glob("*.gguf")
               if child.is_file()]
    entries += [CatalogEntry(child.name, "models directory", location=child) for child in directory.iterdir()
                if (child / HF_CONFIG).is_file()]
    return sorted(entries, key=lambda entry: (entry.name, str(entry.location)))
