"""Platform: what the device an engine computes on can do, decided in one place.

Three platforms: a CPU where Kiln's C++ kernels run (`cpu-kernels`: an x86 CPU with AVX2 and a library that
built, kiln/kernels), a CPU where they do not (`cpu`: PyTorch ops only), and a GPU or other accelerator
(`cuda`, or the device's own type: PyTorch ops). Which weight formats compute where, which dtypes the defaults
pick, and whether KV pages are stored and attended by the kernels all follow from the platform, so a new
device (or a GPU backend) changes this module rather than checks spread over the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from kiln.kernels import supported as kernels_supported
from kiln.kernels import unavailable_reason as kernels_unavailable_reason
from kiln.kernels.page_format import KERNEL_DTYPES

# The weight formats (EngineConfig.quantization) only the C++ kernels compute, so only `cpu-kernels` takes
# them: a GGUF file's blocks (kiln/models/gguf_blocks.py) and int8 (kiln/models/quant.py). None, the exact
# path (the model's own float weights), computes on every platform through PyTorch.
KERNEL_WEIGHT_FORMATS = ("gguf", "int8")


@dataclass(frozen=True)
class Platform:
    name: str  # "cpu-kernels", "cpu", or the accelerator's device type ("cuda")
    device: torch.device

    @staticmethod
    def of(device: str | torch.device) -> Platform:
        """The platform of `device` ("cpu", "cuda:0", a tensor's .device). Whether the kernels run is asked each
        time (kiln/kernels memoises the answer; tests simulate a failed build)."""
        with_kernels, without = _platforms(str(device))
        return with_kernels if with_kernels.device.type == "cpu" and kernels_supported() else without

    @property
    def on_host(self) -> bool:
        """Tensors live in host memory (NumPy may read them in place)."""
        return self.device.type == "cpu"

    @property
    def kernels(self) -> bool:
        """Kiln's C++ kernels compute here."""
        return self.name == "cpu-kernels"

    @property
    def default_dtype(self) -> str:
        """What EngineConfig's dtype "auto" resolves to: bfloat16 on a GPU, float32 on the CPU (the kernels' dtype)."""
        return "float32" if self.on_host else "bfloat16"

    @property
    def default_speculative(self) -> str | None:
        """What EngineConfig's speculative "auto" resolves to: n-gram drafts on the CPU, none on a GPU (a step
        verifying a draft is eager there, outside the decode graphs)."""
        return "ngram" if self.on_host else None

    @property
    def step_tokens(self) -> tuple[int, int]:
        """What EngineConfig's max_batched_tokens and prefill_chunk_tokens default to: short steps on the CPU (a
        request arriving during a long prefill waits about two of them), long ones on a GPU, where a step of a
        few hundred tokens is bound by kernel launches and reading the weights, not by its arithmetic."""
        return (1024, 256) if self.on_host else (8192, 2048)

    @property
    def paged_attention(self) -> bool:
        """Whether steps of few rows per sequence attend with the Triton kernel over the pages where they lie
        (kiln/kernels/triton_attention.py): a CUDA device where Triton runs."""
        if self.device.type != "cuda":
            return False
        from kiln.kernels import triton_attention  # imported where it may run: Triton costs a process 0.2 s

        return triton_attention.available()

    @property
    def captures_graphs(self) -> bool:
        """Whether decode steps are captured as CUDA graphs by default (EngineConfig.decode_graphs)."""
        return self.device.type == "cuda"

    def default_quantization(self, dtype: torch.dtype) -> str | None:
        """What EngineConfig's quantization "auto" resolves to: the GGUF blocks as stored where the kernels
        run on float32 activations, else the exact path."""
        return "gguf" if self.kernels and dtype == torch.float32 else None

    def quantization_problem(self, quantization: str, dtype: torch.dtype) -> str | None:
        """Why `quantization` (one of KERNEL_WEIGHT_FORMATS) cannot compute here with `dtype` activations; None
        if it can."""
        if not self.on_host:
            return f"quantization {quantization!r} runs on Kiln's CPU kernels, not on {self.device.type!r}; use quantization None"
        if dtype != torch.float32:
            return f"quantization {quantization!r} on the CPU takes float32 activations; got dtype {_name(dtype)!r}"
        if not self.kernels:
            return (f"quantization {quantization!r} runs on Kiln's CPU kernels, which are unavailable here "
                    f"({kernels_unavailable_reason()}); use quantization None or 'auto'")
        return None

    def default_kv_dtype(self, quantization: str | None) -> str | None:
        """What kv_dtype "auto" resolves to: "float16" pages beside kernel weights on the CPU (attention reads
        them in place at half float32's bytes), else None (the activations' dtype)."""
        return "float16" if self.on_host and quantization is not None else None

    def fused_kernels(self, dtype: torch.dtype) -> bool:
        """Whether models compute norms, RoPE, activations and whole decoder layers with the kernels
        (CausalLM.use_kernels): float32 where they run."""
        return self.kernels and dtype == torch.float32

    def deterministic_problem(self, dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
        """Why the deterministic mode (batch-invariant kernels) cannot run here; None if it can."""
        if self.kernels and dtype == torch.float32 and kv_dtype in KERNEL_DTYPES:
            return None
        return (f"deterministic needs device 'cpu' with Kiln's CPU kernels (kiln/kernels), dtype 'float32' and float32 or "
                f"float16 KV pages (got dtype {_name(dtype)!r}, kv_dtype {_name(kv_dtype)!r} on {str(self.device)!r}): its "
                f"batch-invariant kernels exist for that only")

    def kernel_pages(self, read_dtype: torch.dtype) -> bool:
        """Whether the kernels store KV pages of this dtype and attend over them in place."""
        return self.kernels and read_dtype in KERNEL_DTYPES


@cache
def _platforms(device: str) -> tuple[Platform, Platform]:
    """The device's platform with the kernels and without them (the same for a device the kernels never run on)."""
    resolved = torch.device(device)
    if resolved.type != "cpu":
        return Platform(resolved.type, resolved), Platform(resolved.type, resolved)
    return Platform("cpu-kernels", resolved), Platform("cpu", resolved)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
