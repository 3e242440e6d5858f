"""Kiln: a session-native LLM inference runtime whose KV cache is a first-class, shareable object.

Names resolve lazily: importing one submodule (e.g. kiln.errors) does not build the whole package."""

from __future__ import annotations

from importlib import import_module

import kiln.openmp  # noqa: F401  (first: sets OpenMP's wait policy before anything imports torch)

_EXPORTS = {
    "LLM": "kiln.llm",
    "RequestOutput": "kiln.llm",
    "Session": "kiln.llm",
    "EngineConfig": "kiln.config",
    "SamplingParams": "kiln.engine.sampler",
    "KilnError": "kiln.errors",
    "InvalidArgumentError": "kiln.errors",
    "NotFoundError": "kiln.errors",
    "FailedPreconditionError": "kiln.errors",
    "ResourceExhaustedError": "kiln.errors",
    "InvariantViolation": "kiln.errors",
}
__all__ = [
    "LLM",
    "EngineConfig",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "InvariantViolation",
    "KilnError",
    "NotFoundError",
    "RequestOutput",
    "ResourceExhaustedError",
    "SamplingParams",
    "Session",
]


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kiln' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
