"""GenerationDefaults: the sampling defaults a model's authors ship in an HF directory's
generation_config.json, which the OpenAI API uses for what a request leaves out, as vLLM does
(`--generation-config auto`): Qwen3 asks for temperature 0.6, top_p 0.95, top_k 20. A request's explicit
value always wins. A GGUF file carries none. What neither sets, the OpenAI API fills with OpenAI's own
defaults (kiln/server/chat_plan.py OPENAI_DEFAULTS: temperature and top_p 1.0), then Kiln's (256 tokens).

vLLM's keys, under the names Kiln's requests use: temperature, top_p, top_k, min_p, repetition_penalty,
and max_new_tokens as max_tokens. Like vLLM, `do_sample` is not read: a shipped temperature applies.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TypeVar

from kiln.errors import InvalidArgumentError

GENERATION_CONFIG = "generation_config.json"
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_INTEGERS = {"top_k", "max_tokens"}
R = TypeVar("R")


@dataclass(frozen=True)
class GenerationDefaults:
    """Each field None where the file does not set it."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    @classmethod
    def from_hf_dir(cls, directory: Path) -> GenerationDefaults:
        """The defaults `directory`'s generation_config.json sets (none without one). InvalidArgumentError
        for a file that is not JSON or a value that is not a number; ranges are checked where a request's
        are (SamplingParams), which names the field."""
        file = directory / GENERATION_CONFIG
        if not file.is_file():
            return cls()
        try:
            raw = json.loads(file.read_text())
        except ValueError as error:
            raise InvalidArgumentError(f"{file} is not valid JSON: {error}") from error
        if not isinstance(raw, dict):
            raise InvalidArgumentError(f"{file} must hold a JSON object")
        values = {}
        for key, name in _KEYS.items():
            value = raw.get(key)
            if value is None:
                continue
            kind = numbers.Integral if name in _INTEGERS else numbers.Real
            if isinstance(value, bool) or not isinstance(value, kind):
                kind_name = "an integer" if name in _INTEGERS else "a number"
                raise InvalidArgumentError(f"{file}: {key} must be {kind_name}, got {value!r}")
            values[name] = value
        return cls(**values)

    def fill(self, request: R) -> R:
        """`request` (a dataclass with fields of these names, such as the server's GenerateRequest) with
        each of them it leaves None set to this default."""
        names = {field.name for field in fields(request)}
        return replace(request, **{name: value for name, value in asdict(self).items()
                                   if value is not None and name in names and getattr(request, name) is None})
