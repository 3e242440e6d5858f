"""Kiln's C++ CPU kernels (linear.cpp, attention.cpp, norms.cpp, activations.cpp, argmax.cpp, kv_store.cpp),
compiled on first use with the machine's C++ compiler.

The build lands in PyTorch's extension directory ($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions)
under a name with a digest of the sources, the compiler flags and the PyTorch version, so it happens
once per machine (about 40 s on the 2-core machines here), whatever converted-weight cache a process
uses, and a changed source or PyTorch never loads a stale library. Concurrent first uses in several
processes wait on one build (PyTorch's build lock).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

from kiln.errors import UnavailableError

SOURCES = [
    Path(__file__).with_name(name)
    for name in ("linear.cpp", "attention.cpp", "norms.cpp", "activations.cpp", "argmax.cpp", "kv_store.cpp")
]
HEADERS = [Path(__file__).with_name(name) for name in ("pool.h", "vec_math.h")]  # in the digest too: a changed header rebuilds
# -ffp-contract=off: the compiler must not fuse a multiply and an add on its own, which it may do in one
# inlined copy of a loop and not in another; the kernels' results must not depend on which copy ran.
# -mf16c: coded KV pages' float16 scales (attention.cpp); every AVX2 CPU has F16C.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]


def supported() -> bool:
    """The kernels need an x86 CPU with AVX2 and FMA (PyTorch reports AVX2 or better) and a C++ compiler
    to build them (PyTorch's builder runs $CXX, else c++). Where either is missing, "auto" picks the
    exact path and decode gathers pages instead."""
    compiler = os.environ.get("CXX", "c++")
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and shutil.which(compiler) is not None


@functools.cache
def kernels() -> ModuleType:
    """The compiled extension: linear_f32, linear_int8, unpack (linear.cpp), paged_attention,
    paged_attention_coded (attention.cpp), rms_norm, residual_norm, qk_norm_rope (norms.cpp), gated_activation
    (activations.cpp), argmax_rows (argmax.cpp), store_kv (kv_store.cpp)."""
    if not supported():
        raise UnavailableError(
            f"Kiln's CPU kernels need AVX2 and FMA; this CPU reports {torch.backends.cpu.get_cpu_capability()}"
        )
    from torch.utils.cpp_extension import load  # imported late: it pulls in setuptools

    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    digest = hashlib.sha256(source + " ".join(CFLAGS).encode() + torch.__version__.encode()).hexdigest()[:16]
    _ninja_on_path()
    try:
        return load(
            name=f"kiln_kernels_{digest}",
            sources=[str(path) for path in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
        )
    except (OSError, RuntimeError) as error:  # no compiler, no ninja, a failed build
        raise UnavailableError(f"could not build Kiln's CPU kernels: {error}") from error


def _ninja_on_path() -> None:
    """PyTorch's builder runs `ninja` from PATH; the pip package's binary is found even outside an
    activated virtual environment."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
