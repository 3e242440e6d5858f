"""int8 linear layers for CPU inference, computed by Kiln's own kernel (kernels/linear.cpp).

Why: decoding one token reads every weight once, and on the CPU that read is the bound, not the
arithmetic; the LM head is most of it. Weights are stored as int8 (one scale per output row). The kernel
quantises each input row to int16 with a scale of its own (enough levels for these layers' widths that
the rounding is far below the weights') and sums products exactly in int32: a row's result never depends
on the other rows of its batch (INV-3), at any row count. One integer multiply-add instruction takes 16
products where a float32 FMA takes 8, which is what batched decode, speculative verification and prefill
need, so every row count takes the kernel. bench/kernels.py measures it against the candidates it
replaced (fbgemm fp16 and dynamic int8, aten's weight-only int8/int4, inductor); bench/weight_formats.py
measures the format on the whole model. Two more were tried and dropped (bench/README.md § kernels.py):
int4 weights in groups of 32 (perplexity far worse, and no faster), and int8 activations per 32-value
block (llama.cpp's Q8_0 dot product: an input rounding of one part in 127 turns float-order differences
upstream into whole steps).

Format "float32" keeps exact weights in the kernel's float32 path (a fixed reduction order per element):
the deterministic mode's format when quantisation is off.

Quantisation happens once per model source and format; `quantize_model` keeps the result next to the
converted weights (see weight_cache) so later starts read it back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from kiln.errors import InvalidArgumentError
from kiln.kernels import kernels
from kiln.models.file_embedding import FileEmbedding
from kiln.models.weight_cache import save_atomically
from kiln.startup import progress

if TYPE_CHECKING:
    from kiln.models.causal_lm import CausalLM

QUANTIZATIONS = ("int8",)
KERNEL_FORMATS = ("float32", *QUANTIZATIONS)
# Wider inputs would leave the kernel fewer than 127 int16 levels (its int32 sums must not overflow).
INT8_MAX_FEATURES = (2**31 - 1) // (127 * 127)
QUANT_VERSION = 2  # bump when the stored quantised format changes (2: packed blocks of 8 rows)
PACK_ROWS = 8  # output rows per packed block (kernels/linear.cpp, kBlock)
_QUANTIZE_ROWS = 4096


class QuantizedLinear(nn.Module):
    """y = x @ W^T + b with W in `fmt`: x [..., in_features] float32 -> [..., out_features] float32.

    Buffers: `weight` (float32 or int8, packed: see `pack`), `scale` (int8: [N]; float32: none), `bias`
    when the layer has one.
    """

    def __init__(self, fmt: str, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                 out_features: int) -> None:
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
        # dispatch would otherwise run on every projection of every step. The buffers are never replaced (the
        # kernels run on the CPU only; nothing moves them).
        if fmt == "float32":
            self._apply_kernel = lambda x: kernels().linear_f32(x, weight, bias, out_features)
        else:
            self._apply_kernel = lambda x: kernels().linear_int8(x, weight, scale, bias)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str) -> QuantizedLinear:
        """From a float32 [N, K] weight (not modified)."""
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise InvalidArgumentError(f"quantization needs float32 CPU weights, got {weight.dtype} on {weight.device}")
        _check_format(fmt, weight.shape[1])
        weight = weight.detach()
        bias = None if bias is None else bias.detach().contiguous()
        if fmt == "float32":
            return cls(fmt, pack(weight), None, bias, weight.shape[0])
        return cls.quantize_blocks(weight.split(_QUANTIZE_ROWS), weight.shape, bias)

    @classmethod
    def quantize_blocks(cls, blocks: Iterable[torch.Tensor], shape: tuple[int, int],
                        bias: torch.Tensor | None = None) -> QuantizedLinear:
        """int8 from a float32 [N, K] matrix given as its consecutive row blocks, each used once. Each row's
        scale and codes depend on that row alone, so the float32 temporaries stay a block's size (a whole
        vocabulary matrix would need several copies of itself at once), and a matrix read from its file a
        block at a time is never resident whole."""
        _check_format("int8", shape[1])
        scale = torch.empty(shape[0])
        q = torch.empty(shape, dtype=torch.int8)
        start = 0
        for rows in blocks:
            end = start + len(rows)
            scale[start:end] = rows.abs().amax(dim=1).clamp(min=1e-12) / 127
            q[start:end] = torch.round(rows / scale[start:end, None]).clamp(-127, 127)
            start = end
        return cls("int8", pack(q), scale, bias, shape[0])

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
        return self._apply_kernel(x)

    def kernel_projection(self) -> Any:
        """The layer as kernels/decoder_layer.h's Projection: what a fused block's kernel computes it with."""
        if self.fmt == "float32":
            return kernels().Projection.float32(self.weight, self.bias, self.out_features)
        return kernels().Projection.int8(self.weight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


def quantize_model(
    model: CausalLM,
    fmt: str | None,
    batch_invariant: bool = False,
    cache_file: Path | None = None,
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> CausalLM:
    """Swap every nn.Linear (fused qkv, o, fused gate/up, down, an untied head) for a QuantizedLinear in
    `fmt` and give the model a quantised LM head, in place; returns the model. A tied embedding table
    stays float32 for lookups. fmt None keeps float32 weights: unchanged unless `batch_invariant`, which
    routes them through the kernel. `cache_file` holds the quantised tensors: read when it exists,
    written (atomically) when not. Call after load_weights; with `tensors` (the HF-named weights), the
    layers' float32 parameters may be left unfilled by it (CausalLM.linear_parameters): each is read
    from `tensors` only when it has to be quantised, and dropped at once, so at most one float32 matrix
    is resident at a time, and none when the cache file has them all."""
    if fmt is None and not batch_invariant:
        return model
    fmt = fmt or "float32"
    if fmt not in KERNEL_FORMATS:
        raise InvalidArgumentError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got {fmt!r}")
    kernels()  # build (or load) the kernels now, not inside the first request
    # Names, not modules: a replaced nn.Linear must become garbage at once, or every float32 matrix read
    # for quantising stays resident until the end (a 1.7B model's first load peaked at 9 GB so).
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    head_pending = not model.head_computes  # a head already computing (the file's blocks) is left as it is
    stored = load_file(cache_file) if cache_file is not None and fmt != "float32" and cache_file.exists() else None
    built: dict[str, QuantizedLinear] = {}
    layers: Iterable[str] = names
    if stored is None and fmt != "float32":
        kept = f" (once: kept in {cache_file.parent})" if cache_file is not None else ""
        layers = progress(names, len(names), f"converting the weights to {fmt}{kept}", "matrices")
    for name in layers:
        built[name] = _stored_layer(stored, name, fmt) or _quantized_layer(model, name, fmt, tensors)
        if name == "lm_head":
            model.use_head(built[name])
        else:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, built[name])
    head_name = "lm_head" if model.lm_head is not None else "tied_lm_head"
    if head_pending and head_name not in built:
        built[head_name] = _stored_layer(stored, head_name, fmt) or _tied_head(model, fmt)
    if cache_file is not None and fmt != "float32" and stored is None:
        save_atomically(cache_file, {f"{name}.{key}": t for name, m in built.items() for key, t in m.state_dict().items()})
    if head_pending:
        model.use_head(built[head_name])
    return model


def _check_format(fmt: str, in_features: int) -> None:
    if fmt not in KERNEL_FORMATS:
        raise InvalidArgumentError(f"quantization must be one of {list(QUANTIZATIONS)}, got {fmt!r}")
    if in_features % 8:
        raise InvalidArgumentError(f"{fmt} weights need in_features divisible by 8, got {in_features}")
    if fmt == "int8" and in_features > INT8_MAX_FEATURES:
        raise InvalidArgumentError(f"int8 weights take at most {INT8_MAX_FEATURES} in_features, got {in_features}")


def _tied_head(model: CausalLM, fmt: str) -> QuantizedLinear:
    """The LM head tied to the embedding table, quantised from it: read from the file a block of rows at a
    time where the table stays there (FileEmbedding), since its float32 copy would be the load's peak (a
    1.7B model's 49k x 2048 table: 400 MB)."""
    embeddings = model.model.embed_tokens
    if fmt == "int8" and isinstance(embeddings, FileEmbedding):
        return QuantizedLinear.quantize_blocks(embeddings.table.blocks(), (embeddings.num_embeddings, embeddings.embedding_dim))
    return QuantizedLinear.quantize(model.head_weight, None, fmt)


