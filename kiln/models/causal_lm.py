"""CausalLM: what the runner needs from every model, and loading weights by their Hugging Face names.

Module names mirror transformers (`model.layers.3.mlp.down_proj.weight`) except where modules fuse HF
tensors; those modules list their sources in `hf_sources()`, so one loader serves every architecture.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
from torch import nn

from kiln.errors import InvalidArgumentError
from kiln.kernels import kernels
from kiln.models.config import ModelConfig
from kiln.models.file_embedding import FileEmbedding, StoredRows
from kiln.models.fused_block import FusedBlock
from kiln.models.layers import Attention, GatedMLP, HFSource, RMSNorm
from kiln.models.tensor_source import shapes_of
from kiln.platform import Platform


class Decoder(nn.Module):
    """Holds the HF `model.` submodules: embed_tokens, layers, norm."""

    def __init__(self, config: ModelConfig, layers: list[nn.Module], norm_offset: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm((config.hidden_size,), config.rms_norm_eps, norm_offset)


class CausalLM(nn.Module):
    """A decoder-only LM over the paged KV cache. Subclasses define

    forward(input_ids [N] long, positions [N] long, batch: AttentionBatch) -> [N, hidden], the final-normed
    hidden states of the step's new tokens (sequence after sequence), writing their K/V into the pages.
    """

    def __init__(self, config: ModelConfig, model: Decoder) -> None:
        super().__init__()
        self.config = config
        self.model = model
        # None when tied to the embeddings; a kernel layer (QuantizedLinear, BlockLinear) once given one.
        self.lm_head: nn.Module | None = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self._head_t: torch.Tensor | None = None  # contiguous LM head transpose, built on first use

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, hidden] -> [M, vocab] float32.

        The vocabulary matrix is the largest read of a decode step, and CPU BLAS streams it fastest in
        different orientations by row count: one row, h @ W^T with W^T stored contiguously; several rows,
        W @ h^T (bench/README.md § Design figures). The contiguous W^T is a second copy of the matrix, kept
        on CPU only, where batch-1 decode is the common case (an agent's session). A quantised head
        (kiln.models.quant) has its own kernel and needs no copy."""
        if self.head_computes:
            return self.lm_head(hidden)
        weight = self.head_weight
        if hidden.shape[0] == 1 and Platform.of(weight.device).on_host:
            return (hidden @ self._transposed_head(weight)).float()
        return torch.mm(weight, hidden.T).T.float().contiguous()

    @property
    def head_weight(self) -> torch.Tensor:
        """The fp32 (or model dtype) [vocab, hidden] LM head matrix: the embedding table when tied."""
        if self.lm_head is None:
            return self.model.embed_tokens.weight
        if self.head_computes:
            raise RuntimeError("the LM head is a kernel layer: its float32 matrix is gone")
        return self.lm_head.weight

    @property
    def head_computes(self) -> bool:
        """Whether logits come from a kernel layer of the head's own (use_head), not the float matrix."""
        return self.lm_head is not None and not isinstance(self.lm_head, nn.Linear)

    def use_head(self, head: nn.Module) -> None:
        """Compute logits with `head` (a kernel layer over the head matrix: quantize_model's copy, or the
        file's blocks) from now on. An untied fp32 head and the transposed copy are dropped; a tied
        embedding table stays for lookups."""
        self.lm_head = head
        self._head_t = None

    def linear_parameters(self) -> set[str]:
        """Names of the nn.Linear layers' parameters: what quantize_model replaces."""
        return {
            f"{name}.{local}"
            for name, module in self.named_modules()
            if isinstance(module, nn.Linear)
            for local, _ in module.named_parameters()
        }

    def can_map_embeddings(self, table: StoredRows | None, head_quantised: bool) -> bool:
        """Whether token embeddings may be looked up in `table` (kiln/models/file_embedding.py says why)
        instead of a copy: the table then serves lookups only (the LM head is untied, or quantised into a
        copy of its own), holds what the copy would (the same shape) and the model computes in float32 on
        the CPU, where the rows are read."""
        weight = self.model.embed_tokens.weight
        return (
            table is not None
            and (self.lm_head is not None or head_quantised)
            and (table.rows, table.cols) == tuple(weight.shape)
            and weight.dtype == torch.float32
            and Platform.of(weight.device).on_host
        )

    def map_embeddings(self, table: StoredRows) -> None:
        """Look token embeddings up in `table` from now on (see can_map_embeddings)."""
        self.model.embed_tokens = FileEmbedding(table)

    def use_kernels(self) -> None:
        """Compute norms (with their residual adds), q/k norms + RoPE and the MLP's gated activation with
        Kiln's fused CPU kernels (kernels/norms.cpp, activations.cpp) from now on: float32 on a CPU the
        kernels support. Decode of a small model is dominated by per-op overhead there, and these replace
        about twenty-five ops per layer; results agree with the op-by-op path to float rounding. Widths the
        kernels do not take (norms not a multiple of 8 wide, heads not a multiple of 16) keep the op-by-op
        path. Then every block the kernels compute whole steps as one call where it attends in place
        (kiln/models/fused_block.py): call this with the weights final, as the block's kernel holds them."""
        kernels()  # built (or loaded) now, not inside the first request
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.fused = module.weight.ndim == 1 and module.weight.shape[0] % 8 == 0
            elif isinstance(module, Attention):
                module.fused = module.kernel_ready
            elif isinstance(module, GatedMLP):
                module.fused = True  # the kernel takes every activation of layers.ACTIVATIONS
        for module in self.modules():
            if isinstance(module, FusedBlock):
                module.use_layer_kernel()

    def _transposed_head(self, weight: torch.Tensor) -> torch.Tensor:
        cached = self._head_t
        if cached is None or cached.dtype != weight.dtype:
            cached = self._head_t = weight.T.contiguous()
        return cached

    def load_weights(self, tensors: Mapping[str, torch.Tensor], skip: Collection[str] = ()) -> None:
        """Copy HF-named tensors (any dtype; cast to the model's) into the parameters, but for the
        parameters named in `skip` (filled otherwise: quantised from the tensors one by one, or looked up
        in the file). Raises InvalidArgumentError, before changing anything, on missing or unexpected
        names or wrong shapes."""
        plan = self.hf_plan()
        expected = {source.name for sources in plan.values() for source in sources}
        missing, unexpected = sorted(expected - tensors.keys()), sorted(tensors.keys() - expected)
        if missing or unexpected:
            raise InvalidArgumentError(
                f"{self.config.name or type(self).__name__} weights do not match the model: "
                f"missing {_listing(missing)}; unexpected {_listing(unexpected)}"
            )
        params = dict(self.named_parameters())
        shapes = shapes_of(tensors)
        for name, sources in plan.items():
            _check_shapes(params[name], sources, shapes)
        self.load_parameters(tensors, [name for name in plan if name not in skip])

    def load_parameters(self, tensors: Mapping[str, torch.Tensor], names: Collection[str]) -> None:
        """Fill parameters `names` from the HF-named tensors that make them up (load_weights checked them),
        reading each tensor once."""
        plan = self.hf_plan()
        params = dict(self.named_parameters())
        self._head_t = None  # the transposed LM head copy is rebuilt from the new weights
        with torch.no_grad():
            for name in names:
                row = 0
                for source in plan[name]:
                    params[name][row : row + source.rows].copy_(tensors[source.name])
                    row += source.rows

    def hf_plan(self) -> dict[str, tuple[HFSource, ...]]:
        """Each parameter's name -> the HF tensors filling it, row block by row block. A checkpoint that
        fuses projections as Kiln does (config.fused_checkpoint: Phi-3) fills each parameter from one tensor."""
        fused: dict[str, tuple[HFSource, ...]] = {}
        for prefix, module in () if self.config.fused_checkpoint else self.named_modules():
            hf_sources = getattr(module, "hf_sources", None)
            for local, sources in hf_sources().items() if hf_sources else ():
                fused[f"{prefix}.{local}"] = tuple(
                    HFSource(f"{prefix}.{s.name}", s.rows, s.broadcast) for s in sources
                )
        return {
            name: fused.get(name, (HFSource(name, param.shape[0]),))
            for name, param in self.named_parameters()
        }


def _check_shapes(
    param: torch.Tensor, sources: tuple[HFSource, ...], shapes: Mapping[str, tuple[int, ...]]
) -> None:
    for source in sources:
        expected = param.shape[1:] if source.broadcast else (source.rows, *param.shape[1:])
        actual = shapes[source.name]
        if tuple(actual) != tuple(expected):
            raise InvalidArgumentError(
                f"weight {source.name} has shape {tuple(actual)}, expected {tuple(expected)}"
            )


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit]) or "none"
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
