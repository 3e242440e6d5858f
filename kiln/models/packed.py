"""Packed weight formats for CPU decode: every projection and the LM head as an fbgemm fp16 or int8 matrix.

Why: decoding one token reads every weight once, and on the CPU that read is the bound, not the
arithmetic. The embedded Gemma 3 270M in fp32 reads 1.07 GB per token, 671 MB of it the 262144 x 640 LM
head, against ~18 GB/s of read bandwidth on the 2-core AVX2 machines here. Measured there, one row
through the LM head: fp32 `x @ W^T` (contiguous) 35 ms; fbgemm fp16 17 ms, relative error 2e-4; fbgemm
dynamic int8 (per-output-channel symmetric weights, activations quantized per call) 9 ms, relative error
~2e-2 (5-7 % on rows with activation outliers, up to 14 % on Gemma's MLP inputs). The aten int4/int8
weight-only kernels have no fast AVX2 path and are slower than fp32 here, so they are not offered.

On the whole embedded model (bench/weight_formats.py, 2 threads, a shared machine): weights read per
decode step 1072 / 536 / 268 MB for float32 / fp16 / int8; batch-1 decode 11.5 / 18.0 / 21.5 tokens/s;
prefill of 512 tokens 262 / 305 / 393 tokens/s; perplexity on 2048 tokens of this repository's READMEs
56.52 / 56.51 / 71.71. fp16 keeps fp32's greedy tokens; int8 costs +27 % perplexity, nearly all of it in
the layer projections, whose inputs carry outlier channels that per-tensor activation scales flatten
(measured on 1024 tokens: int8 LM head with fp16 projections +2.5 %, int8 projections with an fp16 head
+24 %).

Packing happens once, after `CausalLM.load_weights` (which keeps loading by HF names): `pack_weights`
swaps each nn.Linear for a `PackedLinear` and gives the model a packed copy of its LM head, so the fp32
matrices are freed. The embedding table stays fp32 (a tied head's lookups still read it); only the head
matmul is packed. A packed model's weights are final: load before packing.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from kiln.config import WEIGHT_FORMATS
from kiln.errors import InvalidArgumentError, UnavailableError

if TYPE_CHECKING:
    from kiln.models.causal_lm import CausalLM

PACKED_FORMATS = tuple(f for f in WEIGHT_FORMATS if f != "float32")
# Symmetric int8 weights: each output row's largest |w| maps to 63, zero point 0. Not 127: fbgemm's AVX2
# kernel adds pairs of uint8 activation x int8 weight products in int16 (vpmaddubsw), saturating at 32767;
# 2 x 255 x 127 can pass it, 2 x 255 x 63 cannot. Measured on the embedded model's projections, full-range
# weights saturated on some layers (relative error 0.25 where exact 8-bit arithmetic gives 0.056); at +-63
# that layer gives 0.058, and the LM head 0.040 against 0.031. reduce_range (7-bit activations) instead
# does worse on outlier-heavy inputs (0.20 against 0.135 exact on the first down_proj).
_INT8_LEVELS = 63


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W packed by fbgemm: x [..., in_features] float32 -> [..., out_features] float32.

    fmt "fp16": W rounded to fp16, products and sums in fp32 (half the bytes of fp32, ~1e-4 error).
    fmt "int8": W as int8 (7-bit range, see _INT8_LEVELS) with one scale per output row; each call quantizes
    x to uint8 with one scale for the whole tensor, so a few large activations coarsen every other one (a
    quarter of the bytes; 1e-2 to 1e-1 relative error per matmul on the embedded model). The packed matrix is an opaque fbgemm object, not a parameter or buffer; `nbytes` is its
    size, what one forward reads.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str) -> None:
        super().__init__()
        if fmt not in PACKED_FORMATS:
            raise InvalidArgumentError(f"packed weight format must be one of {list(PACKED_FORMATS)}, got {fmt!r}")
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise InvalidArgumentError(
                f"packing needs a float32 CPU weight (fbgemm kernels), got {weight.dtype} on {weight.device}"
            )
        self.out_features, self.in_features = weight.shape
        self.fmt = fmt
        bias = None if bias is None else bias.detach().contiguous()
        with _fbgemm():
            if fmt == "fp16":
                self._packed = torch.ops.quantized.linear_prepack_fp16(weight.detach(), bias)
                self._forward = torch.ops.quantized.linear_dynamic_fp16
            else:
                self._packed = torch.ops.quantized.linear_prepack(_int8_per_row(weight.detach()), bias)
                self._forward = torch.ops.quantized.linear_dynamic
        per_weight = 2 if fmt == "fp16" else 1
        self.nbytes = self.out_features * self.in_features * per_weight + (0 if bias is None else bias.nbytes)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str) -> PackedLinear:
        return cls(linear.weight, linear.bias, fmt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, self._packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


def pack_weights(model: CausalLM, fmt: str) -> CausalLM:
    """Pack `model`'s projections (every nn.Linear: qkv_proj, o_proj, gate_up_proj, down_proj, an untied
    lm_head) and its LM head matmul into `fmt`, in place, freeing the fp32 matrices; returns the model.
    "float32" leaves it as it is. Call after load_weights: a packed model's weights are final."""
    if fmt == "float32":
        return model
    if fmt not in PACKED_FORMATS:
        raise InvalidArgumentError(f"weight_format must be one of {list(WEIGHT_FORMATS)}, got {fmt!r}")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise UnavailableError(f"weight_format {fmt!r} needs PyTorch's fbgemm kernels (x86 CPU builds)")
    head = model.head_weight  # read before the untied lm_head is replaced below
    packed_head = PackedLinear(head, None, fmt)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear.from_linear(child, fmt))
    model.use_packed_head(packed_head)
    return model


@contextlib.contextmanager
def _fbgemm() -> Iterator[None]:
    """Prepack with the fbgemm engine (the fp16 ops exist only there; the int8 one would otherwise follow
    the process-wide engine, onednn included), restoring the caller's choice afterwards."""
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


def _int8_per_row(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] float32 -> qint8 per output channel, symmetric (zero point 0), in +-_INT8_LEVELS."""
    scales = weight.abs().amax(dim=1).clamp(min=1e-8) / _INT8_LEVELS
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # PyTorch marks quantized-tensor constructors deprecated; fbgemm's int8 prepack still takes one.
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_channel(weight, scales.double(), zero_points, 0, torch.qint8)