def _stored_layer(stored: Mapping[str, torch.Tensor] | None, name: str, fmt: str) -> QuantizedLinear | None:
    if stored is None or f"{name}.weight" not in stored:
        return None
    scale = stored[f"{name}.scale"]
    return QuantizedLinear(fmt, stored[f"{name}.weight"], scale, stored.get(f"{name}.bias"), scale.numel())


def _quantized_layer(model: CausalLM, name: str, fmt: str, tensors: Mapping[str, torch.Tensor] | None) -> QuantizedLinear:
    linear = model.get_submodule(name)
    if tensors is not None:
        model.load_parameters(tensors, [f"{name}.{local}" for local, _ in linear.named_parameters()])
    return QuantizedLinear.quantize(linear.weight, linear.bias, fmt)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the kernel's blocks [ceil(N / 8), K / 8, 8, 8]: for each 8 columns, 8 rows' values one
    after another, so one block is one contiguous stream (kernels/linear.cpp says why). A last partial
    block is padded with zero rows."""
    n, k = weight.shape
    padded = F.pad(weight, (0, 0, 0, -n % PACK_ROWS)) if n % PACK_ROWS else weight  # F.pad copies, even adding none
    return padded.view(-1, PACK_ROWS, k // 8, 8).permute(0, 2, 1, 3).contiguous()


def quantized_file(entry: Path, fmt: str) -> Path:
    return entry / f"quantized-{fmt}-v{QUANT_VERSION}.safetensors"
