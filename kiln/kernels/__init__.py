"""Kiln's C++ CPU kernels (kernels.h lists them; bindings.cpp binds them), compiled on first use with the
machine's C++ compiler, and the one place that decides whether they are used.

Shipped as sources (package data) and built at first use, not at install time: the build needs the exact
PyTorch the process runs (its headers and ABI) and this CPU's instruction set (-mavx2), which a wheel built
elsewhere cannot promise; and where no compiler works, Kiln still runs on PyTorch ops instead of failing to
install. One build serves every AVX2 CPU: the functions that gain from AVX-512 VNNI are compiled a second
time for it and chosen at load from cpuid (isa.h). The build happens once per machine and is shared by every checkout and installed copy of the same
sources (build.py: how, and why a killed start can never make a later one wait).

`supported()` answers whether they run (kiln/platform.py asks it once and tells every caller what follows): an
AVX2 CPU and a library that loaded. When the answer is
no, Kiln takes its PyTorch path, says so once per process in one warning (the cause, and what changes), and
never tries again in that process:
- EngineConfig's quantization "auto" resolves to None (float32 weights; an explicit "int8" is refused with
  the cause), and kv_dtype "auto" to the weights' dtype;
- the model's norms, q/k norm + RoPE and gated activation run as PyTorch ops (no fused kernels);
- KV rows are stored by the codec's PyTorch encoding, and attention gathers pages for PyTorch's matmuls;
- greedy sampling uses torch.argmax.
The deterministic mode needs the kernels and is refused without them. Nothing on that path needs a compiler.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from types import ModuleType

import torch

from kiln.errors import UnavailableError
from kiln.kernels import build


def supported() -> bool:
    """Whether the kernels run in this process: an x86 CPU with AVX2 and FMA (PyTorch reports AVX2 or
    better) and a library that was built (now, if need be) and loaded. Memoised; the first False warns once."""
    return _library.outcome().module is not None


def unavailable_reason() -> str | None:
    """Why `supported()` is False (None when it is True)."""
    return _library.outcome().reason


def kernels() -> ModuleType:
    """The compiled extension: linear_f32, linear_int8, unpack (linear.cpp), linear_blocks (blocks.cpp),
    isa, use_isa, cpu_has_avx512_vnni (isa.h: the instruction-set path), paged_attention,
    paged_attention_coded (attention.cpp), rms_norm, residual_norm, qk_norm_rope (norms.cpp),
    gated_activation (activations.cpp), argmax_rows (argmax.cpp), store_kv (kv_store.cpp), Projection and
    DecoderLayer (decoder_layer.h: a decoder layer's step as one call), page_format (page_format.h).
    Callers check `supported()` first; without it, UnavailableError names the cause."""
    outcome = _library.outcome()
    if outcome.module is None:
        raise UnavailableError(f"Kiln's CPU kernels are unavailable: {outcome.reason}")
    return outcome.module


@dataclass(frozen=True)
class _Outcome:
    module: ModuleType | None
    reason: str | None


class _Library:
    """The process's one attempt at loading the kernels, and its outcome."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outcome: _Outcome | None = None

    def outcome(self) -> _Outcome:
        with self._lock:
            if self._outcome is None:
                self._outcome = self._attempt()
                if self._outcome.module is None:
                    warnings.warn(_fallback_message(self._outcome.reason or "unknown"), RuntimeWarning, stacklevel=3)
            return self._outcome

    @staticmethod
    def _attempt() -> _Outcome:
        capability = torch.backends.cpu.get_cpu_capability()
        if capability not in ("AVX2", "AVX512"):
            return _Outcome(None, f"they need AVX2 and FMA; this CPU reports {capability}")
        try:
            return _Outcome(build.load(), None)
        except UnavailableError as error:
            return _Outcome(None, str(error))
        except Exception as error:  # a broken cache directory, a library that cannot load: still "not here"
            return _Outcome(None, f"{type(error).__name__}: {error}")


def _fallback_message(reason: str) -> str:
    return (
        f"Kiln's CPU kernels are off in this process ({reason}). Running on PyTorch ops instead: quantization "
        "'auto' falls back to None (float32 weights), fused norm/RoPE/activation/KV-store/argmax kernels are off, "
        "and attention gathers KV pages for PyTorch's matmuls."
    )


_library = _Library()
