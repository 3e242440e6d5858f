"""Kiln: a session-native LLM inference runtime whose KV cache is a first-class, shareable object."""

from kiln.config import EngineConfig
from kiln.engine.sampler import SamplingParams
from kiln.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    InvariantViolation,
    KilnError,
    NotFoundError,
    ResourceExhaustedError,
)
from kiln.llm import LLM, RequestOutput, Session

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
