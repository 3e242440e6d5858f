"""Weight-only int8 linear layers for CPU decode, computed by Kiln's own kernel (kernels/linear.cpp).

Why: decoding one token reads every weight once, and on the CPU that read is the bound, not the
arithmetic. The embedded Gemma 3 270M in fp32 reads 1.07 GB per token (671 MB of it the 262144 x 640 LM
head) against ~23 GB/s of read bandwidth here (bench/throughput.py measures it). Weights are stored as
int8 (one scale per output row) and widened to float32 only in registers; activations stay float32, so
there is no activation quantisation error and a row's result never depends on the other rows of its
batch (INV-3). bench/kernels.py measures the candidates this replaced (fbgemm fp16 and dynamic int8,
aten's weight-only int8/int4, inductor); bench/weight_formats.py measures the format on the whole model.
Two more were tried and dropped: int4 weights in groups of 32 (+93 % perplexity on the embedded model,
and no faster), and int8 activations per 32-value block against int8 weights (llama.cpp's Q8_0 dot
product: 1.1-1.4x on the kernel alone, nothing on the memory-bound LM head, and a changed input rounding
turns float-order differences into whole int8 steps, breaking the 1e-4 agreement of prefill and decode).

Rows per call decide the path: up to KERNEL_MAX_ROWS rows (decode batches, speculative verification) run
the kernel, which reads each weight once for all rows; a larger prefill chunk widens the matrix to
float32 once and runs BLAS, which is faster there than a kernel built for streaming. `batch_invariant`
(the deterministic mode) runs the kernel at every size: its per-element arithmetic does not depend on
the row count, BLAS's does. Format "float32" keeps exact weights and exists for that mode alone.

Quantisation happens once per model source and format; `quantize_model` keeps the result next to the
converted weights (see weight_cache) so later starts read it back.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from kiln.errors import InvalidArgumentError
from kiln.models.kernels import kernels

if TYPE_CHECKING:
    from kiln.models.causal_lm import CausalLM

QUANTIZATIONS = ("int8",)
KERNEL_FORMATS = ("float32", *QUANTIZATIONS)
# Above this many rows, widening the weights to float32 and running BLAS beats the kernel (bench/kernels.py:
# at 256 rows 13.9 vs 20.1 ms on the gate/up projection, 5.9 vs 14.3 on down). Widening costs the same
# whatever the row count and is large for the LM head (a 671 MB write), so the kernel keeps everything
# short of a prefill chunk.
KERNEL_MAX_ROWS = 64
QUANT_VERSION = 2  # bump when the stored quantised format changes (2: packed blocks of 8 rows)
PACK_ROWS = 8  # output rows per packed block (kernels/linear.cpp, kBlock)


class QuantizedLinear(nn.Module):
    """y = x @ W^T + b with W in `fmt`: x [..., in_features] float32 -> [..., out_features] float32.

    Buffers: `weight` (float32 or int8, packed: see `pack`), `scale` (int8: [N]; float32: none), `bias`
    when the layer has one.
    """

    def __init__(self, fmt: str, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                 out_features: int, batch_invariant: bool = False) -> None:
        super().__init__()
        if fmt not in KERNEL_FORMATS:
            raise InvalidArgumentError(f"quantization must be one of {list(QUANTIZATIONS)}, got {fmt!r}")
        self.fmt = fmt
        self.out_features = out_features
        self.in_features = weight.shape[1] * 8
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)
        # What forward needs, bound once: the buffers' lookups through nn.Module.__getattr__ and the format's
        # dispatch cost a decode step of the embedded model about 0.2 ms over its 73 projections. The
        # buffers are never replaced (the kernels run on the CPU only; nothing moves them).
        self._widen_above = None if batch_invariant else KERNEL_MAX_ROWS * self.in_features
        if fmt == "float32":
            self._apply_kernel = lambda x: kernels().linear_f32(x, weight, bias, out_features)
        else:
            self._apply_kernel = lambda x: kernels().linear_int8(x, weight, scale, bias)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, batch_invariant: bool = False) -> QuantizedLinear:
        """From a float32 [N, K] weight (not modified)."""
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise InvalidArgumentError(f"quantization needs float32 CPU weights, got {weight.dtype} on {weight.device}")
        if fmt not in KERNEL_FORMATS:
            raise InvalidArgumentError(f"quantization must be one of {list(QUANTIZATIONS)}, got {fmt!r}")
        if weight.shape[1] % 8:
            raise InvalidArgumentError(f"{fmt} weights need in_features divisible by 8, got {weight.shape[1]}")
        weight = weight.detach()
        bias = None if bias is None else bias.detach().contiguous()
        if fmt == "float32":
            return cls(fmt, pack(weight), None, bias, weight.shape[0], batch_invariant)
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
        q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(fmt, pack(q), scale.contiguous(), bias, weight.shape[0], batch_invariant)

    def dequantized(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 [N, K] matrix the stored weights stand for, written to `out` when given."""
        if out is None:
            out = torch.empty(self.out_features, self.in_features)
        return kernels().unpack(self.weight, self.scale, self.out_features, out)

    @property
    def nbytes(self) -> int:
        """What one forward reads from memory."""
        return sum(t.nbytes for t in (self.weight, self.scale, self.bias) if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._widen_above is not None and x.numel() > self._widen_above:
            return F.linear(x, self.dequantized(_widening_buffer(self.out_features, self.in_features)), self.bias)
        return self._apply_kernel(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


def quantize_model(model: CausalLM, fmt: str | None, batch_invariant: bool = False, cache_file: Path | None = None) -> CausalLM:
    """Swap every nn.Linear (fused qkv, o, fused gate/up, down, an untied head) for a QuantizedLinear in
    `fmt` and give the model a quantised LM head, in place; returns the model. A tied embedding table
    stays float32 for lookups. fmt None keeps float32 weights: unchanged unless `batch_invariant`, which
    routes them through the kernel. `cache_file` holds the quantised tensors: read when it exists,
    written (atomically) when not. Call after load_weights."""
    if fmt is None and not batch_invariant:
        return model
    fmt = fmt or "float32"
    if fmt not in KERNEL_FORMATS:
        raise InvalidArgumentError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got {fmt!r}")
    kernels()  # build (or load) the kernels now, not inside the first request
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    head_name = "lm_head" if model.lm_head is not None else "tied_lm_head"
    sources = {**linears, head_name: model.head_weight}
    stored = load_file(cache_file) if cache_file is not None and fmt != "float32" and cache_file.exists() else None
    built: dict[str, QuantizedLinear] = {}
    for name, source in sources.items():
        weight, bias = (source.weight, source.bias) if isinstance(source, nn.Linear) else (source, None)
        if stored is not None and f"{name}.weight" in stored:
            scale = stored[f"{name}.scale"]
            built[name] = QuantizedLinear(fmt, stored[f"{name}.weight"], scale, stored.get(f"{name}.bias"), scale.numel(), batch_invariant)
        else:
            built[name] = QuantizedLinear.quantize(weight, bias, fmt, batch_invariant)
    if cache_file is not None and fmt != "float32" and stored is None:
        _save(cache_file, {f"{name}.{key}": t for name, m in built.items() for key, t in m.state_dict().items()})
    head = built.pop(head_name)
    for name, layer in built.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    model.use_head(head)
    return model


_scratch = threading.local()
_SCRATCH_LIMIT = 16 * 2**20  # float32 values (64 MiB): 6x the embedded model's largest projection


def _widening_buffer(rows: int, cols: int) -> torch.Tensor:
    """A [rows, cols] float32 buffer reused by this thread's layers, which widen one after another. A fresh
    tensor per layer cost more in page faults than the widening itself (a gate/up projection of the
    embedded model: 3.9 ms against 0.6 ms into warm memory). A matrix above _SCRATCH_LIMIT values (an LM
    head, widened only when many rows want logits) gets memory of its own, so the buffer never holds it."""
    if rows * cols > _SCRATCH_LIMIT:
        return torch.empty(rows, cols)
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < rows * cols:
        buffer = _scratch.buffer = torch.empty(rows * cols)
    return buffer[: rows * cols].view(rows, cols)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the kernel's blocks [ceil(N / 8), K / 8, 8, 8]: for each 8 columns, 8 rows' values one
    after another, so one block is one contiguous stream (kernels/linear.cpp says why). A last partial
    block is padded with zero rows."""
    n, k = weight.shape
    padded = F.pad(weight, (0, 0, 0, -n % PACK_ROWS))
    return padded.view(-1, PACK_ROWS, k // 8, 8).permute(0, 2, 1, 3).contiguous()


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write-then-rename, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-quant-")
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def quantized_file(entry: Path, fmt: str) -> Path:
    return entry / f"quantized-{fmt}-v{QUANT_VERSION}.safetensors"
